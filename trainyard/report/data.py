"""The comparison page's one data document: runs, registry and sweeps, cut down to what the
views draw. Built from the store's own records; nothing from the environment goes in."""

from __future__ import annotations

import datetime as dt
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from trainyard.errors import TrainyardError
from trainyard.registry import aliases_of, list_models, list_versions, read_history
from trainyard.runs.live_files import history_path, live_path, read_live, read_live_history
from trainyard.runs.record import (
    READERS,
    RUN_ID,
    RankLanes,
    RunRecord,
    Straggler,
    map_records,
    newest_first,
    record_names,
    shown_status,
)
from trainyard.storage import Store
from trainyard.sweeps.record import SweepRecord, load_sweep, sweep_key
from trainyard.util.documents import Skipped, UnreadableDocument, read_model

if TYPE_CHECKING:  # the study module imports Optuna: only a page with sweeps pays for it
    from trainyard.sweeps.study import ReadableStorages

SCHEMA_VERSION = 1
# A run's per-rank lanes in the page: coarser windows past this many (2,000 runs stay light).
PAGE_LANE_WINDOWS = 64
# Settings that say where things are stored: an endpoint or an Optuna RDB URL may carry a
# password, and no view needs them.
DROPPED_PARAMS = ("storage", "sweep.storage")
_NO_JOURNAL = (
    "the study's journal file is not on this machine; build the report where the sweep ran"
)
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


class RunRow(BaseModel):
    run_id: str
    status: str  # shown status: "crashed" for a running record whose owner stopped
    progress: str | None = None  # a running run's "epoch 300/1000", from its live status
    created_at: str
    finished_at: str | None = None
    task: str | None = None
    model: str | None = None
    dataset_path: str | None = None
    dataset_md5: str | None = None
    code_commit: str | None = None
    code_dirty: bool | None = None
    sweep_id: str | None = None
    trial: int | None = None
    world_size: int | None = None
    nodes: str | None = None  # "0: host-a x2, 1: host-b x2", a stay per node (record.nodes)
    monitor: dict[str, Any] | None = None  # {name, mode, value} on the test split
    metrics: dict[str, float] = Field(default_factory=dict)
    params: dict[str, Any] = Field(default_factory=dict)  # flattened: "train.lr" -> 0.01
    # Per-epoch curves, column-wise: {"epoch": [1, 2], "train_loss": [...], "val_loss": [...]}.
    curves: dict[str, list[float | None]] = Field(default_factory=dict)
    timings_s: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    # The per-rank lanes (the last launch's), the stragglers found, and where training
    # resumed from a checkpoint: {"step", "label"}.
    lanes: RankLanes | None = None
    stragglers: list[Straggler] = Field(default_factory=list)
    resumes: list[dict[str, Any]] = Field(default_factory=list)


class VersionRow(BaseModel):
    version: int
    run_id: str
    dataset_md5: str | None
    code_commit: str | None
    monitor: dict[str, Any] | None
    created_at: str
    registered_by: str


class AliasChangeRow(BaseModel):
    seq: int
    alias: str
    action: str
    from_version: int | None
    to_version: int
    at: str
    by: str
    evidence: dict[str, Any]  # rule, metric, mode, from_value, to_value, detail
    reverts: int | None = None


class ModelView(BaseModel):
    name: str
    aliases: dict[str, int]
    versions: list[VersionRow]
    history: list[AliasChangeRow]


class TrialRow(BaseModel):
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    run_id: str | None
    last_epoch: int | None
    duration_s: float | None


class SweepView(BaseModel):
    sweep_id: str
    objective: str
    direction: str
    created_at: str
    dataset_md5: str
    counts: dict[str, int]
    best: dict[str, Any] | None
    trials: list[TrialRow]
    error: str | None = None  # the study could not be opened: the page says so, the rest shows


class SkippedRow(BaseModel):
    """A document left out because it could not be read: the page counts and names them."""

    uri: str
    reason: str


