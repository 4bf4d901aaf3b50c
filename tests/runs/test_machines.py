"""Every machine's part in a run: each round's hosts, gathered by real torchrun workers, and
the record's nodes and host changes built from them."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from trainyard.project import ProjectPaths
from trainyard.report.data import run_row
from trainyard.runs.lease import RunLease
from trainyard.runs.machines import HostChange, machines_seen
from trainyard.runs.record import ExperimentInfo, RunRecord, now, save_record
from trainyard.runtime.hosts import HOSTS_FILE, recorded_rounds

from conftest import trainyard_cli
from tests_support import loopback_endpoint
from training_jobs import (
    kill_worker,
    module_store,
    params,
    prepare_project,
    save_run,
    train,
    wait_for,
)

TESTS = os.path.dirname(os.path.dirname(__file__))
GATHERED = re.compile(r"hosts of the (\d+) ranks gathered in ([\d.]+) ms")


def _rounds(folder, *rounds: tuple[int, int, float, list[str], list[int]]) -> None:
    """hosts.json as rank 0 writes it: (launch, attempt, started_at, hosts, node_ranks)."""
    keys = ("launch", "attempt", "started_at", "hosts", "node_ranks")
    rows = [dict(zip(keys, found, strict=True)) for found in rounds]
    (folder / HOSTS_FILE).write_text(json.dumps(rows))


def _when(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


def test_a_restart_on_another_host_is_a_host_change_and_a_new_node_stay(tmp_path):
    """Node 1 (ranks 2, 3) fails on host-b; the restart brings it back on host-c, then a
    later round runs without it (scaled down to node 0)."""
    _rounds(
        tmp_path,
        (0, 0, 1000.0, ["host-a", "host-a", "host-b", "host-b"], [0, 0, 1, 1]),
        (0, 1, 1060.0, ["host-a", "host-a", "host-c", "host-c"], [0, 0, 1, 1]),
        (0, 2, 1120.0, ["host-a", "host-a"], [0, 0]),
    )
    nodes, rank_hosts, changes = machines_seen(tmp_path, 1200.0)
    stays = [(n.node_rank, n.host, n.workers, n.started_at, n.ended_at) for n in nodes]
    at = {t: _when(t) for t in (1000.0, 1060.0, 1120.0, 1200.0)}
    assert stays == [
        (0, "host-a", 2, at[1000.0], at[1200.0]),
        (1, "host-b", 2, at[1000.0], at[1060.0]),
        (1, "host-c", 2, at[1060.0], at[1120.0]),
    ]
    assert [r.hosts for r in rank_hosts][1] == ["host-a", "host-a", "host-c", "host-c"]
    assert [(r.round, r.launch, r.attempt, r.started_at, r.node_ranks) for r in rank_hosts][2] == (
        2,
        0,
        2,
        at[1120.0],
        [0, 0],
    )
    assert changes == [
        HostChange(round=1, at=at[1060.0], rank=2, before="host-b", after="host-c"),
        HostChange(round=1, at=at[1060.0], rank=3, before="host-b", after="host-c"),
        HostChange(round=2, at=at[1120.0], rank=2, before="host-c", after=None),
        HostChange(round=2, at=at[1120.0], rank=3, before="host-c", after=None),
    ]


def test_a_new_launch_starts_new_stays_and_unknown_rounds_are_skipped(tmp_path):
    _rounds(
        tmp_path,
        (0, 0, 1000.0, ["host-a"], [0]),
        (1, 0, 2000.0, ["host-a"], [0]),  # the run continued by a later launch
    )
    rows = json.loads((tmp_path / HOSTS_FILE).read_text())
    (tmp_path / HOSTS_FILE).write_text(json.dumps([*rows, {"attempt": "?"}]))
    nodes, rank_hosts, changes = machines_seen(tmp_path, None)
    assert [(n.started_at, n.ended_at) for n in nodes] == [
        (_when(1000.0), _when(2000.0)),
        (_when(2000.0), None),
    ]
    assert len(rank_hosts) == 2 and changes == []
    assert machines_seen(tmp_path / "none", 1.0) == ([], [], [])


def test_a_record_without_machines_still_loads():
    old = {"run_id": "old", "created_at": "2025-01-01T00:00:00+00:00", "params": {}}
    record = RunRecord.model_validate(old)
    assert record.nodes == [] and record.rank_hosts == [] and record.host_changes == []


def test_runs_show_and_the_page_show_each_node_and_each_host_move(project, store):
    """A record as a moved rank leaves it: `runs show` has a line per node and per move, the
    comparison page's row names the nodes."""
    _rounds(
        project,
        (0, 0, 1000.0, ["host-a", "host-b"], [0, 1]),
        (0, 1, 1060.0, ["host-a", "host-c"], [0, 1]),
    )
    nodes, rank_hosts, changes = machines_seen(project, 1200.0)
    record = RunRecord(run_id="moved", created_at=now(), params={}, status="completed")
    record.nodes, record.rank_hosts, record.host_changes = nodes, rank_hosts, changes
    # Rank 0 tracked offline, rank 1 with tracking off: only rank 0's experiment is named.
    record.tracking = [
        ExperimentInfo(rank=0, mode="offline", key="abc"),
        ExperimentInfo(rank=1, mode="none"),
    ]
    save_record(store, record)
    shown = trainyard_cli("runs", "show", "moved", cwd=project)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = [_when(t) for t in (1000.0, 1060.0, 1200.0)]
    assert [line for line in lines if line.startswith(("node ", "host moved "))] == [
        f"node        0 on host-a: 1 worker, {at[0]} to {at[2]}",
        f"node        1 on host-b: 1 worker, {at[0]} to {at[1]}",
        f"node        1 on host-c: 1 worker, {at[1]} to {at[2]}",
        f"host moved  rank 1: host-b -> host-c at {at[1]}",
    ]
    assert "comet       rank0:offline:abc" in lines
    assert run_row(record, "completed").nodes == "0: host-a x1, 1: host-b x1, 1: host-c x1"


