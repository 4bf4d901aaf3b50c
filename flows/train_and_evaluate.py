"""`train_and_evaluate`: split -> distributed training and testing -> run record."""

from __future__ import annotations

import platform
import time
from traceback import format_exception
from typing import cast

import torch
from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.exceptions import ExternalSignal
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

import trainyard
from tasks.data import split_dataset_task
from tasks.storage import open_store, save_run_record
from tasks.train import evaluate_task, plan_resume_task, train_task
from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError, WorkerFailed, first_line
from trainyard.objectives import Objective, monitored, objective_for
from trainyard.project import ProjectPaths
from trainyard.report.links import artifact_key, page_link, report_markdown
from trainyard.runs.confined import flow_project
from trainyard.runs.continuation import changes, check_work_left
from trainyard.runs.contracts import EvaluationResult, TrainingResult
from trainyard.runs.lease import RunLease
from trainyard.runs.machines import machines_seen
from trainyard.runs.record import (
    DatasetInfo,
    RunRecord,
    SweepTrial,
    check_run_id,
    find_record,
    git_state,
    new_run_id,
    now,
)
from trainyard.runtime.guardian import announce_flow_run
from trainyard.runtime.progress import last_step, peak_rss_mb, recorded_resumes
from trainyard.storage import Store
from trainyard.storage.versioning import DatasetVersion
from trainyard.util.files import write_text_atomic


@flow(name="train_and_evaluate")
def train_and_evaluate(
    config: TrainyardConfig,
    dataset: DatasetVersion,
    project_dir: str = ".",
    run_id: str | None = None,
    resume_from: str | None = None,
    warm_start: bool = False,
    sweep: SweepTrial | None = None,
    warm_start_from: str | None = None,
    group: str | None = None,
) -> RunRecord:
    """Split `dataset` (a versioned data reference), train across `train.workers` processes,
    score the test split and record the run: the unit the pipeline, sweeps, retraining and
    deployments compose. `config` has passed `trainyard.runs.preflight` already.

    A run id with a record continues that run with its stored settings (only the keys in
    `trainyard.runs.continuation` may differ) from its latest committed checkpoint;
    `resume_from` continues another run's latest checkpoint, or takes only its weights
    with `warm_start`; `warm_start_from` takes the weights of a checkpoint URI instead (a
    registry version's), on this or an older dataset version. The run's lease in the store
    makes this flow its only owner.
    `sweep`: the sweep trial this run is; its pruner may end training early (status pruned).
    `group`: what the run's Comet experiments are grouped under with other runs' (a
    sweep's trials are grouped by their sweep). `project_dir` must be the folder the flow
    runs in (a deployment's project).
    """
    if resume_from is not None and warm_start_from is not None:
        raise TrainyardError(
            f"resume_from {resume_from!r} and warm_start_from {warm_start_from!r}: give one "
            "checkpoint to start from, a run's or a checkpoint URI"
        )
    paths = flow_project(project_dir)
    run_id = check_run_id(run_id or new_run_id())
    if resume_from is not None:  # a key in the store, like run_id
        check_run_id(resume_from)
    started = time.monotonic()
    announce_flow_run(PREFECT_API_URL.value(), flow_run.get_id())
    store = open_store(config, paths)
    with RunLease(store, run_id) as lease:
        record = _open_record(store, run_id, config, paths, resume_from, warm_start, lease)
        record.warm_start_from = warm_start_from
        record.sweep = sweep
        record.group = group or record.group
        save_run_record(record, config, paths, lease.token)
        try:
            _run_stages(record, config, paths, dataset, started, lease.token)
        except BaseException as exc:
            _record_stop(record, exc, store, paths)
            record.timings_s["total"] = round(time.monotonic() - started, 3)
            save_run_record(record, config, paths, lease.token)
            raise
    return record