class ReportData(BaseModel):
    schema_version: int = SCHEMA_VERSION
    generated_at: str
    where: str  # the store's runs folder, s3://bucket/prefix/runs
    runs: list[RunRow]
    models: list[ModelView]
    sweeps: list[SweepView]
    selected_sweep: str | None = None
    selected_runs: list[str] = Field(default_factory=list)  # ticked when the page opens
    skipped: list[SkippedRow] = Field(default_factory=list)


class RecordCache:
    """Every run record as last read, with the ETag it had: `trainyard ui` builds the page
    data on every request, and reading 2,000 records took 13 s. One listing of the runs
    says which records were written since (or deleted); only those are read again."""

    def __init__(self, store: Store):
        self.store = store
        self._records: dict[str, tuple[str, RunRecord]] = {}
        self._lock = threading.Lock()  # the server answers requests on several threads
        self.last_reads = 0  # records read by the last call

    def records(self, skipped: Skipped) -> list[RunRecord]:
        """Every readable run's record, newest first; damaged ones go to `skipped` (and
        are read again next time, until they are mended)."""
        tags = {
            key.split("/")[1]: tag
            for key, tag in self.store.list_etags("runs").items()
            if key.count("/") == 2 and key.endswith("/run.json")
        }
        tags = {run_id: tag for run_id, tag in tags.items() if RUN_ID.fullmatch(run_id)}
        with self._lock:
            stale = [
                r for r, tag in tags.items() if r not in self._records or self._records[r][0] != tag
            ]
            # A record written again between the listing and this read is kept with the older
            # tag, so the next call reads it once more.
            found = map_records(self.store, stale, lambda record: record, skipped)
            for run_id, record in zip(stale, found, strict=True):
                if record is not None:
                    self._records[run_id] = (tags[run_id], record)
                else:  # damaged since it was read (or deleted): not shown as it was
                    self._records.pop(run_id, None)
            for gone in set(self._records) - set(tags):
                del self._records[gone]
            self.last_reads = len(stale)
            records = [record for _, record in self._records.values()]
        return sorted(records, key=lambda r: (r.created_at, r.run_id), reverse=True)


def build_report_data(
    store: Store,
    run_ids: list[str] | None = None,
    sweep_id: str | None = None,
    cache: RecordCache | None = None,
    storages: ReadableStorages | None = None,
    staging: Path | None = None,
    selected: list[str] | None = None,
) -> ReportData:
    """Every run in the store (read through `cache` when given), or the runs named (in that
    order), or a sweep's trials; the registry's models; the sweeps those runs belong to (all
    of them when no run is named). A damaged document is left out and listed in `skipped`.
    Sweeps' studies are opened read-only, and only where `storages` allows: the CLI passes
    the project's own, so a planted sweep record cannot make the page read elsewhere (None:
    local journal files only, and no URL). A running run's curves and progress come from
    its live files in `staging` when its rank 0 trains on this machine. `selected`: the runs
    ticked when the page opens (default: the runs named)."""
    skipped = Skipped()
    records = _select_records(store, run_ids, sweep_id, cache, skipped)
    wanted = None if not (run_ids or sweep_id) else {r.sweep.sweep_id for r in records if r.sweep}
    sweeps = _sweep_views(store, sweep_id, wanted, skipped, storages)
    with ThreadPoolExecutor(READERS) as pool:  # a running record's heartbeat is one more read
        statuses = list(pool.map(lambda r: shown_status(store, r)[0], records))
    models = [model_view(store, name, skipped) for name in list_models(store)]
    return ReportData(
        generated_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        where=store.uri("runs"),
        runs=[
            _live(run_row(r, status), staging) for r, status in zip(records, statuses, strict=True)
        ],
        models=models,
        sweeps=sweeps,
        selected_sweep=sweep_id,
        selected_runs=list(dict.fromkeys(selected if selected is not None else run_ids or [])),
        skipped=[SkippedRow(uri=d.uri, reason=d.reason) for d in skipped.documents],
    )