def test_runs_show_of_a_running_run_has_its_rounds_and_resumes_so_far(project, store):
    """On node 0's machine, mid-run: the record gets its nodes and resumes when training
    ends, `runs show` reads them from the run's staging folder meanwhile (a node joined an
    elastic run that began alone: a restart torchrun does not count)."""
    folder = ProjectPaths(project).staging / "live"
    folder.mkdir(parents=True)
    _rounds(folder, (0, 0, 1000.0, ["host-a"], [0]), (0, 0, 1060.0, ["host-a", "host-b"], [0, 1]))
    joined = {"attempt": 0, "from_step": 10, "steps_redone": 3, "after": "node joined"}
    (folder / "progress.json").write_text(json.dumps({"resumes": [joined]}))
    save_record(store, RunRecord(run_id="live", created_at=now(), params={}, status="running"))
    with RunLease(store, "live"):  # its owner at work
        shown = trainyard_cli("runs", "show", "live", cwd=project)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = [_when(t) for t in (1000.0, 1060.0)]
    assert [line for line in lines if line.startswith(("node ", "host moved "))] == [
        f"node        0 on host-a: 1 worker, {at[0]} to -",
        f"node        1 on host-b: 1 worker, {at[1]} to -",
        f"host moved  rank 1: (none) -> host-b at {at[1]}",
    ]
    assert "workers     2 (the latest round's; device known when training ends)" in lines
    assert "restarts    1: 1 node joined (3 steps redone)" in lines
    assert "resumed     at step 10 (node joined)" in lines


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "machines-tests")
    paths = prepare_project(tmp_path_factory.mktemp("machines") / "project", store.settings)
    return paths, store


@pytest.mark.slow
@pytest.mark.distributed
def test_two_workers_on_one_node_are_node_0_on_this_host(env):
    paths, store = env
    record = save_run(store, "one-node", params(train={"epochs": 1}))
    job, thread = train(paths, store, record)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    nodes, rank_hosts, changes = machines_seen(paths.staging / "one-node", None)
    host = socket.gethostname()
    assert [(n.node_rank, n.host, n.workers) for n in nodes] == [(0, host, 2)]
    assert [(r.launch, r.attempt, r.hosts, r.node_ranks) for r in rank_hosts] == [
        (0, 0, [host, host], [0, 0])
    ]
    assert changes == []
    [gathered] = [GATHERED.search(line) for line in job.lines if GATHERED.search(line)]
    print(f"hosts gathered over 2 ranks in {gathered[2]} ms")
    assert gathered[1] == "2"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_on_loopback_are_listed_with_their_workers(env):
    """Two torchrun launchers (2 nodes x 1 worker) at a c10d rendezvous on loopback: both
    nodes on this host here; each rank's node rank tells them apart."""
    paths, store = env
    endpoint = loopback_endpoint()
    nodes_settings = {"workers": 1, "nnodes": 2, "rdzv_endpoint": endpoint, "epochs": 1}
    record = save_run(store, "two-nodes", params(train=nodes_settings))
    launchers = [train(paths, store, record, node_rank=rank) for rank in (0, 1)]
    for job, thread in launchers:
        thread.join(timeout=600)
        assert job.error is None, "\n".join(job.lines[-60:])
    nodes, rank_hosts, _ = machines_seen(paths.staging / "two-nodes", None)
    host = socket.gethostname()
    assert [(n.node_rank, n.host, n.workers) for n in nodes] == [(0, host, 1), (1, host, 1)]
    assert [(r.hosts, r.node_ranks) for r in rank_hosts] == [([host, host], [0, 1])]


