"""The run record, `runs/<run_id>/run.json` in the store: the spine that sweeps, the
registry, retraining and the comparison page read. Fields are only ever added."""

from __future__ import annotations

import datetime as dt
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from trainyard.config import TrainyardConfig, config_from_dict
from trainyard.errors import TrainyardError
from trainyard.runs.lease import check_not_owned, check_owner, last_heartbeat
from trainyard.runs.machines import HostChange, HostRound, NodeSpan
from trainyard.storage import Store
from trainyard.util.documents import Skipped, UnreadableDocument, read_model
from trainyard.util.files import write_text_atomic

SCHEMA_VERSION = 1
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # always fullmatch: "$" allows a "\n"
# Records read at once: one after another, 516 records took 8 s on the embedded store.
READERS = 16
ERROR_SUMMARY_MAX = 200  # characters of a run's error kept in its summary
T = TypeVar("T")


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


class CommunicationRecord(BaseModel):
    """How the replicas' syncs went, per rank, over the last launch's updates
    (trainyard.sync): the bytes each rank handed to those collectives (a ring all-reduce
    puts about twice that on the wire), the seconds it waited in them, and how many there
    were (train.sync allreduce: one per update; local_sgd, diloco: one per interval;
    parameter_server: one per push, with how many pushes came at each staleness, all ranks'
    together: the updates other workers' pushes applied between a worker's last reply and
    its push)."""

    bytes_sent_per_rank: list[int]
    wait_s_per_rank: list[float]
    syncs: int
    staleness: dict[int, int] | None = None  # parameter_server only
    # The checkpoints' gathers, apart from the syncs (trainyard.sync.communication): what
    # each rank handed to them, and its seconds in them (None: a record from before).
    checkpoint_bytes_per_rank: list[int] | None = None
    checkpoint_wait_s_per_rank: list[float] | None = None


