"""Servers a project keeps running between commands (its store, its Prefect API): started
detached, so they outlive the command and a Ctrl-C sent to its terminal never reaches them."""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Collection
from pathlib import Path

# Linux's default range for the source ports of outgoing connections, where the kernel's own
# setting cannot be read.
DEFAULT_EPHEMERAL_PORTS = range(32768, 61000)
# Where a server's port is chosen: above the well-known and common service ports.
SERVER_PORTS = range(10000, 65536)


def spawn_detached(
    command: list[str], log_file: Path, cwd: Path, env: dict[str, str]
) -> subprocess.Popen:
    """`command` in a session of its own, its output appended to `log_file` (0600), with umask
    077: what it writes (databases, volumes, folders) is the owner's alone."""
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
            env=env,
            umask=0o077,
        )
    finally:
        os.close(out)


def ephemeral_ports() -> range:
    """The ports this machine's kernel gives outgoing connections (ip_local_port_range, which
    each network namespace sets for itself)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_PORTS
    return range(low, high + 1)


def free_port(host: str, taken: Collection[int] = (), twin_offset: int | None = None) -> int:
    """A port free on `host` for a server to listen on, outside the ephemeral range, and not in
    `taken`; with `twin_offset`, port + twin_offset is free and outside it as well.

    A port the kernel hands out (bind to port 0) is an ephemeral one: between choosing it and
    the server binding it, any outgoing connection may take it as its source port. weed mini
    opens its listeners one after another while its parts already talk to each other, and
    its S3 listener was seen to fail so ("bind: address already in use")."""
    ephemeral = ephemeral_ports()
    offsets = (0,) if twin_offset is None else (0, twin_offset)
    for _ in range(5000):  # about half of SERVER_PORTS lie outside Linux's default range
        port = random.choice(SERVER_PORTS)
        pair = [port + offset for offset in offsets]
        if any(p not in SERVER_PORTS or p in ephemeral or p in taken for p in pair):
            continue
        if all(port_free(host, p) for p in pair):
            return port
    raise OSError(
        f"no free port on {host} outside the range for outgoing connections "
        f"({ephemeral.start}-{ephemeral.stop - 1}, net.ipv4.ip_local_port_range)"
    )


def port_reusable(host: str, port: int) -> bool:
    """Whether a server may take `port` again (its last start's): free, and not one an
    outgoing connection could take before the server binds it (see free_port)."""
    return port not in ephemeral_ports() and port_free(host, port)


def port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host`, as the server will bind it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As the servers bind (Go and uvicorn set SO_REUSEADDR): connections of a stopped
        # server left in TIME_WAIT must not make its port look taken, or a restart moves the
        # endpoint away from clients that still use it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
