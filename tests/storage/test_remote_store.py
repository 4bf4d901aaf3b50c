"""The store on another machine: host A serves its embedded store on its address
(`trainyard storage up --host`), host B (its own copy of the project at the same path)
exports what `trainyard storage env` prints and uses that store, never one of its own."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosts import HostNet, hosts

from trainyard.checkpoint.signing import SIGNING_KEY_ENV
from trainyard.storage import Store
from trainyard.storage.embedded import PORT_FLAGS
from trainyard.storage.store import ENDPOINT_ENV, StoreSettings

from conftest import BIN, make_project

# Written on host B through trainyard's store API, in its own project's settings.
WRITE_AND_READ = """
import sys
from pathlib import Path
from trainyard.config import load_config
from trainyard.project import ProjectPaths
from trainyard.storage import connect
paths = ProjectPaths.here()
store = connect(load_config(paths.params, []).storage, paths)
Path("upload.bin").write_bytes(b"a file from host B")
print(store.put_file(Path("upload.bin"), "remote-test/upload.bin"))
store.put_bytes("remote-test/object", b"an object from host B")
assert store.get_bytes("remote-test/object") == b"an object from host B"
large = bytes(range(256)) * 8192  # 2 MB: past what the filer keeps inline, on a volume
store.put_bytes("remote-test/large", large)
assert store.get_bytes("remote-test/large") == large
print(store.settings.where)
"""
SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Host A's kernel gives outgoing connections source ports from this window alone (a busy
# machine's connections come anywhere in its range): weed's own parts connect to each other
# while it opens its listeners one by one, so a listener's port in the window can be taken.
EPHEMERAL = range(41000, 41500)


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any store or Prefect settings, plus `extra`."""
    drop = (ENDPOINT_ENV, *SECRET_NAMES, "PREFECT_API_URL", "PREFECT_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, **extra}


def _exports(text: str) -> dict[str, str]:
    found = re.findall(r"^export (\w+)=(\S+)$", text, re.M)
    return {name: value.strip("'") for name, value in found}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[HostNet, Path, dict[str, str]]]:
    """Host A serving its project's store on A's address; B with its own project copy; the
    lines `trainyard storage env` printed on A."""
    project = make_project(tmp_path_factory.mktemp("remote") / "project")
    trainyard = str(BIN / "trainyard")
    with hosts(2, own_copy=project, shared=()) as net:
        a = net[0]
        window = f"net.ipv4.ip_local_port_range={EPHEMERAL.start} {EPHEMERAL.stop - 1}"
        assert a.run(["sysctl", "-qw", window]).returncode == 0
        # A workstation first: the store up on loopback once, as `make run` leaves it. weed
        # then keeps the saved ip=127.0.0.1 where -ip equals its default, the address it
        # detects: A's own, the one `--host` names below.
        for command in (["up"], ["down"]):
            done = a.run([trainyard, "storage", *command], cwd=project, env=_clean_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
        up = a.run([trainyard, "storage", "up", "--host", a.address], cwd=project,
                   env=_clean_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            own_key = {k: v for k, v in _clean_env().items() if k != SIGNING_KEY_ENV}
            env = a.run([trainyard, "storage", "env"], cwd=project, env=own_key,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
            # The project's signing key, made now, for the other machines to copy.
            key = project / ".trainyard" / "signing.key"
            assert env.returncode == 0 and env.stderr.splitlines() == [
                f"note: copy {key} to the same place in the project on every other machine "
                "(mode 0600): checkpoints are signed and checked with it"
            ], env.stderr
            mode = a.run(["stat", "-c", "%a", str(key)], capture_output=True, text=True)
            assert mode.stdout.strip() == "600", mode
            yield net, project, _exports(env.stdout)
        finally:
            a.run([trainyard, "storage", "down"], cwd=project, env=_clean_env(), timeout=120)


def test_env_names_the_store_at_the_address_it_serves(served):
    net, _, exports = served
    assert set(exports) == {ENDPOINT_ENV, *SECRET_NAMES}
    assert re.fullmatch(rf"http://{re.escape(net[0].address)}:\d+", exports[ENDPOINT_ENV])


def test_the_stores_ports_lie_outside_the_range_for_outgoing_connections(served):
    net, project, exports = served
    saved = net[0].run(["cat", str(project / ".trainyard/s3/ports.json")], capture_output=True)
    ports = json.loads(saved.stdout)
    assert set(ports) == set(PORT_FLAGS)
    assert not set(ports.values()) & set(EPHEMERAL), ports
    assert int(exports[ENDPOINT_ENV].rsplit(":", 1)[1]) == ports["s3.port"]


def test_host_b_writes_and_reads_through_hosts_a_store_and_starts_none(served):
    net, project, exports = served
    a, b = net
    done = b.run([sys.executable, "-c", WRITE_AND_READ], cwd=project, env=_clean_env(**exports),
                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at {exports[ENDPOINT_ENV]}" in done.stdout
    # The same objects, read here (the test process reaches A's address) with A's settings.
    store = Store(_settings(exports))
    assert store.get_bytes("remote-test/upload.bin") == b"a file from host B"
    assert store.get_bytes("remote-test/object") == b"an object from host B"
    # B never started a store of its own: no server in its project, no weed on the host.
    assert b.run(["test", "-e", str(project / ".trainyard/s3/server.json")]).returncode == 1
    assert "weed" not in _commands_on(b)


@pytest.mark.slow
def test_a_run_on_host_b_keeps_its_checkpoints_in_hosts_a_store(served):
    net, project, exports = served
    b = net[1]
    tiny = ["-S", "train.epochs=1", "-S", "model.options={hidden_sizes: [8]}"]
    done = b.run([str(BIN / "trainyard"), "run", "--run-id", "on-b", *tiny], cwd=project,
                 env=_clean_env(**exports), capture_output=True, text=True,
                 timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    store = Store(_settings(exports))
    assert "run.json" in {Path(k).name for k in store.list_files("runs/on-b")}
    assert exports["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr
    assert "weed" not in _commands_on(b)


def test_wrong_credentials_are_refused(served):
    net, project, exports = served
    wrong = {**exports, "AWS_SECRET_ACCESS_KEY": "sentinel-wrong-secret-42"}
    done = net[1].run([sys.executable, "-c", WRITE_AND_READ], cwd=project,
                      env=_clean_env(**wrong), capture_output=True, text=True,
                      timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert "was denied; check AWS_ACCESS_KEY_ID" in done.stderr
    assert "sentinel-wrong-secret-42" not in done.stderr


def test_the_store_listens_on_no_address_it_was_not_asked_to_serve(served):
    net, _, exports = served
    a, b = net
    port = exports[ENDPOINT_ENV].rsplit(":", 1)[1]
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 30)"
    reached = b.run([sys.executable, "-c", probe, a.address, port], capture_output=True)
    assert reached.returncode == 0, reached.stderr
    # Every socket weed listens on: the served address, or A's own loopback (weed's local
    # listeners, reachable only from A itself, as a loopback-only store is); no wildcard.
    listening = a.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines()}
    assert a.address in addresses and addresses <= {a.address, "127.0.0.1"}, listening


def test_a_store_on_loopback_is_not_moved_and_a_bad_address_is_one_line(tmp_path):
    project = make_project(tmp_path / "project")
    trainyard = str(BIN / "trainyard")
    with hosts(1) as net:
        a = net[0]

        def storage(*args: str) -> subprocess.CompletedProcess[str]:
            return a.run([trainyard, "storage", *args], cwd=project, env=_clean_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip

        try:
            assert storage("up").returncode == 0
            moved = storage("up", "--host", a.address)
            assert moved.returncode == 2
            assert moved.stderr.strip().splitlines() == [
                f"trainyard: error: the embedded store already serves 127.0.0.1, not "
                f"{a.address}; stop it with `trainyard storage down`, then "
                f"`trainyard storage up --host {a.address}`"
            ]
            env = storage("env")
            assert "serves loopback only" in env.stderr and ENDPOINT_ENV in env.stdout
        finally:
            storage("down")
        for bad, says in [
            ("not-an-address", "is not an IPv4 address"),
            ("0.0.0.0", "would serve every network"),
            ("192.0.2.77", "cannot serve the store on 192.0.2.77"),  # not an address of A
        ]:
            refused = storage("up", "--host", bad)
            lines = refused.stderr.strip().splitlines()
            assert refused.returncode == 2 and len(lines) == 1 and says in lines[0], lines
        assert storage("status").returncode == 3  # nothing was started


def _settings(exports: dict[str, str]) -> StoreSettings:
    return StoreSettings("trainyard", "", exports[ENDPOINT_ENV], exports[SECRET_NAMES[0]],
                         exports[SECRET_NAMES[1]])  # fmt: skip


def _commands_on(host) -> str:
    """The command lines of every process running on the host now."""
    pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                          text=True).stdout.split()  # fmt: skip
    lines = []
    for pid in pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # ended meanwhile
    return "\n".join(lines)


# The store served on an address that then leaves the machine (a laptop on another network,
# a re-addressed interface): weed lives on, nothing reaches it. In a network namespace of its
# own, on a veth it made, so no address of the machine is touched.
SILENT_STORE = """
set -u
ip link set lo up
ip link add ty-gone type veth peer name ty-peer && ip link set ty-peer up
ip addr add 10.77.0.1/32 dev ty-gone && ip link set ty-gone up
"$BIN/trainyard" storage up --host 10.77.0.1 > /dev/null || exit 9
ip addr del 10.77.0.1/32 dev ty-gone
"$BIN/trainyard" storage up; echo "up: $?"
"$BIN/trainyard" storage status; echo "status: $?"
pid=$(sed 's/.*"pid": \\([0-9]*\\).*/\\1/' .trainyard/s3/server.json)
"$BIN/trainyard" storage down; echo "down: $?"  # SIGTERM unheeded, SIGKILL after 15 s
state=$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)  # a zombie (Z) is gone, not yet reaped
[ -n "$state" ] && [ "$state" != Z ] && echo "weed: alive" || echo "weed: gone"
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
    reason="a network namespace of its own needs root, unshare and ip",
)
def test_a_store_whose_address_left_is_refused_by_up_and_stopped_by_down(tmp_path):
    """`up` beside a running weed that does not answer would start a second one on its data;
    `down` dropped its state file and left it running. Now: one line, then stopped."""
    project = make_project(tmp_path / "project")
    env = _clean_env(BIN=str(BIN))
    try:
        done = subprocess.run(
            ["unshare", "--net", "sh", "-c", SILENT_STORE],
            cwd=project, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:  # whatever failed, no weed of this project outlives the test
        subprocess.run(["pkill", "-KILL", "-f", f"weed .*-dir={project}/"], check=False)
    out = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr[-3000:]
    [refused] = done.stderr.strip().splitlines()
    assert re.fullmatch(
        r"trainyard: error: the embedded store \(SeaweedFS, pid \d+\) runs but does not answer "
        r"at http://10\.77\.0\.1:\d+ \(has that address left this machine\?\); stop it with "
        r"`trainyard storage down`, then `trainyard storage up` \(--host ADDR to serve another "
        r"address\)",
        refused,
    ), refused
    assert "up: 2" in out and "status: 3" in out, out
    assert any(re.match(r"embedded store \(pid \d+\) runs but does not answer", o) for o in out)
    assert out[-3:] == ["embedded store stopped", "down: 0", "weed: gone"]
