"""5. Recovery: time from `kill -9` of one worker to training moving again, and steps redone.

The real trainyard worker under torchrun with max_restarts; a worker is killed once a
mid-epoch checkpoint is committed; the run record's resume events give the rest.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

from benchmarks.common import BenchProject, _env, summary
from trainyard.config import load_config
from trainyard.engine.jobs import training_key
from trainyard.runs.record import RunRecord, now, save_record
from trainyard.runtime.forked import worker_rank
from trainyard.runtime.launch import run_worker
from trainyard.storage import Store, StoreSettings

OVERRIDES = [
    "train.epochs=6",
    "train.workers=2",
    "model.options.hidden_sizes=[512, 512]",  # steps slow enough to kill one mid-epoch
    "checkpoint.every_n_steps=7",
    "tracking.backend=none",
]


def run(project: BenchProject, quick: bool) -> dict:
    reps = 1 if quick else 3
    counter = itertools.count()
    to_resume, redone = [], []
    config = load_config(project.root / "params.yaml", OVERRIDES)
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
    for _ in range(reps):
        run_id = f"bench-recovery-{next(counter)}"
        save_record(
            store, RunRecord(run_id=run_id, created_at=now(), params=config.model_dump(mode="json"))
        )
        errors: list[BaseException] = []

        def launch(run_id: str = run_id, errors: list[BaseException] = errors) -> None:
            try:
                run_worker(
                    project.root, config.train, project.store_env, ["train", "--run-id", run_id],
                    lambda _: None, max_restarts=1, rdzv_id=run_id,
                )  # fmt: skip
            except BaseException as exc:  # reported below
                errors.append(exc)

        job = threading.Thread(target=launch)
        job.start()
        _wait(lambda run_id=run_id: _has_checkpoint(store, run_id), 300)
        pid = _worker_pid(run_id, rank=1)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        job.join(timeout=600)
        if errors:
            raise errors[0]
        training = store.read_json(training_key(run_id))
        event = training["resumes"][0]
        to_resume.append(event["resumed_at"] - killed_at)
        redone.append(float(event["steps_redone"]))
    return {
        "figures": {
            "kill -9 of one worker -> training moving again, s": summary(to_resume),
            # 0 is a real outcome: the kill came right after a commit.
            "steps redone (a checkpoint every 7 steps)": summary(redone),
        },
        "ratios": {},
    }


def _has_checkpoint(store: Store, run_id: str) -> bool:
    return bool(store.list_dirs(f"runs/{run_id}/checkpoints")) and any(
        store.exists(f"runs/{run_id}/checkpoints/{name}/manifest.json")
        for name in store.list_dirs(f"runs/{run_id}/checkpoints")
    )


def _wait(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("no checkpoint was committed in time")
        time.sleep(0.05)


def _worker_pid(run_id: str, rank: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # A worker has its torchrun agent's command line, and its rank for a name.
        if run_id.encode() in cmdline and worker_rank(int(entry.name)) == rank:
            return int(entry.name)
    raise RuntimeError(f"no live worker of rank {rank} for {run_id}")
