"""Ports for servers that bind them seconds after they are chosen."""

from __future__ import annotations

import socket
from pathlib import Path

from trainyard.storage.embedded import _fatal_line
from trainyard.util.daemons import ephemeral_ports, free_port, port_free, port_reusable

HOST = "127.0.0.1"


def test_ephemeral_ports_are_the_kernels_setting():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ephemeral_ports() == range(low, high + 1)


def test_a_free_port_is_out_of_the_ephemeral_range_bindable_and_not_taken():
    ephemeral = ephemeral_ports()
    chosen: list[int] = []
    for _ in range(20):
        chosen.append(free_port(HOST, taken=chosen))
    assert len(set(chosen)) == 20
    assert not set(chosen) & set(ephemeral)
    assert all(port_free(HOST, port) for port in chosen)


def test_a_twin_port_is_free_and_out_of_the_ephemeral_range_as_well():
    ephemeral = ephemeral_ports()
    for _ in range(20):
        port = free_port(HOST, twin_offset=10000)
        assert port + 10000 <= 65535
        assert port not in ephemeral and port + 10000 not in ephemeral


def test_a_saved_port_is_reused_only_out_of_the_ephemeral_range():
    with socket.socket() as kernel_chosen:
        kernel_chosen.bind((HOST, 0))
        ephemeral = kernel_chosen.getsockname()[1]
    assert ephemeral in ephemeral_ports() and port_free(HOST, ephemeral)
    assert not port_reusable(HOST, ephemeral)
    assert port_reusable(HOST, free_port(HOST))


def test_a_port_something_listens_on_is_not_free():
    with socket.socket() as listening:
        listening.bind((HOST, free_port(HOST)))
        listening.listen()
        assert not port_free(HOST, listening.getsockname()[1])


def test_weeds_fatal_line_is_read_from_this_starts_part_of_its_log(tmp_path):
    log = tmp_path / "weed.log"
    earlier = "F1129 07:00:00.000001 master.go:1 an earlier start's failure\n"
    log.write_text(
        earlier
        + "  S3           starting\n"
        + "F1129 07:08:00.717277 s3.go:434 S3 API Server listener on 10.0.0.1:38993 error: "
        "listen tcp 10.0.0.1:38993: bind: address already in use\n" + "goroutine 388 [running]:\n"
    )
    assert _fatal_line(log, len(earlier)) == (
        ": S3 API Server listener on 10.0.0.1:38993 error: "
        "listen tcp 10.0.0.1:38993: bind: address already in use"
    )
    assert _fatal_line(log, log.stat().st_size) == ""
    assert _fatal_line(tmp_path / "missing.log", 0) == ""