# Node 1's launcher, as `trainyard join` runs it, in a process of its own: its UTS namespace
# gives it its own host name while the network (loopback, the store) stays shared.
NODE_1 = """
import json, sys
from pathlib import Path
from trainyard.config import config_from_dict
from trainyard.runtime.launch import run_worker
from trainyard.storage import StoreSettings
root, run_id, run_params, restarts = sys.argv[1:]
train = config_from_dict(json.loads(run_params)).train.model_copy(update={"node_rank": 1})
store_env = StoreSettings.from_worker_env().worker_env()
args = ["train", "--run-id", run_id]
run_worker(Path(root), train, store_env, args, print, int(restarts), rdzv_id=run_id)
"""
own_host_names = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="a host name of its own for node 1 needs root, unshare and nsenter",
)


def _node_1_on(host: str, paths, store, record, restarts: int) -> subprocess.Popen:
    """Node 1's launcher on host `host` (a UTS namespace of its own)."""
    command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host]
    command += [sys.executable, "-c", NODE_1, str(paths.root), record.run_id]
    command += [json.dumps(record.params), str(restarts)]
    env = os.environ | store.settings.worker_env() | {"PYTHONPATH": TESTS}
    return subprocess.Popen(
        command, cwd=paths.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _two_hosts(paths, store, run_id: str, restarts: int, during=None):
    """Node 0 here, node 1 on host node-b, each with `restarts`; `during(node_1)` runs
    while they train."""
    endpoint = loopback_endpoint()
    nodes = {"workers": 1, "nnodes": 2, "rdzv_endpoint": endpoint, "epochs": 1}
    # A restart's test trains 0.2 s steps: seconds of training left after the first round.
    model = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.2}} if restarts else {}
    record = save_run(store, run_id, params(train=nodes, model=model))
    node_1 = _node_1_on("node-b", paths, store, record, restarts)
    output: list[bytes] = []
    assert node_1.stdout is not None  # started with stdout=PIPE
    lines = node_1.stdout
    reader = threading.Thread(target=lambda: output.extend(lines), daemon=True)
    reader.start()
    # The launcher's thread reads the environment when it builds the workers' (and again at
    # each restart): PYTHONPATH stays set until it has ended.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", TESTS)  # workers import tests_support
        job, thread = train(paths, store, record, max_restarts=restarts)
        if during is not None:
            during(node_1)
        thread.join(timeout=600)
    assert node_1.wait(timeout=600) == 0, b"".join(output)[-4000:].decode()
    assert job.error is None, "\n".join(job.lines[-60:])
    return machines_seen(paths.staging / run_id, None)


@own_host_names
@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_on_two_hosts_are_listed_with_their_hosts_and_workers(env):
    paths, store = env
    nodes, rank_hosts, changes = _two_hosts(paths, store, "two-hosts", restarts=0)
    host = socket.gethostname()
    assert [(n.node_rank, n.host, n.workers) for n in nodes] == [(0, host, 1), (1, "node-b", 1)]
    assert [(r.hosts, r.node_ranks) for r in rank_hosts] == [([host, "node-b"], [0, 1])]
    assert changes == []


@own_host_names
@pytest.mark.slow
@pytest.mark.distributed
def test_a_restart_that_brings_a_rank_back_on_another_host_is_a_host_change(env):
    """Node 1's host is renamed node-c, then its worker is killed: torchrun restarts the
    workers of both nodes, and rank 1 comes back on node-c."""
    paths, store = env

    def move(node_1: subprocess.Popen) -> None:
        # Once rank 0 wrote the first round, rank 1 has said its host: now it moves.
        first = paths.staging / "moved"
        wait_for(lambda: recorded_rounds(first), timeout_s=300, what="the first round")
        rename = ["nsenter", f"--uts=/proc/{node_1.pid}/ns/uts", "hostname", "node-c"]
        subprocess.run(rename, check=True)
        kill_worker("moved", rank=1)

    nodes, rank_hosts, changes = _two_hosts(paths, store, "moved", restarts=1, during=move)
    host = socket.gethostname()
    assert [(n.node_rank, n.host) for n in nodes] == [(0, host), (1, "node-b"), (1, "node-c")]
    assert nodes[1].ended_at == nodes[2].started_at == rank_hosts[1].started_at
    assert [(r.launch, r.hosts) for r in rank_hosts] == [
        (0, [host, "node-b"]),
        (0, [host, "node-c"]),
    ]
    [change] = changes
    assert (change.round, change.rank, change.before, change.after) == (1, 1, "node-b", "node-c")
