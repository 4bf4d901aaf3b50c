"""Every machine's part in a run: each round's hosts, gathered by real torchrun workers, and
the record's nodes and host changes built from them."""

from __future__ import annotations

import datetime as dt
import json
import re
import socket

import pytest

from trainyard.runs.machines import HostChange, machines_seen
from trainyard.runs.record import RunRecord
from trainyard.runtime.hosts import HOSTS_FILE

from training_jobs import module_store, params, prepare_project, save_run, train

GATHERED = re.compile(r"hosts of the (\d+) ranks gathered in ([\d.]+) ms")


def _rounds(folder, *rounds: tuple[int, float, list[str], list[int]]) -> None:
    """hosts.json as rank 0 writes it: (attempt, started_at, hosts, node_ranks) per round."""
    rows = [{"attempt": a, "started_at": t, "hosts": h, "node_ranks": n} for a, t, h, n in rounds]
    (folder / HOSTS_FILE).write_text(json.dumps(rows))


def _when(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


def test_a_restart_on_another_host_is_a_host_change_and_a_new_node_stay(tmp_path):
    """Node 1 (ranks 2, 3) fails on host-b; the restart brings it back on host-c, then a
    later round runs without it (scaled down to node 0)."""
    _rounds(
        tmp_path,
        (0, 1000.0, ["host-a", "host-a", "host-b", "host-b"], [0, 0, 1, 1]),
        (1, 1060.0, ["host-a", "host-a", "host-c", "host-c"], [0, 0, 1, 1]),
        (2, 1120.0, ["host-a", "host-a"], [0, 0]),
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
    assert [(r.attempt, r.started_at, r.node_ranks) for r in rank_hosts][2] == (
        2,
        at[1120.0],
        [0, 0],
    )
    assert changes == [
        HostChange(attempt=1, at=at[1060.0], rank=2, before="host-b", after="host-c"),
        HostChange(attempt=1, at=at[1060.0], rank=3, before="host-b", after="host-c"),
        HostChange(attempt=2, at=at[1120.0], rank=2, before="host-c", after=None),
        HostChange(attempt=2, at=at[1120.0], rank=3, before="host-c", after=None),
    ]


def test_a_new_launch_starts_new_stays_and_unknown_rounds_are_skipped(tmp_path):
    _rounds(
        tmp_path,
        (0, 1000.0, ["host-a"], [0]),
        (0, 2000.0, ["host-a"], [0]),  # the run continued by a later launch
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
    assert [(r.attempt, r.hosts, r.node_ranks) for r in rank_hosts] == [(0, [host, host], [0, 0])]
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
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
