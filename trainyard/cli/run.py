"""`trainyard run` and `trainyard prepare`: training from the command line.

`run` plans the run (`trainyard.runs.plan`, and a multi-node run's own refusals,
`trainyard.cli.multi_node`) before it starts the store or the flow, then runs the
`training_pipeline` flow with that plan handed over (`trainyard.cli.session.run_flow`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.cli.console import capped, error_line
from trainyard.cli.multi_node import check_node_deployment, check_node_overrides
from trainyard.cli.options import add_all_ranks, add_overrides
from trainyard.cli.run_summary import print_summary
from trainyard.cli.session import run_flow
from trainyard.config import TrainyardConfig
from trainyard.errors import ConfigError, TrainyardError, WorkerFailed
from trainyard.project import ProjectPaths
from trainyard.util.documents import printable
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:
    from trainyard.runs.plan import RunPlan
    from trainyard.runs.record import RunRecord
    from trainyard.storage import Store

# A trainyard error that ended a worker, as its traceback's last line in torchrun's summary.
_WORKER_ERROR = re.compile(r"^\s*trainyard\.errors\.\w+Error: (.+)$", re.MULTILINE)


def add_run_command(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="run the training pipeline (Prefect flow training_pipeline)"
    )
    add_overrides(run, "override a params.yaml value, e.g. -S train.workers=1 (repeatable)")
    run.add_argument(
        "--run-id",
        help="id for the run (default: timestamp + random suffix); an existing run with "
        "committed checkpoints continues from its latest (checkpoint.resume=auto)",
    )
    run.add_argument(
        "--resume-from",
        metavar="RUN_ID",
        help="continue another run's latest committed checkpoint (same data and model)",
    )
    run.add_argument(
        "--warm-start",
        action="store_true",
        help="with --resume-from: load its weights only (fresh optimizer and schedule)",
    )
    run.add_argument(
        "--metrics-file",
        metavar="PATH",
        type=Path,
        help="also write the finished run's metrics (and the monitored value as `monitor`) "
        "to PATH as JSON; the dvc.yaml train stage writes metrics.json this way",
    )
    add_all_ranks(run)


def add_prepare_command(commands: argparse._SubParsersAction) -> None:
    prepare = commands.add_parser(
        "prepare",
        help="split the dataset into data/processed (the dvc.yaml stage)",
        description="dvc.yaml's prepare stage: it reads params.yaml alone, whose values DVC "
        "records in dvc.lock. `trainyard run` splits by itself, with -S settings too.",
    )
    add_overrides(prepare, help="refused: edit params.yaml, which DVC tracks")


def cmd_run(
    paths: ProjectPaths,
    config: TrainyardConfig,
    overrides: list[str],
    run_id: str | None,
    resume_from: str | None = None,
    warm_start: bool = False,
    metrics_file: Path | None = None,
) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import check_run_id, new_run_id
    from trainyard.storage import connect_shared

    if run_id:
        check_run_id(run_id)
    if warm_start and not resume_from:
        raise TrainyardError(
            "--warm-start needs --resume-from RUN_ID (the run to take weights from)"
        )
    if resume_from:
        check_run_id(resume_from)
    if metrics_file is not None:
        metrics_file = _metrics_target(paths, metrics_file)
    check_node_overrides(config, paths, overrides)
    if not run_id:  # checked before the store is started: bad input leaves no server behind
        plan = checked_plan(config, paths)
        check_node_deployment(plan.config, paths)
        store = connect_shared(config.storage, paths)  # the flow's tasks reuse it
    else:  # a named run may continue, with the settings in its record
        store = connect_shared(config.storage, paths)
        plan = checked_plan(_continued(store, config, run_id, overrides), paths)
        check_node_deployment(plan.config, paths)
    if run_id or resume_from:
        _check_resume(store, plan, paths, run_id, resume_from, warm_start)
    call = _pipeline_call(plan, overrides, run_id or new_run_id(), resume_from, warm_start)
    return _run_pipeline(paths, store, plan, call, metrics_file)


def checked_plan(config: TrainyardConfig, paths: ProjectPaths) -> RunPlan:
    """The run's settings checked against its data and the machine (trainyard.runs.plan)."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.plan import plan_run

    return plan_run(config, paths.root)


def _continued(
    store: Store, config: TrainyardConfig, run_id: str, overrides: list[str]
) -> TrainyardConfig:
    """A run id with a record continues that run: its own settings, not params.yaml's."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.continuation import changes, check_work_left, continued_config
    from trainyard.runs.lease import check_not_owned
    from trainyard.runs.record import find_record

    previous = find_record(store, run_id)
    if previous is None:
        return config
    check_not_owned(store, previous.run_id)
    storage = config.storage.model_dump(mode="json")
    config = continued_config(previous.run_id, previous.params, overrides, storage)
    check_work_left(previous, changes(previous.run_id, previous.params, config))
    return config


def _check_resume(
    store: Store,
    plan: RunPlan,
    paths: ProjectPaths,
    run_id: str | None,
    resume_from: str | None,
    warm_start: bool,
) -> None:
    """The flow checks this again, after the split; here a checkpoint that does not fit is
    refused in one line, before Prefect starts (and logs the failure its own way)."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.checkpoint.resume import plan_resume, resume_meta
    from trainyard.storage.versioning import content_md5

    config = plan.config
    dataset_md5 = content_md5(paths.root / config.data.path)
    meta = resume_meta(config, plan.report.spec, dataset_md5, config.train.world_size)
    plan_resume(store, run_id, meta, config.checkpoint.resume, resume_from, warm_start)


