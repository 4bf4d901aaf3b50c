"""Real torchrun training jobs for the resume and failure tests, without the Prefect flow.

A project is prepared once (split written by the engine), each job gets a run record in the
store and runs `trainyard.engine.worker train` under torchrun exactly as the flow's task does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainyard.checkpoint.layout import checkpoint_steps
from trainyard.checkpoint.reader import load_checkpoint
from trainyard.config import TrainyardConfig, config_from_dict
from trainyard.data.split import SplitSchema, prepare_cached_splits, prepare_splits
from trainyard.data.tables import write_digits
from trainyard.data.tensors import load_split
from trainyard.dist import DistContext
from trainyard.engine.jobs import training_key
from trainyard.engine.training import evaluate_split
from trainyard.objectives import target_kind
from trainyard.project import ProjectPaths
from trainyard.runs.record import DatasetInfo, RunRecord, now, save_record
from trainyard.runtime.forked import worker_rank
from trainyard.runtime.launch import run_worker
from trainyard.runtime.persistent import Inbox, JobRequest
from trainyard.storage import Store, StoreSettings
from trainyard.storage.versioning import content_md5

from conftest import make_project

# Small but long enough (8 epochs x 20 steps) to kill a worker in the middle of an epoch.
PARAMS: dict[str, dict[str, Any]] = {
    "train": {"workers": 2, "epochs": 8, "timeout_s": 300, "hang_timeout_s": 60},
    "checkpoint": {"every_n_epochs": 2, "every_n_steps": 7, "max_overhead": None},
    "tracking": {"backend": "none"},
}


def module_store(s3_server, prefix: str) -> Store:
    """A store on the session's S3 server under `prefix`, for one test module's runs."""
    server, state = s3_server
    creds = server.credentials()
    store = Store(
        StoreSettings("trainyard", prefix, state.endpoint, creds.access_key, creds.secret_key)
    )
    if not store.fs.exists("trainyard"):
        store.fs.mkdir("trainyard")
    return store


def prepare_project(root: Path, settings: StoreSettings) -> ProjectPaths:
    make_project(root, settings)
    paths = ProjectPaths(root)
    config = config_from_dict({})
    dataset = root / config.data.path
    write_digits(dataset)
    prepare_splits(config.data, config.split, dataset, paths.processed)
    return paths


def params(**sections: dict) -> dict:
    merged = {k: dict(v) for k, v in PARAMS.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return config_from_dict(merged).model_dump(mode="json")


def save_run(store: Store, run_id: str, run_params: dict, dataset_md5: str = "md5-a", **fields):
    record = RunRecord(
        run_id=run_id,
        created_at=now(),
        params=run_params,
        dataset=DatasetInfo(path="data/raw/digits.csv", dvc_md5=dataset_md5, rows=1797),
        **fields,
    )
    save_record(store, record)
    return record


@dataclass
class Job:
    lines: list[str] = field(default_factory=list)
    error: BaseException | None = None


def train(
    paths: ProjectPaths,
    store: Store,
    record: RunRecord,
    max_restarts: int = 0,
    node_rank: int = 0,
) -> tuple[Job, threading.Thread]:
    """Start a training job (this node's launcher) in a thread; join the thread to wait."""
    config: TrainyardConfig = config_from_dict(record.params)
    train_config = config.train.model_copy(update={"node_rank": node_rank})
    job = Job()

    def target() -> None:
        try:
            run_worker(
                paths.root,
                train_config,
                store.settings.worker_env(),
                ["train", "--run-id", record.run_id],
                job.lines.append,
                max_restarts=max_restarts,
                rdzv_id=record.run_id,
            )
        except BaseException as exc:  # reported to the test through job.error
            job.error = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return job, thread


def train_to_end(paths, store, record, max_restarts=0) -> dict:
    job, thread = train(paths, store, record, max_restarts)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    return store.read_json(training_key(record.run_id))


def wait_for(condition: Callable[[], object], timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def committed_mid_epoch(store: Store, run_id: str, min_step: int) -> bool:
    """True once a checkpoint at or after `min_step`, taken inside an epoch, is committed."""
    for step in checkpoint_steps(store, run_id):
        key = f"runs/{run_id}/checkpoints/step-{step:08d}/manifest.json"
        if step >= min_step and store.exists(key) and store.read_json(key)["step_in_epoch"] > 0:
            return True
    return False


def run_processes(run_id: str) -> dict[int, int | None]:
    """{pid: rank} of the live torchrun processes working on `run_id` (rank None for the
    torchrun agent): launched for it (the run id is on their command line, the agent's,
    which its forked workers share), or persistent workers (trainyard.runtime.persistent)
    whose inbox holds its unfinished job. A worker forked a moment ago, not yet named by
    its rank (trainyard.runtime.forked), is left out."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if b"trainyard.runtime.launch" not in cmdline or stat[0] == "Z":
            continue
        if run_id.encode() in cmdline or _persistent_job_of(cmdline, run_id):
            parents[int(entry.name)] = int(stat[1])
    ranks = {pid: worker_rank(pid) for pid in parents}
    # The agent is the one whose parent is not one of them: its workers are its children.
    return {
        pid: rank for pid, rank in ranks.items() if rank is not None or parents[pid] not in parents
    }


def _persistent_job_of(cmdline: list[bytes], run_id: str) -> bool:
    if b"--inbox" not in cmdline:
        return False
    inbox = Inbox(Path(cmdline[cmdline.index(b"--inbox") + 1].decode()))
    for request in inbox.folder.glob("request-*.json"):
        try:
            job = JobRequest.model_validate_json(request.read_text())
        except (OSError, ValueError):
            continue
        if run_id in job.args and not inbox.done_path(job.number).exists():
            return True
    return False


def worker_pids(run_id: str) -> dict[int, int]:
    """{rank: pid} of the live torchrun workers (not the torchrun agent) of a run."""
    return {rank: pid for pid, rank in run_processes(run_id).items() if rank is not None}


def kill_worker(run_id: str, rank: int) -> float:
    """SIGKILL one worker; returns the wall-clock time of the kill."""
    pids = worker_pids(run_id)
    assert rank in pids, f"no live worker of rank {rank}: {pids}"
    os.kill(pids[rank], signal.SIGKILL)
    return time.time()


def final_model_state(store: Store, training: dict) -> dict[str, torch.Tensor]:
    state, _ = load_checkpoint(store, training["final_checkpoint"])
    return state["model"]


def final_model(store: Store, training: dict, workdir: Path):
    """(bare model with the final weights, manifest); a sharded checkpoint is resharded."""
    from trainyard.checkpoint.loading import load_model

    loaded = load_model(store, training["final_checkpoint"], workdir)
    return loaded.model, loaded.manifest


def accuracy_on_test(paths: ProjectPaths, store: Store, training: dict) -> float:
    model, manifest = final_model(store, training, paths.staging / "final-model")
    split = load_split(paths.processed, "test", SplitSchema(**manifest.split_schema))
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "none")
    return evaluate_split(model, split, ctx)["accuracy"]


def learning(history: list[dict]) -> list[dict]:
    """The per-epoch rows without wall-clock timings, which no two runs share."""
    return [
        {k: v for k, v in row.items() if k not in {"train_s", "epoch_s", "data_wait_s"}}
        for row in history
    ]


def save_split_run(root: Path, store: Store, run_id: str, sections: dict[str, Any]) -> RunRecord:
    """A run record of the settings `sections`, whose split the engine prepared, as the flow
    does before training."""
    config = config_from_dict(sections)
    md5 = content_md5(root / config.data.path)  # the split reads the bytes of this md5
    split = prepare_cached_splits(
        ProjectPaths(root), config.data, config.split, md5, target_kind(config.task.name)
    )
    record = RunRecord(
        run_id=run_id,
        created_at=now(),
        params=config.model_dump(mode="json"),
        dataset=DatasetInfo(
            path=config.data.path,
            dvc_md5=md5,
            rows=sum(split.schema.rows.values()),
            split_key=split.key,
        ),
    )
    save_record(store, record)
    return record
