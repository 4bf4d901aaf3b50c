"""The test "machines" of tests/hosts.py: addresses that reach, hostnames and folders of their
own, a host's death, a cut and a slow link, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import PREFIX, hosts

# A TCP server that answers every connection with its hostname.
SERVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()
"""
CONNECT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=%s)
print(c.recv(100).decode())
"""


def _left_behind(slot: int) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    mine = (f"{PREFIX}{slot}-", f"{PREFIX}{slot}v", f"{PREFIX}{slot}r")
    words = [w.rstrip(":").split("@")[0] for w in (names + links).split()]
    etc = [p.name for p in Path("/etc/netns").glob(f"{PREFIX}{slot}-*")]
    return [w for w in words if w.startswith(mine)] + etc


def _serve(host) -> str:
    """A hostname server on the host's address; its port."""
    server = host.popen([sys.executable, "-c", SERVE, host.address], stdout=subprocess.PIPE,
                        text=True)  # fmt: skip
    return server.stdout.readline().strip()


def _connect(host, address: str, port: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", CONNECT % timeout, address, port]
    return host.run(argv, capture_output=True, text=True, timeout=timeout + 30)


def test_two_hosts_reach_each_other_by_address_and_have_their_own_names(tmp_path):
    with hosts(2) as net:
        a, b = net
        slot = net.slot
        assert a.address != b.address
        names = [h.run(["hostname"], capture_output=True, text=True).stdout.strip() for h in net]
        assert names == [a.name, b.name] and a.name != b.name
        resolve = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
        known = a.run([sys.executable, "-c", resolve, b.name], capture_output=True, text=True)
        assert known.stdout.strip() == b.address, known.stderr
        port = _serve(b)
        answer = _connect(a, b.address, port)
        assert answer.stdout.strip() == b.name, answer.stderr
        from_test = subprocess.run([sys.executable, "-c", CONNECT % 60, b.address, port],
                                   capture_output=True, text=True, timeout=90)  # fmt: skip
        assert from_test.stdout.strip() == b.name, from_test.stderr
        # The test process reaches the hosts as well; loopback is up inside each host.
        assert net.local_address not in (a.address, b.address)
        lo = a.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        assert "UP" in lo
    assert _left_behind(slot) == []


def test_own_copy_of_a_folder_at_the_same_path(tmp_path):
    project = tmp_path / "project"
    (project / "shared-env").mkdir(parents=True)
    (project / "shared-env" / "tool").write_text("original\n")
    (project / "data.txt").write_text("original\n")
    with hosts(2, own_copy=project, shared=("shared-env",)) as net:
        a, b = net
        b.run(["sh", "-c", f"echo written-on-b > {project / 'data.txt'}"], check=True)
        read = [h.run(["cat", str(project / "data.txt")], capture_output=True, text=True).stdout
                for h in net]  # fmt: skip
        assert read == ["original\n", "written-on-b\n"]
        tool = b.run(["cat", str(project / "shared-env" / "tool")], capture_output=True, text=True)
        assert tool.stdout == "original\n", tool.stderr
    assert (project / "data.txt").read_text() == "original\n"


def test_kill_all_ends_every_process_of_a_host_and_only_that_host():
    with hosts(2) as net:
        a, b = net
        # One process in its own group, one started by it in yet another session.
        b.popen(["sh", "-c", "setsid sleep 600 & sleep 600"])
        a_sleeper = a.popen(["sleep", "600"])
        deadline = time.monotonic() + 60
        while len(_pids(b.namespace)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_pids(b.namespace)) >= 2
        b.kill_all()
        assert _pids(b.namespace) == []
        assert a_sleeper.poll() is None
        assert b.run(["true"]).returncode == 0  # the host can start again


def _pids(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()  # fmt: skip


def test_a_cut_network_refuses_then_restores_and_a_slow_link_still_carries():
    with hosts(2) as net:
        a, b = net
        port = _serve(b)
        b.cut_network()
        # However long it waits, nothing answers across a cut link.
        cut = _connect(a, b.address, port, timeout=2)
        assert cut.returncode != 0 and cut.stdout == ""
        b.restore_network()
        back = _connect(a, b.address, port)
        assert back.stdout.strip() == b.name, back.stderr
        b.slow_link("50mbit")
        qdisc = b.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "50Mbit" in qdisc.stdout
        slow = _connect(a, b.address, port)
        assert slow.stdout.strip() == b.name, slow.stderr


def test_a_stale_network_of_a_killed_run_is_removed_at_start(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from hosts import hosts\n"
        "with hosts(1) as net:\n"
        "    print(net.slot, flush=True)\n"
        "    os._exit(0)  # dies without tearing down\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if "Skipped" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    slot = int(done.stdout.strip())
    assert _left_behind(slot) != []
    with hosts(1):
        pass
    assert _left_behind(slot) == []
