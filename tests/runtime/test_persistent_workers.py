"""Persistent workers (trainyard.runtime.persistent): training jobs one after another in the same torchrun
workers, with real torchrun, gloo and the real S3 store.

A job on persistent workers must be the job a cold launch runs: the same loss curve and the very
same weights as a cold run of the same settings, a killed worker restarted and resumed
from the latest committed checkpoint, a failure reported with the failing rank's traceback,
and no process left once the block that started them ends.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from trainyard.config import config_from_dict
from trainyard.errors import WorkerFailed
from trainyard.runs.record import save_record
from trainyard.runtime.forked import worker_rank
from trainyard.runtime.persistent import persistent_workers

from training_jobs import (
    committed_mid_epoch,
    final_model_state,
    learning,
    module_store,
    params,
    prepare_project,
    save_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "persistent-workers")
    paths = prepare_project(tmp_path_factory.mktemp("persistent") / "project", store.settings)
    return paths, store


@pytest.fixture(scope="module")
def reference(env):
    """A cold run: its own torchrun, as outside any persistent_workers block."""
    paths, store = env
    return train_to_end(paths, store, save_run(store, "cold", params(train={"epochs": 4})))


def persistent_processes(paths) -> dict[int, int]:
    """{pid: rank} of the live persistent workers (`trainyard.engine.worker serve`, forked by
    their torchrun agent, which shares their command line) of this project; rank -1 for a
    torchrun agent."""
    found = {}
    inboxes = str(paths.staging / "workers").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if inboxes in cmdline and state != "Z":
            rank = worker_rank(int(entry.name))
            found[int(entry.name)] = -1 if rank is None else rank
    return found


def same_weights(store, ours: dict, theirs: dict) -> bool:
    a, b = final_model_state(store, ours), final_model_state(store, theirs)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_jobs_on_persistent_workers_train_exactly_as_cold_ones_in_the_same_processes(
    env, reference
):
    paths, store = env
    with persistent_workers():
        first = train_to_end(paths, store, save_run(store, "kept-1", params(train={"epochs": 4})))
        idle = persistent_processes(paths)  # waiting for the next job
        second = train_to_end(paths, store, save_run(store, "kept-2", params(train={"epochs": 4})))
        assert persistent_processes(paths) == idle
    assert sorted(idle.values()) == [-1, 0, 1]  # one torchrun agent and its two workers
    assert first["worker_pids"] == second["worker_pids"] != reference["worker_pids"]
    assert set(first["worker_pids"]) == {pid for pid, rank in idle.items() if rank >= 0}
    for training in (first, second):
        assert learning(training["history"]) == learning(reference["history"])
        assert same_weights(store, training, reference)
        assert training["restarts"] == 0 and training["resumed_from"] is None
    # The block's end stops them: no process, no inbox left behind.
    assert persistent_processes(paths) == {}
    assert list((paths.staging / "workers").iterdir()) == []


def test_a_killed_persistent_worker_restarts_resumes_and_retires_its_group(env, monkeypatch):
    """torchrun restarts the group, the new workers take the unfinished job again and resume
    it from its latest committed checkpoint; the next job gets workers of its own."""
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    paths, store = env
    # Steps of at least 50 ms: after the step-20 checkpoint 60 steps (3 s) are left on any
    # machine, so the kill always lands inside the job, not on workers already idle.
    slow = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.05}}
    run_params = params(train={"epochs": 4}, model=slow)
    with persistent_workers():
        record = save_run(store, "kept-killed", run_params)
        job, thread = train(paths, store, record, max_restarts=2)
        wait_for(lambda: committed_mid_epoch(store, "kept-killed", 20), what="a checkpoint")
        [victim] = [pid for pid, rank in persistent_processes(paths).items() if rank == 1]
        os.kill(victim, signal.SIGKILL)
        thread.join(timeout=600)
        assert job.error is None, "\n".join(job.lines[-80:])
        killed = store.read_json("runs/kept-killed/training.json")
        after = train_to_end(paths, store, save_run(store, "kept-after", run_params), 2)
    assert killed["restarts"] == 1 and killed["resumes"][0]["from_step"] >= 20
    # A group that restarted is retired: the next job started on fresh workers, and counts
    # no restart of its own; the killed and resumed job ends on its uninterrupted weights.
    assert after["restarts"] == 0 and not set(after["worker_pids"]) & set(killed["worker_pids"])
    assert same_weights(store, killed, after)
    assert persistent_processes(paths) == {}


def test_a_failing_job_reports_its_rank_and_the_next_job_starts_fresh_workers(env, reference):
    paths, store = env
    broken = params(train={"epochs": 4})
    with persistent_workers():
        # A run record naming a split that is not there: every rank fails to read it.
        record = save_run(store, "kept-broken", broken)
        record.dataset.split_key = "no-such-split"
        save_record(store, record)
        job, thread = train(paths, store, record, max_restarts=0)
        thread.join(timeout=300)
        assert isinstance(job.error, WorkerFailed), job.error
        failed_pids = set(persistent_processes(paths))
        after = train_to_end(paths, store, save_run(store, "kept-next", broken))
    message = str(job.error)
    assert "Root Cause" in message and "rank      :" in message and "no-such-split" in message
    assert failed_pids == set()  # the failed job's workers did not stay
    assert same_weights(store, after, reference)


def test_a_persistent_job_over_its_timeout_is_killed_with_its_workers(env, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    paths, store = env
    slow = params(
        model={"name": "tests_support:slow_mlp", "options": {"seconds": 0.05}},
        train={"epochs": 50, "timeout_s": 8},
    )
    with persistent_workers():
        record = save_run(store, "kept-slow", slow)
        config = config_from_dict(record.params)
        job, thread = train(paths, store, record)
        thread.join(timeout=120)
        assert isinstance(job.error, WorkerFailed)
        assert f"exceeded train.timeout_s={config.train.timeout_s:g}s" in str(job.error)
        assert persistent_processes(paths) == {}