def _run_pipeline(
    paths: ProjectPaths,
    store: Store,
    plan: RunPlan,
    call: PipelineCall,
    metrics_file: Path | None = None,
) -> int:
    """The flow, under a guardian (nothing outlives this command) and with interruptions
    (Ctrl-C, SIGTERM) ending in one line that says how to continue."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.cli.interrupts import interrupted_line
    from trainyard.cli.terminal import run_progress
    from trainyard.runs.live_files import live_path
    from trainyard.runtime.persistent import persistent_workers, prestart_training

    config, run_id = plan.config, call.run_id
    try:
        record, returned_at = run_flow(
            paths,
            call.load,
            interrupted=lambda: interrupted_line(store, paths, run_id),
            progress=lambda: run_progress(live_path(paths.staging, run_id), run_id),
            checkpoint=config.checkpoint,
            workers=persistent_workers(),
            # The training workers start now, while Prefect is imported and the flow run
            # set up: the flow finds them idle, and their start is off the way to the
            # first step.
            prestart=lambda: prestart_training(
                paths.root, config.train, store.settings.worker_env()
            ),
        )
    except WorkerFailed as exc:
        refusal = worker_refusal(exc)
        if refusal is not None:
            print(error_line(TrainyardError(refusal)), file=sys.stderr)
            return 2
        print(_failure_line(exc, store, run_id), file=sys.stderr)  # the traceback: in its logs
        return 1
    if metrics_file is not None:
        _write_metrics_file(metrics_file, record)
    # Once the workers have stopped: `completed in` is the command's time, all of it.
    print_summary(record, store, paths, returned_at)
    return 0


@dataclass(frozen=True)
class PipelineCall:
    """The training flow's call: its run id, and `load`, which imports the flow (and
    Prefect) and returns the call itself."""

    run_id: str
    load: Callable[[], Callable[[], tuple[RunRecord, float]]]


def _pipeline_call(
    plan: RunPlan, overrides: list[str], run_id: str, resume_from: str | None, warm_start: bool
) -> PipelineCall:
    """The training flow's call with the plan handed over: the flow run's parameters show
    the command's -S list, and the flow trains with the very settings planned here."""

    def load() -> Callable[[], tuple[RunRecord, float]]:
        from flows.pipeline import training_pipeline  # Prefect is imported only here
        from trainyard.runs.plan import handed_over  # with the flow (start-up cost)

        def call() -> tuple[RunRecord, float]:
            with handed_over(plan, overrides):  # the flow takes this plan, unchecked again
                record = training_pipeline(
                    overrides=overrides,
                    run_id=run_id,
                    resume_from=resume_from,
                    warm_start=warm_start,
                )
            return record, time.time()  # before the workers stop

        return call

    return PipelineCall(run_id, load)


def worker_refusal(exc: BaseException) -> str | None:
    """The message of a trainyard error that ended the workers (a full staging disk, a
    checkpoint this project did not sign): the user's to fix, so one line, as on the host."""
    found = _WORKER_ERROR.findall(str(exc)) if isinstance(exc, WorkerFailed) else []
    return found[-1] if found else None


def _failure_line(exc: WorkerFailed, store: Store, run_id: str) -> str:
    """`trainyard: run ID failed: rank 1: RuntimeError: ... (traceback: FILE)`, one line."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import find_record

    record = find_record(store, run_id)
    where = f" (traceback: {record.error_file})" if record and record.error_file else ""
    what = exc.repeated or exc.line()  # repeated: what torchrun's agent said when it stopped
    return capped(printable(" ".join(f"trainyard: run {run_id} failed: {what}".split()))) + where


def _metrics_target(paths: ProjectPaths, path: Path) -> Path:
    """Where --metrics-file goes, checked before anything is launched: a run that trains
    for an hour must not fail at its last write."""
    target = paths.root / path
    if target.is_dir():
        raise TrainyardError(f"--metrics-file {path}: is a folder; name a file, e.g. metrics.json")
    if not target.parent.is_dir():
        raise TrainyardError(
            f"--metrics-file {path}: folder {target.parent} does not exist; create it first"
        )
    return target


def _write_metrics_file(path: Path, record: RunRecord) -> None:
    """The run's metrics and the monitored value, as DVC metrics. Written to a temporary
    file and renamed, so a reader (`dvc metrics show`) never sees half a file."""
    assert record.monitor is not None  # a completed run has one
    metrics = {**record.metrics, "monitor": record.monitor["value"]}
    write_text_atomic(path, json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def cmd_prepare(paths: ProjectPaths, config: TrainyardConfig, overrides: list[str]) -> int:
    if overrides:  # data/processed would not be what dvc.lock says params.yaml made
        raise ConfigError(
            f"-S {overrides[0]!r}: `trainyard prepare` is dvc.yaml's stage and reads "
            "params.yaml alone, which DVC tracks; edit params.yaml and `dvc repro`, or "
            "`trainyard run -S ...`, which splits by itself"
        )
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.data.split import prepare_splits
    from trainyard.objectives import target_kind

    target = target_kind(config.task.name)
    schema = prepare_splits(
        config.data, config.split, paths.root / config.data.path, paths.processed, target
    )
    print(f"wrote {paths.processed.relative_to(paths.root)}: {schema.rows}")
    return 0
