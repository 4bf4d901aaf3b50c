"""An exact resume at another world size, with real torchrun workers and the real S3 store:
2 workers, interrupted mid-epoch, go on with 1, interrupted again, and end with 2; every
epoch reads each training row exactly once, as an undisturbed 2-worker run does.

The dataset counts its reads (counted_reads); the interrupts are SIGTERMs to torchrun's
agent, after which the workers stop at one step and commit there (checkpoint.on_interrupt),
so a process reads exactly the steps its successor does not read again.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from counted_reads import READS_DIR, reads_per_epoch, write_points

from trainyard.checkpoint.reader import latest_committed
from trainyard.config import config_from_dict
from trainyard.data.split import prepare_splits
from trainyard.project import ProjectPaths
from trainyard.runtime.progress import recorded_resumes

from conftest import make_project
from training_jobs import (
    committed_mid_epoch,
    module_store,
    params,
    run_processes,
    save_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = Path(__file__).parents[1]
DATA = {"dataset": "counted_reads:counted_points", "path": "data/points.jsonl"}
# 280 training rows, a global batch of 16: 18 steps an epoch (the last one reads 8 rows).
# Steps of at least 20 ms (tests_support:slow_mlp) leave seconds of training after each
# interrupt on any machine; prefetching is off, so a process reads no step it did not train.
EPOCHS = 4


def settings(workers: int) -> dict:
    return params(
        data=DATA,
        model={"name": "tests_support:slow_mlp", "options": {"seconds": 0.02}},
        train={"workers": workers, "batch_size": 8, "epochs": EPOCHS, "prefetch": False},
        checkpoint={"every_n_epochs": 1, "every_n_steps": 7},
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "world-size-tests")
    root = tmp_path_factory.mktemp("world-size") / "project"
    make_project(root, store.settings)
    paths = ProjectPaths(root)
    write_points(root / DATA["path"], 400)
    config = config_from_dict({"data": DATA})
    prepare_splits(config.data, config.split, root / DATA["path"], paths.processed)
    return paths, store


def latest(store, run_id: str):
    """The run's latest committed checkpoint: (uri, state, manifest)."""
    found = latest_committed(store, run_id)
    assert found is not None, f"run {run_id} committed no checkpoint"
    return found


def launch(env, monkeypatch, run_id: str, workers: int, resume_from: str | None = None):
    """A training job of `run_id` reading into its own reads folder, continuing the latest
    committed checkpoint of `resume_from` (as `--resume-from` does)."""
    paths, store = env
    reads = paths.root / "reads" / run_id
    reads.mkdir(parents=True)
    monkeypatch.setenv(READS_DIR, str(reads))
    uri = latest(store, resume_from)[0] if resume_from else None
    record = save_run(store, run_id, settings(workers), resume_checkpoint=uri)
    return record, reads


def interrupted(env, monkeypatch, run_id, workers, resume_from, min_step) -> Path:
    """A job stopped by SIGTERM to its torchrun agent once it committed a checkpoint at or
    after `min_step` inside an epoch; it commits where it stops."""
    paths, store = env
    record, reads = launch(env, monkeypatch, run_id, workers, resume_from)
    job, thread = train(paths, store, record)
    wait_for(lambda: committed_mid_epoch(store, run_id, min_step), what=f"{run_id}'s commit")
    agent = [pid for pid, rank in run_processes(run_id).items() if rank is None]
    assert len(agent) == 1, run_processes(run_id)
    os.kill(agent[0], signal.SIGTERM)
    thread.join(timeout=300)
    assert not thread.is_alive(), "\n".join(job.lines[-40:])
    stopped = latest(store, run_id)[2]
    assert stopped.step < EPOCHS * 18, "the job ended before its interrupt"
    return reads


def test_two_one_two_workers_read_every_row_once_per_epoch(env, monkeypatch):
    paths, store = env
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}{os.pathsep}{TESTS}")
    train_rows = set(np.load(paths.processed / "train_rows.npy").tolist())
    assert len(train_rows) == 280

    record, reads = launch(env, monkeypatch, "undisturbed", 2)
    train_to_end(paths, store, record)
    undisturbed = reads_per_epoch(reads, train_rows, 0)
    assert sorted(undisturbed) == list(range(EPOCHS))
    assert all(seen == Counter(train_rows) for seen in undisturbed.values())

    first = interrupted(env, monkeypatch, "two", 2, None, min_step=7)
    two_stop = latest(store, "two")[2]
    second = interrupted(env, monkeypatch, "one", 1, "two", min_step=two_stop.step + 14)
    one_stop = latest(store, "one")[2]
    record, third = launch(env, monkeypatch, "two-again", 2, "one")
    ended = train_to_end(paths, store, record)
    assert ended["steps"] == EPOCHS * 18  # the same global steps as undisturbed

    together: dict[int, Counter] = {}
    for folder, first_epoch in ((first, 0), (second, two_stop.epoch), (third, one_stop.epoch)):
        for epoch, seen in reads_per_epoch(folder, train_rows, first_epoch).items():
            together.setdefault(epoch, Counter()).update(seen)
    assert together == undisturbed  # every row exactly once per epoch: none skipped or repeated

    one_resume = recorded_resumes(paths.staging / "one")[-1]
    two_resume = ended["resumes"][-1]
    for entry, before, after in ((one_resume, 2, 1), (two_resume, 1, 2)):
        assert entry["world_size_before"] == before and entry["world_size_after"] == after
        assert entry["samples_skipped"] == 0 and entry["samples_repeated"] == 0
        assert entry["global_batch_before"] == entry["global_batch_after"] == 16
    # One worker reads its 16 rows an update in two micro-batches of train.batch_size 8.
    assert (one_resume["rows_per_worker"], one_resume["grad_accum_steps"]) == (16, 2)