def _select_records(
    store: Store,
    run_ids: list[str] | None,
    sweep_id: str | None,
    cache: RecordCache | None,
    skipped: Skipped,
) -> list[RunRecord]:
    if run_ids:
        unique = list(dict.fromkeys(run_ids))
        found = dict(zip(unique, _read_records(store, unique, skipped), strict=True))
        damaged = {d.uri for d in skipped.documents}
        missing = [
            run_id
            for run_id, record in found.items()
            if record is None and store.uri(f"runs/{run_id}/run.json") not in damaged
        ]
        if missing:
            raise TrainyardError(
                f"no run {', '.join(map(repr, missing))} in {store.uri('runs')}; "
                "see `trainyard runs list`"
            )
        records = [r for r in found.values() if r is not None]
    elif cache is not None:
        records = cache.records(skipped)
    else:
        listed = _read_records(store, record_names(store), skipped)
        records = newest_first(listed, key=lambda r: (r.created_at, r.run_id))
    if sweep_id:
        load_sweep(store, sweep_id)  # an unknown sweep is one clear line
        records = [r for r in records if r.sweep and r.sweep.sweep_id == sweep_id]
    return records


def _read_records(store: Store, run_ids: list[str], skipped: Skipped) -> list[RunRecord | None]:
    return map_records(store, run_ids, lambda record: record, skipped)


def run_row(record: RunRecord, status: str) -> RunRow:
    params = flat_params(record.params)
    return RunRow(
        run_id=record.run_id,
        status=status,
        created_at=record.created_at,
        finished_at=record.finished_at,
        task=params.get("task.name"),
        model=params.get("model.name"),
        dataset_path=record.dataset.path if record.dataset else None,
        dataset_md5=record.dataset.dvc_md5 if record.dataset else None,
        code_commit=record.code.get("git_commit"),
        code_dirty=record.code.get("git_dirty"),
        sweep_id=record.sweep.sweep_id if record.sweep else None,
        trial=record.sweep.trial if record.sweep else None,
        world_size=record.world_size,
        nodes=", ".join(f"{n.node_rank}: {n.host} x{n.workers}" for n in record.nodes) or None,
        monitor=record.monitor,
        metrics=record.metrics,
        params=params,
        curves=curves(record.history),
        timings_s=record.timings_s,
        error=_scrubbed(record.error) if record.error else None,
        lanes=_page_lanes(record.rank_lanes),
        stragglers=record.stragglers,
        resumes=[
            {"step": e["from_step"], "label": _resume_label(e)}
            for e in record.resumes
            if e.get("from_step") is not None
        ],
    )


def _live(row: RunRow, staging: Path | None) -> RunRow:
    """A running run's record has no history until it ends: its rank 0's live files (when it
    trains on this machine) give the curves so far and the epoch it is at."""
    if row.status != "running" or staging is None:
        return row
    status = read_live(live_path(staging, row.run_id))
    if status is not None and status.run_id == row.run_id:
        row.progress = f"epoch {status.epoch}/{status.epochs}"
    history = read_live_history(history_path(staging, row.run_id))
    if history:
        row.curves = curves(history)
    return row


def _page_lanes(lanes: RankLanes | None) -> RankLanes | None:
    while lanes is not None and len(lanes.steps) > PAGE_LANE_WINDOWS:
        lanes = lanes.halved()
    return lanes


def _resume_label(event: dict[str, Any]) -> str:
    attempt = event.get("attempt")
    restarted = f" (restart {attempt})" if attempt else ""
    return f"resumed from step {event['from_step']}{restarted}"


def flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.1}} -> {"train.lr": 0.1}, without the storage settings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if name in DROPPED_PARAMS:
            continue
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = _scrubbed(value)
    return flat


def _scrubbed(value: Any) -> Any:
    """A URL's user:password@ part removed, wherever a string carries one."""
    if isinstance(value, str):
        return _USERINFO.sub("", value)
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    return value