def _open_record(
    store: Store,
    run_id: str,
    config: TrainyardConfig,
    paths: ProjectPaths,
    resume_from: str | None,
    warm_start: bool,
    lease: RunLease,
) -> RunRecord:
    """A new record, or the continuation of this run id's record (same settings but for
    the resumable keys, same created_at, one more `resumes` entry saying what changed)."""
    record = RunRecord(
        run_id=run_id,
        created_at=now(),
        params=config.model_dump(mode="json"),
        code=git_state(paths.root),
        versions={
            "trainyard": trainyard.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        resume_from=resume_from,
        warm_start=warm_start,
    )
    previous = find_record(store, run_id)
    if previous is None:
        return record
    changed = changes(run_id, previous.params, config)
    check_work_left(previous, changed)
    record.created_at = previous.created_at
    record.resumes = [
        *previous.resumes,
        {
            "kind": "continue",
            "at": now(),
            "previous_status": "crashed" if lease.taken_over else previous.status,
            "changes": changed,
            "took_over": lease.takeover_note(),
        },
    ]
    return record


def _record_stop(record: RunRecord, exc: BaseException, store: Store, paths: ProjectPaths) -> None:
    """What the record says when the run ends early: interrupted (Ctrl-C, SIGTERM, a
    cancelled flow run) or failed, with the step reached and the last committed checkpoint."""
    interrupted = isinstance(exc, KeyboardInterrupt | SystemExit | ExternalSignal)
    record.status, record.finished_at = ("interrupted" if interrupted else "failed"), now()
    if not interrupted:
        _record_error(record, exc, paths)
    record.last_step = last_step(paths.staging / record.run_id)
    _record_machines(record, paths)
    record.checkpoints = committed_checkpoints(store, record.run_id)
    record.final_checkpoint = record.checkpoints[-1] if record.checkpoints else None


def _record_machines(record: RunRecord, paths: ProjectPaths) -> None:
    """Each node, each rank's host and each host change, from the rounds rank 0 gathered in
    this node's staging folder; the job has just ended."""
    folder = paths.staging / record.run_id
    record.nodes, record.rank_hosts, record.host_changes = machines_seen(folder, time.time())


def _record_error(record: RunRecord, exc: BaseException, paths: ProjectPaths) -> None:
    """The error as one line, its traceback in a file the record names, and the restarts
    torchrun made and the steps they redid (the training job never reported them)."""
    folder = paths.run_logs(record.run_id)
    if isinstance(exc, WorkerFailed) and exc.summary is not None:
        record.error, trace = exc.line(), exc.traceback or str(exc)
        name = f"error-rank{exc.rank}.txt" if exc.rank is not None else "error.txt"
        record.restarts = exc.restarts if exc.restarts is not None else record.restarts
        record.take_launch_resumes(recorded_resumes(paths.staging / record.run_id))
    else:
        record.error, trace, name = first_line(exc), "".join(format_exception(exc)), "error.txt"
    try:  # owner-only: a traceback may quote what a user's code held
        write_text_atomic(folder / name, trace, private=True)
    except OSError:  # a full disk: the record still says what failed
        return
    record.error_file = str((folder / name).relative_to(paths.root))


def _run_stages(
    record: RunRecord,
    config: TrainyardConfig,
    paths: ProjectPaths,
    dataset: DatasetVersion,
    started: float,
    lease_token: str | None = None,
) -> None:
    timings = record.timings_s
    clock = time.monotonic()
    split = split_dataset_task(config, paths, dataset.dvc_md5)
    schema = split.schema
    record.dataset = DatasetInfo(
        path=dataset.path,
        dvc_md5=dataset.dvc_md5,
        rows=sum(schema.rows.values()),
        split_rows=schema.rows,
        classes=schema.classes,
        split_key=split.key,  # the workers read this run's split from there
    )
    plan = plan_resume_task(record, config, paths, schema)
    record.resume_checkpoint = plan.checkpoint if plan else None
    record.warm_start = bool(plan and plan.warm_start)
    timings["data"] = round(time.monotonic() - clock, 3)
    save_run_record(record, config, paths, lease_token)

    clock, began = time.monotonic(), time.time()
    training = train_task(record.run_id, config, paths, lease_token)
    timings["train"] = round(time.monotonic() - clock, 3)
    _record_machines(record, paths)
    _record_training(record, training, config.data.context if schema.kind == "tokens" else None)
    if record.first_step_at is not None and record.first_step_at > began:
        # Of `train`, the part before the first step: the workers' start, and on many
        # machines the other nodes' (their hosts' workers, the rendezvous).
        timings["train_start"] = round(record.first_step_at - began, 3)

    # The training job scored the test split with the final checkpoint's weights; a second
    # torchrun launch only when it could not (its last checkpoint was not the last step's).
    # final_checkpoint: set from the job's result by _record_training just above.
    evaluation = training.evaluation or evaluate_task(
        record.run_id, cast(str, record.final_checkpoint), config, paths
    )
    timings["evaluate"] = round(evaluation.seconds, 3)
    _record_metrics(record, evaluation, objective_for(config.task, schema), config)

    record.peak_rss_mb = {"flow": peak_rss_mb(), "workers": training.peak_rss_mb_per_rank}
    record.status = "pruned" if training.pruned_at_epoch is not None else "completed"
    record.finished_at = now()
    timings["total"] = round(time.monotonic() - started, 3)
    save_run_record(record, config, paths, lease_token)
    create_markdown_artifact(
        key="run-summary", markdown=_summary_markdown(record), description=record.run_id
    )
    create_link_artifact(
        key=artifact_key("run-report", record.run_id),
        link=page_link([record.run_id]),
        link_text=f"run {record.run_id} in the comparison page (trainyard ui)",
        description=f"or: trainyard report {record.run_id} -o {record.run_id}.html",
    )


def _record_training(record: RunRecord, training: TrainingResult, context: int | None) -> None:
    """What the training job reports; `context`: tokens per sample, for a token dataset."""
    record.world_size, record.layout = training.world_size, training.layout
    record.device, record.backend = training.device, training.backend
    record.history = training.history
    record.checkpoints = training.checkpoints
    record.final_checkpoint = training.final_checkpoint
    record.first_step_at = training.first_step_at
    record.restarts = training.restarts
    record.take_launch_resumes(training.resumes)
    record.tracking = training.experiments
    record.pruned_at_epoch = training.pruned_at_epoch
    record.stragglers = training.stragglers
    record.rank_lanes = training.rank_lanes
    record.communication = training.communication
    # Each model-parallel group's workers all read its rows: they count once.
    group = record.config.train.parallel.model_workers
    samples_per_s = sum(training.samples_per_s_per_rank) / group
    record.metrics["train_samples_per_s"] = round(samples_per_s, 1)
    if context is not None:  # a sample is a window of data.context tokens
        record.metrics["train_tokens_per_s"] = round(samples_per_s * context, 1)


def _record_metrics(
    record: RunRecord, evaluation: EvaluationResult, objective: Objective, config: TrainyardConfig
) -> None:
    """test_<m> and val_<m> for every metric of the task, and the monitored one."""
    last_epoch = record.history[-1]
    for name in objective.metrics:
        record.metrics[f"test_{name}"] = evaluation.metrics[name]
        record.metrics[f"val_{name}"] = last_epoch[f"val_{name}"]
    name = monitored(config.task, objective)
    value = evaluation.metrics[name]
    record.monitor = {"name": name, "mode": objective.mode(name), "value": value}


def _summary_markdown(record: RunRecord) -> str:
    rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in sorted(record.metrics.items()))
    return (
        f"# Run `{record.run_id}`\n\n| metric | value |\n|---|---|\n{rows}\n\n"
        f"Dataset `{record.dataset.path if record.dataset else '-'}` "
        f"(DVC md5 `{record.dataset.dvc_md5 if record.dataset else '-'}`), "
        f"world size {record.world_size}, final checkpoint `{record.final_checkpoint}`\n\n"
        + report_markdown(
            "this run",
            page_link([record.run_id]),
            f"trainyard report {record.run_id} -o {record.run_id}.html",
        )
    )
