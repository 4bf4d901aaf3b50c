"""A lost host costs at most one checkpoint interval: a `train.nnodes=1:2` run on two nodes
(real torchrun agents at a c10d rendezvous on loopback, 1 worker each) loses node 1 (its
agent and worker SIGKILLed) after a commit; node 0 goes on alone from the last commit at
world size 1 with the same global batch, and when node 1 is started again the run scales
back to 2 at the next restart. Nothing is skipped or read twice, and the model ends as good
as an undisturbed run's.

Alone, the model's steps are slow (tests_support:alone_slow_mlp), so node 0 is still
training whenever node 1 comes back, however long its start takes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainyard.checkpoint.layout import checkpoint_steps
from trainyard.config import TrainConfig
from trainyard.engine.jobs import training_key
from trainyard.runs.machines import machines_seen
from trainyard.runtime.hosts import recorded_rounds
from trainyard.runtime.progress import recorded_resumes
from trainyard.runtime.torchrun import ELASTIC_RENDEZVOUS, torchrun_command

from tests_support import loopback_endpoint
from training_jobs import (
    accuracy_on_test,
    module_store,
    params,
    prepare_project,
    run_processes,
    save_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = Path(__file__).parents[1]
MODEL = {"name": "tests_support:alone_slow_mlp", "options": {"seconds": 0.05}}
# digits: 1257 training rows, a global batch of 64 (32 x 2 workers): 20 steps an epoch.
TRAIN = {"batch_size": 32, "epochs": 4, "max_restarts": 3}
CHECKPOINTS = {"every_n_epochs": 1, "every_n_steps": 5}
DEADLINE_S = 300  # for each thing awaited: minutes on a slow machine, seconds here


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "elastic-tests")
    paths = prepare_project(tmp_path_factory.mktemp("elastic") / "project", store.settings)
    return paths, store


def test_an_elastic_range_is_torchruns_and_meets_again_in_seconds():
    node = TrainConfig(workers=2, nnodes="1:2", node_rank=0, rdzv_endpoint="127.0.0.1:29400")
    cmd = torchrun_command(node, ["train"], max_restarts=3, rdzv_id="run-7")
    assert "--nnodes=1:2" in cmd and node.world_size == 4
    [conf] = [arg for arg in cmd if arg.startswith("--rdzv-conf=")]
    # node 0 serves the store even on loopback: the nodes that come and go find it there
    assert ",is_host=true," in conf
    for key, value in ELASTIC_RENDEZVOUS.items():
        assert f"{key}={value}" in conf
    timeouts = ELASTIC_RENDEZVOUS
    assert timeouts["keep_alive_interval"] * timeouts["keep_alive_max_attempt"] <= 10
    assert timeouts["last_call_timeout"] <= 5


def test_an_elastic_range_without_restarts_is_refused_in_one_line():
    with pytest.raises(ValidationError, match="set train.max_restarts to 1 or more"):
        TrainConfig(nnodes="1:2", max_restarts=0)


def _node_processes(run_id: str, node_rank: int) -> list[int]:
    """The live torchrun agent of node `node_rank` and its workers."""
    found = run_processes(run_id)
    agents = [
        pid
        for pid, rank in found.items()
        if rank is None and f"node_rank={node_rank},".encode() in _cmdline(pid)
    ]
    workers = [pid for pid, rank in found.items() if rank is not None and _parent(pid) in agents]
    return agents + workers


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _training_at_two(paths, store, run_id: str) -> bool:
    """Both nodes train (the last round of workers has 2 ranks) and have committed a
    checkpoint inside an epoch at world size 2."""
    rounds = recorded_rounds(paths.staging / run_id)
    if not rounds or len(rounds[-1]["hosts"]) != 2:
        return False
    for step in checkpoint_steps(store, run_id):
        key = f"runs/{run_id}/checkpoints/step-{step:08d}/manifest.json"
        manifest = store.read_json(key) if store.exists(key) else {}
        if manifest.get("world_size") == 2 and manifest.get("step_in_epoch", 0) > 0:
            return True
    return False


def _resumed(paths, run_id: str, before: int, after: int) -> dict | None:
    """The latest resume from world size `before` to `after` once its first step is done."""
    for entry in reversed(recorded_resumes(paths.staging / run_id)):
        if (entry["world_size_before"], entry["world_size_after"]) == (before, after):
            return entry if entry["resumed_at"] is not None else None
    return None


def _kill_node(run_id: str, node_rank: int) -> float:
    """SIGKILL the process group of node `node_rank`'s agent and of each of its workers
    (each has a session of its own) at once, as a host that dies; the time of the kill."""
    pids = _node_processes(run_id, node_rank)
    # An agent and its worker; a worker of the round before may still be on its way out
    # (the agent restarted them when both nodes met): the host takes every one down with it.
    assert len(pids) >= 2, f"node {node_rank}: agent and worker expected, found {pids}"
    killed_at = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    return killed_at


def test_a_lost_node_costs_one_checkpoint_and_its_return_scales_back(env, monkeypatch):
    paths, store = env
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the workers import tests_support
    started = time.monotonic()
    reference = train_to_end(
        paths, store, save_run(store, "undisturbed", _settings(workers=2)), max_restarts=3
    )

    nodes = {"workers": 1, "nnodes": "1:2", "rdzv_endpoint": loopback_endpoint()}
    record = save_run(store, "elastic", _settings(**nodes))
    node_0, thread_0 = train(paths, store, record, max_restarts=3, node_rank=0)
    # Node 1 as a host: a launcher that does not launch its agent again once it is lost.
    first_1, thread_1 = train(paths, store, record, max_restarts=0, node_rank=1)
    wait_for(lambda: _training_at_two(paths, store, "elastic"), DEADLINE_S, "2 nodes training")
    killed_at = _kill_node("elastic", node_rank=1)
    thread_1.join(timeout=DEADLINE_S)
    assert first_1.error is not None, "node 1's launcher must see its agent lost"

    wait_for(lambda: _resumed(paths, "elastic", 2, 1), DEADLINE_S, "node 0 alone")
    alone = _resumed(paths, "elastic", 2, 1)
    assert alone is not None  # awaited just above
    back_job, back_thread = train(paths, store, record, max_restarts=3, node_rank=1)
    thread_0.join(timeout=DEADLINE_S)
    back_thread.join(timeout=DEADLINE_S)
    assert node_0.error is None, "\n".join(node_0.lines[-60:])
    assert back_job.error is None, "\n".join(back_job.lines[-60:])

    ended = store.read_json(training_key("elastic"))
    assert ended["world_size"] == 2 and ended["steps"] == reference["steps"]
    changes = [
        (r["world_size_before"], r["world_size_after"])
        for r in ended["resumes"]
        if r["world_size_before"] != r["world_size_after"]
    ]
    lost = changes.index((2, 1))
    assert (1, 2) in changes[lost + 1 :], changes  # scaled back up after the loss
    after = {(r["world_size_before"], r["world_size_after"]): r["after"] for r in ended["resumes"]}
    assert after[(2, 1)] == "node left" and after[(1, 2)] == "node joined", after
    # Each names its cause, a join torchrun counts as no restart too (node 0 alone at first).
    assert all(r["after"] for r in ended["resumes"]), ended["resumes"]
    for entry in ended["resumes"]:  # exact every time: the same global batch, cut anew
        assert entry["samples_skipped"] == 0 and entry["samples_repeated"] == 0, entry
        if entry["world_size_after"] == 1:
            assert (entry["rows_per_worker"], entry["grad_accum_steps"]) == (64, 2), entry
    # At most one checkpoint interval redone.
    assert alone["steps_redone"] <= CHECKPOINTS["every_n_steps"], alone
    accuracy = accuracy_on_test(paths, store, ended)
    expected = accuracy_on_test(paths, store, reference)
    assert abs(accuracy - expected) <= 0.01, (accuracy, expected)

    spans, _, _ = machines_seen(paths.staging / "elastic", None)
    node_1 = [span for span in spans if span.node_rank == 1]
    assert [span.node_rank for span in spans].count(0) == 1, spans  # node 0 throughout
    assert len(node_1) == 2, spans  # the lost node's stay ended; its return is a new one
    assert node_1[0].ended_at is not None and node_1[0].ended_at <= node_1[1].started_at
    print(
        f"kill -> node 0 training alone {alone['resumed_at'] - killed_at:.1f}s "
        f"(steps redone {alone['steps_redone']}); test {time.monotonic() - started:.0f}s"
    )


def _settings(**train: object) -> dict:
    return params(model=MODEL, train={**TRAIN, **train}, checkpoint=CHECKPOINTS)