def curves(history: list[dict[str, float]]) -> dict[str, list[float | None]]:
    """The history's learning curves (train_* and val_* metrics, not timings) as columns."""
    names = sorted(
        {
            key
            for row in history
            for key in row
            if key.startswith(("train_", "val_")) and not key.endswith("_s")
        }
    )
    if not names:
        return {}
    epochs: list[float | None] = [row.get("epoch", i + 1) for i, row in enumerate(history)]
    return {"epoch": epochs} | {name: [row.get(name) for row in history] for name in names}


def model_view(store: Store, name: str, skipped: Skipped) -> ModelView:
    history = read_history(store, name, skipped)
    return ModelView(
        name=name,
        aliases=aliases_of(history),
        versions=[
            VersionRow(
                version=v.version,
                run_id=v.run_id,
                dataset_md5=v.dataset_md5,
                code_commit=v.code.get("git_commit"),
                monitor=v.monitor,
                created_at=v.created_at,
                registered_by=v.registered_by,
            )
            for v in list_versions(store, name, skipped)
        ],
        history=[
            AliasChangeRow(
                **entry.model_dump(exclude={"token", "evidence"}),
                evidence=entry.evidence.model_dump(),
            )
            for entry in history
        ],
    )


# Trial states as the sweep summary lists them: the finished ones first.
SHOWN_STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")


def _sweep_views(
    store: Store,
    sweep_id: str | None,
    wanted: set[str] | None,
    skipped: Skipped,
    storages: ReadableStorages | None,
) -> list[SweepView]:
    """The named sweep, the sweeps in `wanted`, or all (`wanted` None); a damaged sweep
    record goes to `skipped`."""
    names = [sweep_id] if sweep_id else store.list_dirs("sweeps")
    if not sweep_id and wanted is not None:
        names = [n for n in names if n in wanted]
    names = [n for n in names if RUN_ID.fullmatch(n)]
    records = []
    for name in names:
        try:
            records.append(read_model(store, sweep_key(name), SweepRecord))
        except FileNotFoundError:
            continue
        except UnreadableDocument as exc:
            skipped.add(exc)
    records.sort(key=lambda r: r.created_at, reverse=True)  # as `sweep list` orders them
    return [sweep_view(r, storages) for r in records]


def sweep_view(record, storages: ReadableStorages | None = None) -> SweepView:
    """The study's trials (Optuna, imported only when there is a sweep to show), as `sweep
    show` lists them, without its fANOVA importances: `ui` rebuilds this every few seconds.
    A study that cannot be opened leaves the rest of the page intact."""
    # Start-up cost: these import Optuna (about 0.6 s), which only a page with sweeps pays.
    from trainyard.sweeps.report import best_trial, load_study, trial_row
    from trainyard.sweeps.study import LOCAL_JOURNALS

    base = {
        "sweep_id": record.sweep_id,
        "objective": record.objective,
        "direction": record.direction,
        "created_at": record.created_at,
        "dataset_md5": record.dataset_md5,
    }
    if "://" not in record.storage and not Path(record.storage).exists():
        # Opening it would create an empty journal: say where it was expected instead.
        return SweepView(**base, counts={}, best=None, trials=[], error=_NO_JOURNAL)
    try:
        study = load_study(record, storages or LOCAL_JOURNALS)
        trials = study.get_trials(deepcopy=False)
        best = best_trial(study)
    except Exception as exc:  # noqa: BLE001 - any storage failure: show it, keep the page
        message = _scrubbed(f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
        return SweepView(**base, counts={}, best=None, trials=[], error=message)
    rows = [trial_row(t) for t in trials]
    return SweepView(
        **base,
        counts={  # in a fixed order (a set's order changes from process to process)
            state: n for state in SHOWN_STATES if (n := sum(t["state"] == state for t in rows))
        },
        best=best,
        trials=[TrialRow(**{k: t[k] for k in TrialRow.model_fields}) for t in rows],
    )