class Straggler(BaseModel):
    """A rank whose own part of each step (before gradients synchronize) stayed slower than
    the other ranks' for `stragglers.windows_in_a_row` windows or more (trainyard.engine.stragglers)."""

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
    so a record keeps at most 2 x trainyard.engine.stragglers.MAX_LANE_WINDOWS of them."""

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
    # {data, pipeline, tensor}: how the world was cut (train.parallel); empty before it trained
    layout: dict[str, int] = Field(default_factory=dict)
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
    error: str | None = None  # one line: `rank 1: RuntimeError: ...` for a worker's failure
    error_file: str | None = None  # its full traceback, relative to the project folder
    # Resuming and surviving failures.
    resume_from: str | None = None  # the run `--resume-from` named
    resume_checkpoint: str | None = None  # the checkpoint training starts from, if any
    warm_start: bool = False  # weights only from resume_checkpoint
    # A checkpoint URI a new run was told to take its weights from, instead of a run to
    # resume from: `retrain` passes the champion registry version's (retrain.init: champion).
    warm_start_from: str | None = None
    restarts: int = 0  # restarts of the worker group in the last launch (take_launch_resumes)
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
    communication: CommunicationRecord | None = None  # None: a layout whose syncs are not counted
    # Every machine's part (trainyard.runs.machines): each node's stay on a host, each
    # round's host per rank, and each rank's change of host between rounds.
    nodes: list[NodeSpan] = Field(default_factory=list)
    rank_hosts: list[HostRound] = Field(default_factory=list)
    host_changes: list[HostChange] = Field(default_factory=list)

    def take_launch_resumes(self, resumes: list[dict[str, Any]]) -> None:
        """The last launch's resumes (rank 0's AttemptLog) after the continuations the record
        lists already; `steps_redone`, the steps they redid."""
        continued = [e for e in self.resumes if e.get("kind") == "continue"]
        self.resumes = continued + resumes
        self.steps_redone = sum(e.get("steps_redone", 0) for e in resumes)
        # torchrun counts no restart for a node that joined or left an elastic run: its
        # resume does (`after`), as `runs show` says.
        self.restarts = max(self.restarts, sum(1 for e in resumes if e.get("after")))

    @cached_property
    def config(self) -> TrainyardConfig:
        """`params` as typed settings, parsed on first use and kept: a worker reads them
        in several places and parses them once. Not a field, so run.json is unchanged; a
        listing that never asks parses nothing (an old record's params may no longer be
        valid settings)."""
        return config_from_dict(self.params)


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
    try:
        record = find_record(store, run_id)
    except UnreadableDocument as exc:
        raise UnreadableDocument(
            exc.uri, f"{exc.reason}; `trainyard runs delete {run_id}` removes the run"
        ) from None
    if record is None:
        raise TrainyardError(f"no run {run_id!r} in {store.uri('runs')}; see `trainyard runs list`")
    return record


def find_record(store: Store, run_id: str) -> RunRecord | None:
    """None if the run has no record; a damaged one raises `UnreadableDocument` naming it.
    Unknown fields (a record from a newer trainyard) are ignored, not refused."""
    try:
        return read_model(store, record_key(run_id), RunRecord)
    except FileNotFoundError:
        return None


def record_names(store: Store) -> list[str]:
    """The run ids that have a folder under runs/ (a record may still be missing)."""
    return [name for name in store.list_dirs("runs") if RUN_ID.fullmatch(name)]


def map_records(
    store: Store, run_ids: list[str], apply: Callable[[RunRecord], T], skipped: Skipped
) -> list[T | None]:
    """`apply(record)` for each run, in order, READERS records at a time; None where the
    record is absent or damaged (that one goes to `skipped`). Each record is dropped once
    applied, so a listing holds at most READERS of them, however large they are."""
    for run_id in run_ids:
        check_run_id(run_id)  # a bad name is one clear line, before any read

    def one(run_id: str) -> T | None:
        try:
            record = find_record(store, run_id)
        except UnreadableDocument as exc:
            skipped.add(exc)
            return None
        return None if record is None else apply(record)

    with ThreadPoolExecutor(READERS) as pool:
        return list(pool.map(one, run_ids))


def newest_first(items: list[T | None], key: Callable[[T], tuple]) -> list[T]:
    return sorted((item for item in items if item is not None), key=key, reverse=True)


def list_records(store: Store, skipped: Skipped) -> list[RunRecord]:
    """Every readable record, newest first; damaged ones go to `skipped`."""
    found = map_records(store, record_names(store), lambda record: record, skipped)
    return newest_first(found, key=lambda r: (r.created_at, r.run_id))


class RunSummary(BaseModel):
    """One line of `runs list --json`: what tells runs apart, without the record's history,
    params and lanes (`runs show RUN_ID` has those)."""

    run_id: str
    status: str  # shown status: "crashed" for a running record whose owner stopped
    last_heartbeat: str | None = None  # when crashed
    created_at: str
    finished_at: str | None = None
    duration_s: float | None = None
    task: str | None = None
    model: str | None = None
    world_size: int | None = None
    monitor: dict[str, Any] | None = None  # {name, mode, value} on the test split
    dataset_md5: str | None = None
    sweep_id: str | None = None
    trial: int | None = None
    final_checkpoint: str | None = None
    error: str | None = None  # its first line


def summarize(store: Store, record: RunRecord) -> RunSummary:
    status, heartbeat = shown_status(store, record)
    return RunSummary(
        run_id=record.run_id,
        status=status,
        last_heartbeat=heartbeat,
        created_at=record.created_at,
        finished_at=record.finished_at,
        duration_s=record.timings_s.get("total"),
        task=_setting(record.params, "task"),
        model=_setting(record.params, "model"),
        world_size=record.world_size,
        monitor=_monitor(record.monitor),
        dataset_md5=record.dataset.dvc_md5 if record.dataset else None,
        sweep_id=record.sweep.sweep_id if record.sweep else None,
        trial=record.sweep.trial if record.sweep else None,
        final_checkpoint=record.final_checkpoint,
        error=(record.error.strip().splitlines() or [""])[0][:ERROR_SUMMARY_MAX]
        if record.error
        else None,
    )


def list_summaries(store: Store, skipped: Skipped, cache: Path | None = None) -> list[RunSummary]:
    """Every readable run's summary, newest first; damaged records go to `skipped`.

    With `cache` (a file in the project's private state), a finished run's summary is kept
    beside its record's ETag, and the record is read again only once it changes: reading
    500 records took 2.4 s of the 3.8 s `runs list` spent, on every call. One listing of
    the store says which records changed; a running record is always read (its status
    depends on its heartbeat)."""
    if cache is None:
        found = map_records(store, record_names(store), lambda r: summarize(store, r), skipped)
        return newest_first(found, key=lambda s: (s.created_at, s.run_id))
    tags = record_etags(store)
    kept = {
        run_id: summary
        for run_id, (tag, summary) in _read_summaries(cache, store).items()
        if tags.get(run_id) == tag
    }
    stale = [run_id for run_id in tags if run_id not in kept]
    found = map_records(store, stale, lambda r: summarize(store, r), skipped)
    read = {run_id: s for run_id, s in zip(stale, found, strict=True) if s is not None}
    summaries = kept | read
    # A record rewritten between the listing and its read is kept under the older tag, so
    # the next call reads it again.
    finished = {rid: (tags[rid], s) for rid, s in summaries.items() if s.status in FINISHED}
    _write_summaries(cache, store, finished)
    return newest_first(list(summaries.values()), key=lambda s: (s.created_at, s.run_id))


FINISHED = ("completed", "failed", "interrupted", "pruned")


def record_etags(store: Store) -> dict[str, str]:
    """run id -> its record's ETag, from one listing of the store's runs."""
    return {
        key.split("/")[1]: tag
        for key, tag in store.list_etags("runs").items()
        if key.count("/") == 2 and key.endswith("/run.json") and RUN_ID.fullmatch(key.split("/")[1])
    }


class _SummaryCache(BaseModel):
    where: str  # the store's runs folder: another store's summaries are never shown
    runs: dict[str, tuple[str, RunSummary]]


def _read_summaries(cache: Path, store: Store) -> dict[str, tuple[str, RunSummary]]:
    """The cached summaries of this store; none if the file is missing or damaged."""
    try:
        kept = _SummaryCache.model_validate_json(cache.read_bytes())
    except (OSError, ValueError):
        return {}
    return kept.runs if kept.where == store.uri("runs") else {}


def _write_summaries(cache: Path, store: Store, runs: dict[str, tuple[str, RunSummary]]) -> None:
    cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = _SummaryCache(where=store.uri("runs"), runs=runs).model_dump_json()
    write_text_atomic(cache, text, private=True)


def _setting(params: dict[str, Any], section: str) -> str | None:
    name = params.get(section, {}).get("name") if isinstance(params.get(section), dict) else None
    return name if isinstance(name, str) else None


def _monitor(monitor: dict[str, Any] | None) -> dict[str, Any] | None:
    """The monitored metric, if it has a name and a number: a listing formats its value."""
    if not monitor or not isinstance(monitor.get("name"), str):
        return None
    value = monitor.get("value")
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    return {"name": monitor["name"], "mode": monitor.get("mode"), "value": number}


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
