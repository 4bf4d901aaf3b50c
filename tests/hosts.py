"""Several "machines" on this one: Linux network namespaces joined by a switch, for tests.

Each host is a network namespace with its own address (interface `eth0`, loopback up), its
own hostname (a UTS namespace per command; every host's /etc/hosts names them all) and, when asked, its own copy of a folder at the
same path (a mount namespace per command, the copy bind-mounted over the path). The hosts
hang off a bridge in a namespace of its own (the "switch"), so nothing is added to the root
namespace's bridges or firewall; one more veth joins the root namespace to the switch, so the
test process itself reaches every host (`HostNet.local_address`).

Two test processes at once (pytest-xdist workers) never collide: each network takes a slot
0..253, held by an flock for its whole life, and everything it makes is named and addressed
from that slot: namespaces `tyh<slot>-<i>` / `tyh<slot>-sw`, links `tyh<slot>v<i>` /
`tyh<slot>r`, addresses 10.213.<slot>.<i+1>/24 (the root namespace .254). A slot's lock is
free again once its process dies, so anything left under a free slot's names is stale (a
killed earlier run) and is removed before slots are taken.

Needs root and `ip netns`; `require_hosts()` skips the test with the reason where either
is missing (CI runs as root, so there these tests really run).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

PREFIX = "tyh"
SUBNET = "10.213"
SLOTS = range(254)
LOCK_DIR = Path(tempfile.gettempdir()) / "trainyard-hosts"
# `ip netns exec NAME` bind-mounts the files of /etc/netns/NAME over /etc's: each host's
# /etc/hosts names every host, as a LAN's DNS would (torchrun resolves its own hostname).
NETNS_ETC = Path("/etc/netns")
# Killed processes leave the namespace within milliseconds; this is only a deadline.
KILL_DEADLINE_S = 60.0
# In the mount namespace of one command: the host's hostname, then its copies over the
# original paths. "$0" is the first copy pair's count; pairs follow, then the command.
_ENTER = r"""
set -e
hostname "$1"; shift
n="$1"; shift
while [ "$n" -gt 0 ]; do mount --rbind "$1" "$2"; shift 2; n=$((n-1)); done
exec "$@"
"""


def require_hosts() -> None:
    """Skip the calling test, saying why, where network namespaces cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces (CI runs as root)")
    for tool in ("ip", "unshare", "tc", "hostname", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs `{tool}` to make network namespaces")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"`ip netns` is unavailable: {probe.stderr.strip()}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    listing = _ip("netns", "list").stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _links() -> list[str]:
    listing = _ip("-o", "link", "show").stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", listing, re.M)]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process in the namespace until none is left (a host dying at once)."""
    deadline = time.monotonic() + KILL_DEADLINE_S
    while True:
        done = _ip("netns", "pids", namespace, check=False)
        pids = [int(p) for p in done.stdout.split() if p.isdigit()]
        # A failed listing (a process gone in the middle of it) proves nothing: list again.
        if not pids and (done.returncode == 0 or namespace not in _namespaces()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} outlived SIGKILL in namespace {namespace}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _remove_slot(slot: int) -> None:
    """Remove every namespace and link named from this slot, with their processes."""
    for namespace in _namespaces():
        if namespace.startswith(f"{PREFIX}{slot}-"):
            _kill_namespace_processes(namespace)
            _ip("netns", "del", namespace, check=False)
    for link in _links():
        if link.startswith((f"{PREFIX}{slot}v", f"{PREFIX}{slot}r")):
            _ip("link", "del", link, check=False)
    for etc in NETNS_ETC.glob(f"{PREFIX}{slot}-*"):
        shutil.rmtree(etc, ignore_errors=True)


def _open_lock(slot: int) -> IO[str] | None:
    """The slot's lock, held, or None when another living process holds it."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    handle = open(LOCK_DIR / f"slot-{slot}.lock", "w")  # noqa: SIM115 - held for the net's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _clean_stale() -> None:
    """Remove what killed earlier runs left behind: names of slots nobody holds."""
    names = _namespaces() + _links()
    pattern = re.compile(rf"^{PREFIX}(\d+)[-vr]")
    for slot in sorted({int(m.group(1)) for n in names if (m := pattern.match(n))}):
        handle = _open_lock(slot)
        if handle is not None:
            _remove_slot(slot)
            handle.close()


def _take_slot() -> tuple[int, IO[str]]:
    start = os.getpid() % len(SLOTS)
    for offset in range(len(SLOTS)):
        slot = SLOTS[(start + offset) % len(SLOTS)]
        handle = _open_lock(slot)
        if handle is not None:
            _remove_slot(slot)  # a free slot may still hold a dead run's names
            return slot, handle
    raise RuntimeError("every network slot is taken by a living test process")


class Host:
    """One "machine": a network namespace with its address, hostname and folder copies."""

    def __init__(self, net: HostNet, index: int, copies: Sequence[tuple[Path, Path]]) -> None:
        self.index = index
        self.name = f"host-{chr(ord('a') + index)}"
        self.namespace = f"{PREFIX}{net.slot}-{index}"
        self.address = f"{SUBNET}.{net.slot}.{index + 1}"
        self.switch_port = f"{PREFIX}{net.slot}v{index}"
        self._net = net
        self._copies = list(copies)  # (copy, original path) pairs, bound in this order
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The command line running argv on this host (its network, hostname, copies)."""
        pairs = [str(p) for pair in self._copies for p in pair]
        return [
            "ip", "netns", "exec", self.namespace,
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _ENTER, "enter", self.name, str(len(self._copies)), *pairs,
            *[str(a) for a in argv],
        ]  # fmt: skip

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run of argv on this host; keyword arguments as subprocess.run's."""
        return subprocess.run(self.argv(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A long-lived process on this host in a session of its own; killed with its whole
        process group (and every other process of the host) at teardown."""
        proc = subprocess.Popen(self.argv(argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """The host dies: SIGKILL every process in its namespace, whatever its group."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        _kill_namespace_processes(self.namespace)
        for proc in self._procs:
            proc.wait()  # reap: none is left running, so this returns at once

    def power_cycle(self) -> None:
        """The host loses power and boots again with nothing running: its network is cut
        first, so that no process of it tells anyone as it dies (as a guardian would)."""
        self.cut_network()
        self.kill_all()
        self.restore_network()

    def cut_network(self) -> None:
        """Unplug the host: its interface goes down (its processes live on)."""
        _ip("-n", self.namespace, "link", "set", "eth0", "down")

    def restore_network(self) -> None:
        """Plug the host back in (its address and route come back with the link). Returns
        once the link carries, with what the hosts learnt while it was cut forgotten: a
        neighbour entry left FAILED answers "no route to host" for a while after."""
        _ip("-n", self.namespace, "link", "set", "eth0", "up")
        _ip("-n", self.namespace, "route", "replace", f"{SUBNET}.{self._net.slot}.0/24",
            "dev", "eth0")  # fmt: skip
        deadline = time.monotonic() + 60
        while "LOWER_UP" not in _ip("-n", self.namespace, "link", "show", "eth0").stdout:
            assert time.monotonic() < deadline, f"{self.name}'s link never came up"
            time.sleep(0.1)
        for namespace in [*(host.namespace for host in self._net.hosts), None]:
            where = ["-n", namespace] if namespace else []
            _ip(*where, "neigh", "flush", "to", f"{SUBNET}.{self._net.slot}.0/24", check=False)

    def slow_link(self, rate: str = "50mbit") -> None:
        """Shape the host's link to `rate` both ways (tc tbf on each end of its veth)."""
        shape = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "400ms"]
        _ip("netns", "exec", self.namespace, "tc", "qdisc", "replace", "dev", "eth0", *shape)
        _ip("netns", "exec", self._net.switch, "tc", "qdisc", "replace", "dev",
            self.switch_port, *shape)  # fmt: skip

    def fast_link(self) -> None:
        """Take the shaping of slow_link off again."""
        _ip("netns", "exec", self.namespace, "tc", "qdisc", "del", "dev", "eth0", "root",
            check=False)  # fmt: skip
        _ip("netns", "exec", self._net.switch, "tc", "qdisc", "del", "dev", self.switch_port,
            "root", check=False)  # fmt: skip


class HostNet:
    """N hosts on one switch; build with `hosts(...)`, which also tears it down."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.switch = f"{PREFIX}{slot}-sw"
        self.root_link = f"{PREFIX}{slot}r"
        self.local_address = f"{SUBNET}.{slot}.254"
        self.hosts: list[Host] = []

    def build(self, count: int, copies: list[list[tuple[Path, Path]]]) -> None:
        _ip("netns", "add", self.switch)
        self._in_switch("link", "add", "br0", "type", "bridge")
        self._in_switch("link", "set", "br0", "up")
        self._in_switch("link", "set", "lo", "up")
        for index in range(count):
            host = Host(self, index, copies[index])
            _ip("netns", "add", host.namespace)
            self._plug(host.switch_port, host.namespace, host.address)
            self.hosts.append(host)
        # The test process's own port, so it reaches the hosts' servers too.
        self._plug(self.root_link, None, self.local_address)
        names = "".join(f"{h.address}\t{h.name}\n" for h in self.hosts)
        for host in self.hosts:
            etc = NETNS_ETC / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{names}")

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def _in_switch(self, *ip_args: str) -> None:
        _ip("-n", self.switch, *ip_args)

    def _plug(self, port: str, namespace: str | None, address: str) -> None:
        """A veth from the switch's bridge to `namespace` (None: the root one), addressed."""
        peer = f"{port}p"
        _ip("link", "add", port, "type", "veth", "peer", "name", peer)
        _ip("link", "set", port, "netns", self.switch)
        self._in_switch("link", "set", port, "master", "br0")
        self._in_switch("link", "set", port, "up")
        inside = [] if namespace is None else ["-n", namespace]
        if namespace is not None:
            _ip("link", "set", peer, "netns", namespace)
            _ip("-n", namespace, "link", "set", peer, "name", "eth0")
            _ip("-n", namespace, "link", "set", "lo", "up")
            peer = "eth0"
        else:
            _ip("link", "set", peer, "name", self.root_link)
            peer = self.root_link
        _ip(*inside, "addr", "add", f"{address}/24", "dev", peer)
        _ip(*inside, "link", "set", peer, "up")

    def teardown(self) -> None:
        for host in self.hosts:
            host.kill_all()
        _remove_slot(self.slot)


def _copy_tree(original: Path, copy: Path, shared: Sequence[str]) -> list[tuple[Path, Path]]:
    """Copy `original` to `copy`, except the top-level names in `shared`: those get an empty
    placeholder, bound to the original's own entry first (before the copy hides it)."""
    names = set(shared)
    shutil.copytree(
        original, copy, symlinks=True, ignore=lambda d, n: names if Path(d) == original else []
    )
    binds = []
    for name in shared:
        if (original / name).is_dir():
            (copy / name).mkdir()
            binds.append((original / name, copy / name))
    return [*binds, (copy, original)]


@contextlib.contextmanager
def hosts(
    count: int,
    *,
    own_copy: Path | str | None = None,
    shared: Sequence[str] = (".venv",),
    workdir: Path | str | None = None,
) -> Iterator[HostNet]:
    """`count` hosts on one switch. With `own_copy`, every host but the first sees its own
    copy of that folder at the same path (the first sees the original); the top-level
    entries named in `shared` (default the virtual environment) are the original's on every
    host. Copies go under `workdir` (default a temporary folder, removed afterwards).
    Everything made is removed on exit, whatever the test did. Yields the HostNet: iterate
    or index it for the hosts (`a, b = net`); they reach each other by `host.address`, and
    the test process reaches them from `net.local_address`."""
    require_hosts()
    _clean_stale()
    slot, lock = _take_slot()
    net = HostNet(slot)
    scratch = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="trainyard-hosts-"))
    try:
        copies: list[list[tuple[Path, Path]]] = [[] for _ in range(count)]
        if own_copy is not None:
            original = Path(own_copy).resolve()
            for index in range(1, count):
                copy = scratch / f"host-{chr(ord('a') + index)}" / original.name
                copy.parent.mkdir(parents=True, exist_ok=True)
                copies[index] = _copy_tree(original, copy, shared)
        net.build(count, copies)
        yield net
    finally:
        try:
            net.teardown()
        finally:
            lock.close()
            if workdir is None:
                shutil.rmtree(scratch, ignore_errors=True)
