"""The run record, `runs/<run_id>/run.json` in the store: the spine that sweeps, the
registry, retraining and the comparison page read. Fields are only ever added."""

from __future__ import annotations

import datetime as dt
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from trainyard.errors import TrainyardError
from trainyard.lease import check_not_owned, check_owner, last_heartbeat
from trainyard.storage import Store

SCHEMA_VERSION = 1
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # always fullmatch: "$" allows a "\n"


class DatasetInfo(BaseModel):
    path: str
    dvc_md5: str  # DVC content hash of the raw dataset file
    rows: int
    split_rows: dict[str, int] = Field(default_factory=dict)
    classes: list[str] = Field(default_factory=list)
    # The run's split folder, ProjectPaths.split_cache(split_key); None in records made
    # when every run shared data/processed.
    split_key: str | None = None


class ExperimentInfo(BaseModel):
    rank: int
    mode: str
    key: str | None = None
    archive: str | None = None
    url: str | None = None


class Straggler(BaseModel):
    """A rank whose own part of each step (before gradients synchronize) stayed slower than
    the other ranks' for `stragglers.windows_in_a_row` windows or more (trainyard.stragglers)."""

    rank: int
    first_step: int  # the first step of its first slow window
    last_step: int  # the last step of its last slow window (so far, while training goes on)
    windows: int  # slow windows in a row
    median_step_ms: float  # its windows' median step part, averaged over those windows
    ranks_median_step_ms: float  # the same for the median of the other ranks
    slowdown: float  # median_step_ms / ranks_median_step_ms


class RankLanes(BaseModel):
    """Each rank over the run, for the page's per-rank lanes: per straggler window (its last
    global step), every rank's median own part of a step and its mean wait for a batch, in
    ms, indexed [window][rank]. A long run merges neighbouring windows (window_steps doubles),
    so a record keeps at most 2 x trainyard.stragglers.MAX_LANE_WINDOWS of them."""

    window_steps: int
    steps: list[int] = Field(default_factory=list)
    own_step_ms: list[list[float]] = Field(default_factory=list)
    data_wait_ms: list[list[float]] = Field(default_factory=list)

    def halved(self) -> RankLanes:
        """Neighbouring windows merged two by two (an odd last one stays as it is)."""

        def pairs(rows: list) -> list:
            merged = [
                [round((a + b) / 2, 3) for a, b in zip(first, second, strict=True)]
                for first, second in zip(rows[::2], rows[1::2], strict=False)  # odd: 1 left
            ]
            return merged + (rows[-1:] if len(rows) % 2 else [])

        return RankLanes(
            window_steps=2 * self.window_steps,
            steps=self.steps[1::2] + (self.steps[-1:] if len(self.steps) % 2 else []),
            own_step_ms=pairs(self.own_step_ms),
            data_wait_ms=pairs(self.data_wait_ms),
        )


class SweepTrial(BaseModel):
    """The sweep trial a run is: its rank 0 reports to this Optuna trial (see trainyard.sweeps)."""

    sweep_id: str
    study_name: str
    trial: int  # Optuna's trial number


