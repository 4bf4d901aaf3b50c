"""`hyperparameter_sweep`: an Optuna study whose trials are full `train_and_evaluate` runs,
packed onto the machine by Prefect's thread-pool task runner, pruned from inside their
training jobs, and resumable after any crash (trials left running continue from their own
last committed checkpoint, with the same parameters)."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import State, flow, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL
from prefect.states import Failed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.settings import flow_settings
from flows.train_and_evaluate import train_and_evaluate
from tasks.data import version_dataset_task
from tasks.storage import check_store, open_store
from tasks.train import prestart_training_workers
from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.objectives import monitored
from trainyard.project import ProjectPaths
from trainyard.report.links import artifact_key, page_link
from trainyard.runs.lease import read_lease
from trainyard.runs.plan import plan_run
from trainyard.runs.preflight import check_task
from trainyard.runs.record import (
    RunRecord,
    SweepTrial,
    check_run_id,
    find_record,
    git_state,
    new_run_id,
    now,
)
from trainyard.runtime.guardian import announce_flow_run
from trainyard.runtime.persistent import persistent_workers
from trainyard.runtime.processes import stop_all_jobs, stopping
from trainyard.storage.versioning import DatasetVersion
from trainyard.sweeps.checks import preflight_sweep, slot_gpus, trial_slots
from trainyard.sweeps.journal import repair_journal
from trainyard.sweeps.legacy import own_journal
from trainyard.sweeps.record import SweepRecord, check_same_data, find_sweep, save_sweep
from trainyard.sweeps.report import summary, trial_row
from trainyard.sweeps.space import touches_workers, trial_config
from trainyard.sweeps.study import (
    FINISHED,
    PendingTrial,
    SweepStudy,
    create_study,
    environment_failure,
    environment_text,
    failure_line,
)
from trainyard.sweeps.study import storage_url as study_storage_url

# A trial with neither a run lease nor a record this long after it started was abandoned.
STARTING_S = 120.0
_studies: dict[str, SweepStudy] = {}
_studies_lock = threading.Lock()
_flow_starts = threading.Lock()  # see _started_alone
_free_slots: dict[str, queue.Queue[list[int] | None]] = {}  # a sweep's idle slots' GPUs
# Why a sweep stopped because of where it runs (a full disk, the store down), by study name.
_halted: dict[str, str] = {}


@flow(name="hyperparameter_sweep")
def hyperparameter_sweep(
    overrides: list[str] | None = None,
    sweep_id: str | None = None,
    resume: bool = False,
) -> dict[str, Any] | State:
    """Run `sweep.n_trials` trials (or until `sweep.timeout_s`), `sweep.max_concurrent_trials`
    at a time; returns the `trainyard sweep show --json` summary. A sweep stopped by where
    it runs (a full disk, the store down) ends as a failed flow run whose message, one
    line, says why and how to continue it (its caller gets prefect's FailedRun).

    With `resume`, `sweep_id` names a sweep that stopped (or was killed): its finished trials
    stay, its trials left running continue, and the budget counts what was done.
    Settings: the params.yaml of the folder the flow runs in, with `overrides`
    (`section.key=value`, as `-S`)."""
    paths, config = flow_settings(overrides)
    sweep_id = check_run_id(sweep_id or new_run_id())
    # Every bound and choice, before any trial (`trainyard sweep run` hands over its plan).
    plan_run(config, paths.root, preflight_sweep)
    check_store(config, paths)
    announce_flow_run(PREFECT_API_URL.value(), flow_run.get_id())
    slots = trial_slots(config)
    # Each trial slot's workers stay up from trial to trial (trainyard.runtime.persistent): a trial pays
    # no torchrun, Python or torch start, and the first ones start while the study opens.
    with persistent_workers(max_idle=slots):
        if not touches_workers(config.sweep.space):
            prestart_training_workers(config, paths, slot_gpus(config, slots))
        return _sweep(config, paths, sweep_id, resume, slots)


def _sweep(
    config: TrainyardConfig, paths: ProjectPaths, sweep_id: str, resume: bool, slots: int
) -> dict[str, Any] | State:
    dataset = version_dataset_task(config, paths)
    record = open_sweep_task(config, paths, dataset, sweep_id, resume)
    _halted.pop(record.study_name, None)  # an earlier attempt's, in this process
    study = _study(record, config)
    study.fail_stale()  # trials whose host died wait as retries, from their checkpoints
    pending = trials_to_resume(study, config, paths, record.objective)
    finished = study.count(*FINISHED)
    deadline = _deadline(config, study, resume)
    get_run_logger().info(
        "sweep %s: %d trials finished, %d to resume; up to %d at a time",
        sweep_id,
        finished,
        len(pending),
        slots,
    )
    n_trials = config.sweep.n_trials
    fresh = None if n_trials is None else max(0, n_trials - finished - len(pending))
    free: queue.Queue[Any] = queue.Queue()
    _free_slots[sweep_id] = free
    for gpus in slot_gpus(config, slots):
        free.put(gpus)
    runner: Any = ThreadPoolTaskRunner(max_workers=slots)  # Prefect types it as of Never
    trials = run_trials.with_options(task_runner=runner)
    try:
        trials(record, config, dataset, str(paths.root), pending, fresh, slots, deadline)
    except BaseException:
        # Cancelled (Prefect's TerminationSignal under a worker) or interrupted: the trial
        # threads never see it, so their torchrun jobs are stopped for them.
        stop_all_jobs()
        raise
    if record.study_name in _halted:  # a failed flow run without a traceback: one line
        return Failed(message=_halted[record.study_name])
    create_link_artifact(
        key=artifact_key("sweep-report", record.sweep_id),
        link=page_link(sweep_id=record.sweep_id),
        link_text=f"sweep {record.sweep_id} in the comparison page (trainyard ui)",
        description=f"or: trainyard report --sweep {record.sweep_id} -o {record.sweep_id}.html",
    )
    return summary(record, study.study)


@task(name="open-sweep", cache_policy=NO_CACHE)
def open_sweep_task(
    config: TrainyardConfig,
    paths: ProjectPaths,
    dataset: DatasetVersion,
    sweep_id: str,
    resume: bool,
) -> SweepRecord:
    """The sweep's record and study: created, or (resuming) found and checked against the
    dataset version it was started on."""
    store = open_store(config, paths)
    existing = find_sweep(store, sweep_id)
    if existing is not None:
        check_same_data(existing, dataset.dvc_md5)
        moved = own_journal(store, existing, paths)
        if moved.storage != existing.storage:
            get_run_logger().info(
                "sweep %s: its study moved from the shared %s to %s",
                sweep_id,
                existing.storage,
                moved.storage,
            )
        existing = moved
        _trim_journal(existing)
        return existing
    if resume:
        raise TrainyardError(f"no sweep {sweep_id!r} to resume; see `trainyard sweep list`")
    objective = check_task(config)
    metric = monitored(config.task, objective)
    record = SweepRecord(
        sweep_id=sweep_id,
        study_name=f"trainyard-{sweep_id}",
        storage=study_storage_url(config.sweep, paths, sweep_id),
        direction="maximize" if objective.mode(metric) == "max" else "minimize",
        objective=f"val_{metric}",
        created_at=now(),
        dataset_path=dataset.path,
        dataset_md5=dataset.dvc_md5,
        code=git_state(paths.root),
        params=config.model_dump(mode="json"),
    )
    attrs = {"sweep_id": sweep_id, "dataset_md5": dataset.dvc_md5, **record.code}
    create_study(record.storage, record.study_name, record.direction, attrs)
    save_sweep(store, record)
    return record


def _trim_journal(record: SweepRecord) -> None:
    """A torn record (a write cut short by a full disk or a kill) is cut off before anything
    is appended, the file as it was kept beside it."""
    if "://" in record.storage:
        return
    copy = repair_journal(Path(record.storage))
    if copy is not None:
        get_run_logger().warning(
            "sweep %s: its journal %s held a record cut short (a write that failed); "
            "repaired it, the file as it was kept as %s",
            record.sweep_id,
            record.storage,
            copy.name,
        )


@flow(name="sweep-trials")
def run_trials(
    record: SweepRecord,
    config: TrainyardConfig,
    dataset: DatasetVersion,
    project_dir: str,
    pending: list[PendingTrial],
    fresh: int | None,
    slots: int,
    deadline: float | None,
) -> None:
    """The trials, `slots` at a time (this flow's task runner has that many threads): the
    ones left running first, then `fresh` new ones; with no trial budget (`None`), new ones
    in waves of `slots` until `sweep.timeout_s` or too many failures."""
    args = (record, config, dataset, project_dir)
    futures = [trial_task.submit(*args, trial, deadline) for trial in pending]
    futures += [trial_task.submit(*args, None, deadline) for _ in range(fresh or 0)]
    wait(futures)
    study = _study(record, config)
    while fresh is None and _stop_reason(study, config, deadline) is None:
        wave = [trial_task.submit(*args, None, deadline) for _ in range(slots)]
        if not any(trial.result() for trial in wave):  # nothing left to ask (a covered grid)
            break
    # With heartbeats, the study's trials elsewhere are watched to their end: the retries
    # of those whose host died are run here (each asks the study for a waiting retry).
    while not stopping() and _stop_reason(study, config, deadline) is None:
        waiting = study.await_others()
        if waiting is None:
            return
        wait([trial_task.submit(*args, None, deadline) for _ in range(min(waiting, slots))])


@task(name="sweep-trial", cache_policy=NO_CACHE)
def trial_task(
    record: SweepRecord,
    config: TrainyardConfig,
    dataset: DatasetVersion,
    project_dir: str,
    pending: PendingTrial | None,
    deadline: float | None,
) -> dict[str, Any] | None:
    """One trial through `train_and_evaluate`; a failing trial is recorded and the sweep
    goes on, unless it failed because of where it runs (a full disk, the store down): that
    stops the sweep. A new trial (`pending` None) is asked for only if the budget allows."""
    try:
        return _trial(record, config, dataset, project_dir, pending, deadline)
    except Exception as exc:
        if not environment_failure(exc):
            raise
        _halt(record, failure_line(exc), pending)
        return None


def _halt(record: SweepRecord, reason: str, pending: PendingTrial | None) -> None:
    """No trial starts after this; trials already running end on their own. The trial that
    met the failure stays RUNNING in the study (its journal may not be writable): a resume
    runs it again, with the same parameters."""
    which = f"trial {pending.number}" if pending else "a trial"
    reason = re.sub(r"\b(?:\w+\.)+(?=\w+(?:Error|Exception)\b)", "", reason)  # no module paths
    _halted.setdefault(
        record.study_name,
        f"sweep {record.sweep_id} stopped by where it runs, not by its trials' parameters "
        f"(free disk space or bring the store back, then continue with: trainyard sweep run "
        f"--sweep-id {record.sweep_id}): {which}: {reason}",
    )
    get_run_logger().error("%s", _halted[record.study_name])


def _trial(
    record: SweepRecord,
    config: TrainyardConfig,
    dataset: DatasetVersion,
    project_dir: str,
    pending: PendingTrial | None,
    deadline: float | None,
) -> dict[str, Any] | None:
    logger = get_run_logger()
    study = _study(record, config)
    if pending is None:
        why = "the sweep was interrupted" if stopping() else _stop_reason(study, config, deadline)
        if why is not None:
            logger.info("no new trial: %s", why)
            return None
        pending = study.ask(config.sweep.space, new_run_id(), config.sweep.n_trials)
        if pending is None:
            logger.info("no new trial: the study holds sweep.n_trials trials")
            return None
    elif pending.run_id is None:  # the sweep died between asking and naming the run
        pending = PendingTrial(pending.number, pending.params, new_run_id())
        study.handle(pending.number).set_user_attr("run_id", pending.run_id)
    number = pending.number
    logger.info("trial %d (run %s): %s", number, pending.run_id, pending.params)
    resume_from = _retried_run(pending, config, project_dir)
    try:
        with (
            _trial_slot(record.sweep_id) as gpus,
            _started_alone() as running,
            study.heartbeat(number),
        ):
            run = train_and_evaluate.with_options(on_running=[running])(
                config=_on_gpus(trial_config(config, pending.params), gpus),
                dataset=dataset,
                project_dir=project_dir,
                run_id=pending.run_id,
                resume_from=resume_from,
                sweep=SweepTrial(
                    sweep_id=record.sweep_id, study_name=record.study_name, trial=number
                ),
            )
    except Exception as exc:  # interruptions (BaseException) stop the sweep, resumably
        if environment_failure(exc):
            _halt(record, failure_line(exc), pending)
            return None
        study.failed(number, failure_line(exc))
        logger.warning("trial %d failed: %s", number, failure_line(exc))
    else:
        if run.status == "pruned":
            study.pruned(number)
        else:
            study.complete(number, run.metrics[record.objective])
    _publish_trials(record, study)
    return trial_row(study.study.get_trials(deepcopy=False)[number])


def _retried_run(pending: PendingTrial, config: TrainyardConfig, project_dir: str) -> str | None:
    """The run whose last committed checkpoint a retry continues: its last try's, unless
    that host died before its first commit (the retry then starts over)."""
    if pending.retry_of is None or pending.resume_from is None:
        return None
    store = open_store(config, ProjectPaths(Path(project_dir)))
    resume_from = pending.resume_from if committed_checkpoints(store, pending.resume_from) else None
    get_run_logger().info(
        "trial %d retries trial %d, whose host stopped, from %s",
        pending.number,
        pending.retry_of,
        f"run {resume_from}'s last checkpoint" if resume_from else "the start",
    )
    return resume_from


@contextmanager
def _trial_slot(sweep_id: str) -> Iterator[list[int] | None]:
    """A free trial slot's GPUs (None on CPUs) for as long as the trial runs: at most one
    trial per slot, as the task runner runs no more trials than there are slots."""
    free = _free_slots[sweep_id]
    gpus = free.get()
    try:
        yield gpus
    finally:
        free.put(gpus)


def _on_gpus(config: TrainyardConfig, gpus: list[int] | None) -> TrainyardConfig:
    if gpus is None:
        return config
    return config.model_copy(update={"train": config.train.model_copy(update={"gpus": gpus})})


@contextmanager
def _started_alone() -> Iterator[Callable[..., None]]:
    """Holds every other trial's subflow back until this one's is running (the hook it
    yields, for `on_running`, lets them go; so does leaving). Trials start together, and two
    flow runs created at once conflict in the API's SQLite database (SQLITE_BUSY_SNAPSHOT):
    it answers 503 and Prefect's client retries 2 s later. Measured with 2 trial slots:
    the second trial's subflow began 2.1-4.5 s after the first's, with this 0.1-0.2 s."""
    _flow_starts.acquire()
    once = threading.Lock()

    def running(*_: Any) -> None:
        if once.acquire(blocking=False):
            _flow_starts.release()

    try:
        yield running
    finally:
        running()


def _study(record: SweepRecord, config: TrainyardConfig) -> SweepStudy:
    """One SweepStudy per sweep in this process, shared by its trial threads."""
    with _studies_lock:
        if record.sweep_id not in _studies:
            _studies[record.sweep_id] = SweepStudy(
                record.storage, record.study_name, config.sweep, config.train.epochs
            )
        return _studies[record.sweep_id]


def _stop_reason(study: SweepStudy, config: TrainyardConfig, deadline: float | None) -> str | None:
    from optuna.trial import TrialState

    if study.study.study_name in _halted:
        return _halted[study.study.study_name]
    failed = study.count(TrialState.FAIL)
    if failed >= config.sweep.max_failed_trials:
        return f"{failed} trials failed (sweep.max_failed_trials={config.sweep.max_failed_trials})"
    if deadline is not None and time.time() >= deadline:
        return f"sweep.timeout_s={config.sweep.timeout_s:g} reached"
    return None


def trials_to_resume(
    study: SweepStudy, config: TrainyardConfig, paths: ProjectPaths, objective: str
) -> list[PendingTrial]:
    """Trials left running that no live process owns. A trial's run is owned through its
    lease; one with neither a lease nor a record yet is taken only once it is older than
    STARTING_S (a sweep process elsewhere may be starting it). A trial whose run finished
    is told its outcome from the run's record instead: its sweep process died, or has not
    told it yet (the lease goes before the study hears), and running it again would fail."""
    store = open_store(config, paths)
    pending = []
    for trial, age_s in study.unfinished():
        lease = read_lease(store, trial.run_id) if trial.run_id else None
        if lease is not None and lease.is_live():
            continue
        run = find_record(store, trial.run_id) if trial.run_id else None
        if run is not None and run.status == "failed" and environment_text(run.error):
            # It failed because of where it ran (a full disk): again, as a new run.
            pending.append(PendingTrial(trial.number, trial.params, None))
            continue
        if run is not None and run.status in ("completed", "pruned", "failed"):
            _tell_outcome(study, trial.number, run, objective)
            continue
        if lease is None and run is None and age_s < STARTING_S:
            continue
        pending.append(trial)
    return pending


def _tell_outcome(study: SweepStudy, number: int, run: RunRecord, objective: str) -> None:
    """What `trial_task` tells the study of a finished run; a trial already told is left."""
    value = run.metrics.get(objective)
    if run.status == "pruned":
        study.pruned(number)
    elif run.status == "completed" and value is not None:
        study.complete(number, value)
    else:
        study.failed(number, run.error or f"run {run.run_id} has no {objective}")


def _deadline(config: TrainyardConfig, study: SweepStudy, resume: bool) -> float | None:
    """`sweep.timeout_s` counts the time the sweep's trials already took before a resume."""
    if config.sweep.timeout_s is None:
        return None
    spent = 0.0
    trials = study.study.get_trials(deepcopy=False) if resume else []
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if t.datetime_complete]
    if starts and ends:
        spent = (max(ends) - min(starts)).total_seconds()
    return time.time() + config.sweep.timeout_s - spent


def _publish_trials(record: SweepRecord, study: SweepStudy) -> None:
    """The trials table as a Prefect artifact, a new version each time a trial finishes."""
    rows = [
        {
            **row,
            "params": ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row["params"].items()
            ),
        }
        for row in map(trial_row, study.study.get_trials(deepcopy=False))
    ]
    create_table_artifact(
        key=f"sweep-{record.sweep_id}".lower(),
        table=rows,
        description=f"sweep {record.sweep_id} trials",
    )