class RunRecord(BaseModel):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    # "crashed" is never stored: `runs list/show` show a running record whose owner stopped
    # heartbeating that way (see `shown_status`).
    status: Literal["running", "completed", "pruned", "failed", "interrupted"] = "running"
    created_at: str
    finished_at: str | None = None
    params: dict[str, Any]
    dataset: DatasetInfo | None = None
    code: dict[str, Any] = Field(default_factory=dict)  # git commit and dirty flag
    versions: dict[str, str] = Field(default_factory=dict)
    world_size: int | None = None
    device: str | None = None
    backend: str | None = None
    timings_s: dict[str, float] = Field(default_factory=dict)
    first_step_at: float | None = None  # unix time the first training update finished
    metrics: dict[str, float] = Field(default_factory=dict)
    # The task's monitored metric on the test split: {name, mode ("max" | "min"), value}.
    monitor: dict[str, Any] | None = None
    history: list[dict[str, float]] = Field(default_factory=list)  # one row per epoch
    checkpoints: list[str] = Field(default_factory=list)
    final_checkpoint: str | None = None
    tracking: list[ExperimentInfo] = Field(default_factory=list)
    error: str | None = None
    # Resuming and surviving failures.
    resume_from: str | None = None  # the run `--resume-from` named
    resume_checkpoint: str | None = None  # the checkpoint training starts from, if any
    warm_start: bool = False  # weights only from resume_checkpoint
    # A checkpoint URI a new run was told to take its weights from, instead of a run to
    # resume from: `retrain` passes the champion registry version's (retrain.init: champion).
    warm_start_from: str | None = None
    restarts: int = 0  # torchrun restarts of the worker group in the last launch
    steps_redone: int = 0  # steps trained again because they were past the resumed checkpoint
    resumes: list[dict[str, Any]] = Field(default_factory=list)  # one per resume: step, when
    last_step: int | None = None  # the global step training reached (set when it stops early)
    # Resident-memory high-water marks (MB): "flow" (the process that ran the flow, split
    # included) and "workers" (one per rank, training only).
    peak_rss_mb: dict[str, Any] = Field(default_factory=dict)
    sweep: SweepTrial | None = None  # set when the run is a sweep's trial
    group: str | None = None  # its experiments' Comet group beside others' (retrain:<model>)
    pruned_at_epoch: int | None = None  # a pruned trial stopped after this epoch
    # Ranks found slow beside the others during training (the last launch's), in the order
    # they were found; a rank slow twice, with normal windows between, has two entries.
    stragglers: list[Straggler] = Field(default_factory=list)
    rank_lanes: RankLanes | None = None  # the last launch's, with two ranks or more


def new_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise TrainyardError(
            f"run id {run_id!r} is not valid: use letters, digits, '-' and '_' (at most 64, no '/' or '..')"
        )
    return run_id


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def record_key(run_id: str) -> str:
    return f"runs/{check_run_id(run_id)}/run.json"


def save_record(store: Store, record: RunRecord, lease_token: str | None = None) -> str:
    """With `lease_token`, only while that lease still owns the run: an owner whose run was
    taken over never overwrites the new owner's record."""
    check_owner(store, record.run_id, lease_token)
    return store.write_json(record_key(record.run_id), record.model_dump(mode="json"))


def load_record(store: Store, run_id: str) -> RunRecord:
    record = find_record(store, run_id)
    if record is None:
        raise TrainyardError(f"no run {run_id!r} in {store.uri('runs')}; see `trainyard runs list`")
    return record


def find_record(store: Store, run_id: str) -> RunRecord | None:
    try:
        return RunRecord.model_validate(store.read_json(record_key(run_id)))
    except FileNotFoundError:
        return None


def list_records(store: Store) -> list[RunRecord]:
    records = []
    for run_id in store.list_dirs("runs"):
        if RUN_ID.fullmatch(run_id) and store.exists(record_key(run_id)):
            records.append(load_record(store, run_id))
    return sorted(records, key=lambda r: r.created_at, reverse=True)


def git_state(root: Path) -> dict[str, Any]:
    """The commit the code came from, and whether the working tree had changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def shown_status(store: Store, record: RunRecord) -> tuple[str, str | None]:
    """(status to show, last heartbeat): a running record whose owner stopped heartbeating
    (killed with its guardian, a lost machine) is shown as crashed."""
    if record.status != "running":
        return record.status, None
    live, beat = last_heartbeat(store, record.run_id)
    if live:
        return "running", None
    when = dt.datetime.fromtimestamp(beat, dt.UTC).isoformat(timespec="seconds") if beat else None
    return "crashed", when


@dataclass(frozen=True)
class Freed:
    objects: int
    store_bytes: int
    local_bytes: int


def delete_run(store: Store, local_folders: list[Path], run_id: str) -> Freed:
    """Everything a run left: its keys in the store (checkpoint manifests first, so nothing
    half-deleted still looks committed; the record last) and its local folders."""
    check_not_owned(store, run_id)
    prefix = f"runs/{check_run_id(run_id)}"
    sizes = store.list_files(prefix)
    present = [p for p in local_folders if p.exists()]
    if not sizes and not present:
        raise TrainyardError(f"no run {run_id!r} in {store.uri('runs')}; see `trainyard runs list`")
    record = record_key(run_id)
    manifests = [k for k in sizes if k.endswith("/manifest.json")]
    rest = [k for k in sizes if k not in manifests and k != record]
    store.delete_files(manifests)
    store.delete_files(rest)
    store.delete_files([record] if record in sizes else [])
    local = 0
    for folder in present:
        local += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder)
    return Freed(len(sizes), sum(sizes.values()), local)
