"""The torchrun worker entry point: parse, build, run, clean up. The loop lives elsewhere.

torchrun --standalone --nproc_per_node=2 --run-path --start-method=fork trainyard/engine/worker.py
    train --run-id ID --project-dir DIR
    predict --job predictions/ID/job.json --project-dir DIR
    serve --inbox DIR --project-dir DIR   (trainyard.runtime.persistent)
(`python -m trainyard.engine.worker ...` under torchrun's `-m` runs the same.) The agent
imports the engine before it forks the workers (`import_engine`; trainyard.runtime.forked).

Start-up is on every run's way to its first step, so the engine is imported inside `main`
with the garbage collector paused: collections during those imports cost ~0.5 s and free
nothing, since what the imports create lives as long as the process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.runtime.forked import run_as_process
from trainyard.runtime.guardian import exit_with_parent
from trainyard.util.logs import RANK_LOG, rank_log, setup_logging

if TYPE_CHECKING:  # imported in main, after the process has started (see above)
    from trainyard.dist import DistContext
    from trainyard.runs.record import RunRecord
    from trainyard.storage import Store

log = logging.getLogger("trainyard.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # Start-up cost: the record's module brings the store's client, imported only once
    # the arguments are read (`--help` stays quick).
    from trainyard.runs.record import check_run_id

    parser = argparse.ArgumentParser(prog="trainyard.worker")
    parser.add_argument("command", choices=["train", "evaluate", "predict", "serve"])
    parser.add_argument("--run-id", type=check_run_id, help="train, evaluate: the run")
    parser.add_argument("--project-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="evaluate: checkpoint URI")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--job", help="predict: the prediction job's key in the store")
    parser.add_argument("--inbox", type=Path, help="serve: the folder jobs are asked in")
    parser.add_argument("--device", default="auto", help="serve: the process group's device")
    parser.add_argument("--hang-timeout-s", type=float, default=600.0, help="serve")
    args = parser.parse_args(argv)
    needed = {"predict": "job", "serve": "inbox"}.get(args.command, "run_id")
    if getattr(args, needed) is None:
        parser.error(f"{args.command} needs --{needed.replace('_', '-')}")
    return args


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    exit_with_parent()  # no worker outlives its torchrun, even a SIGKILLed one
    setup_logging(int(os.environ.get("RANK", 0)))
    with _collector_paused():
        # Start-up cost: imported with the collector paused (see the module's docstring).
        from torch.distributed.elastic.multiprocessing.errors import record

        from trainyard.runtime.failures import FailureRecorder
    # record: writes this rank's traceback to torchrun's error file, so the launcher shows it,
    # with the failure's fingerprint, so torchrun's agent does not restart a repeat of it.
    entry = {"predict": run_predict, "serve": serve}.get(args.command, run_command)
    record(entry, error_handler=FailureRecorder())(args, started)


def run_command(args: argparse.Namespace, started: float) -> None:
    with _collector_paused():
        # Start-up cost: imported with the collector paused (see the module's docstring).
        from trainyard.dist import cleanup_distributed, init_distributed
        from trainyard.runs.record import load_record
        from trainyard.storage import Store, StoreSettings
    gc.freeze()  # what the imports made is never garbage: later collections skip it
    imported = time.monotonic()
    store = Store(StoreSettings.from_worker_env())
    record = load_record(store, args.run_id)
    train = record.config.train  # parsed here once, for the whole job
    ctx = init_distributed(train.device, timeout_s=train.hang_timeout_s)
    log.info(
        "worker up: start and imports %.2fs, run record and process group %.2fs",
        imported - started,
        time.monotonic() - imported,
    )
    try:
        run_job(ctx, args, store, record)
    finally:
        # Nothing is collected from here to exit. A collection in an exit handler (torch's
        # dynamo has one) freed DDP's reducer and with it the gloo process group, whose
        # destructor joins gloo's threads holding the GIL that one of them waited for: the
        # worker hung (seen once in a benchmark run). The interpreter's final collection
        # over torch's objects also took 1.4 s, which torchrun, then the flow, waited for.
        gc.disable()
        gc.freeze()
        cleanup_distributed()


def run_job(ctx: DistContext, args: argparse.Namespace, store: Store, record: RunRecord) -> None:
    """One `train` or `evaluate` command of `record`'s run, in a process group that is up."""
    with _collector_paused():
        # Start-up cost: imported with the collector paused (see the module's docstring).
        from trainyard.engine.jobs import evaluate_job, train_job
        from trainyard.project import ProjectPaths
    paths = ProjectPaths(args.project_dir.resolve())
    with rank_log(paths.run_logs(record.run_id), ctx.rank) as own:
        if args.command == "train" and ctx.is_main:
            # Each node's ranks write theirs under that node's project folder.
            named = (own.parent / RANK_LOG.format(rank="N")).relative_to(paths.root)
            log.info("each rank's lines: %s (`trainyard run --all-ranks` shows them here)", named)
        if args.command == "train":
            train_job(ctx, store, record, paths)
        else:
            evaluate_job(ctx, store, record, paths, args.checkpoint, args.split)


def serve(args: argparse.Namespace, started: float) -> None:
    """Stay up and run the jobs asked in `--inbox`, one after another, in one process group:
    a sweep's next trial (or a run whose workers were started while its flow prepared the
    data) pays no Python, torch or process-group start. See trainyard.runtime.persistent."""
    with _collector_paused():
        # Imported while no job waits: the engine, and torch._dynamo, which DDP's
        # constructor imports (about 1 s on the first job's way to its first step).
        import torch._dynamo  # noqa: F401

        from trainyard.dist import cleanup_distributed, init_distributed
        from trainyard.engine.jobs import train_job  # noqa: F401
        from trainyard.runs.record import load_record
        from trainyard.runtime.persistent import Inbox
        from trainyard.storage import Store, StoreSettings
    gc.freeze()
    imported = time.monotonic()
    store = Store(StoreSettings.from_worker_env())
    ctx = init_distributed(args.device, timeout_s=args.hang_timeout_s)
    log.info(
        "worker up: start and imports %.2fs, process group %.2fs; waiting for jobs",
        imported - started,
        time.monotonic() - imported,
    )
    inbox = Inbox(args.inbox)
    try:
        for request in inbox.requests():  # after a restart: the job that was running first
            job = parse_args(request.args)
            log.info("job %d: %s run %s", request.number, job.command, job.run_id)
            with request.environment():
                run_job(ctx, job, store, load_record(store, job.run_id))
            inbox.finished(request, is_main=ctx.is_main)
            gc.collect()  # the finished job's model and data; the process group lives on
    finally:
        gc.disable()  # as in run_command
        gc.freeze()
        cleanup_distributed()


def run_predict(args: argparse.Namespace, started: float) -> None:
    with _collector_paused():
        # Start-up cost: imported with the collector paused (see the module's docstring).
        from trainyard.dist import cleanup_distributed, init_distributed
        from trainyard.inference.documents import PredictionJob
        from trainyard.inference.job import predict_job
        from trainyard.project import ProjectPaths
        from trainyard.storage import Store, StoreSettings
    gc.freeze()
    store = Store(StoreSettings.from_worker_env())
    job = PredictionJob.model_validate(store.read_json(args.job))
    paths = ProjectPaths(args.project_dir.resolve())
    ctx = init_distributed(job.device)
    log.info("worker up in %.2fs: prediction %s", time.monotonic() - started, job.prediction_id)
    try:
        scratch = paths.staging / f"predict-{job.prediction_id}"
        predict_job(ctx, store, job, paths.root, scratch)
    finally:
        gc.disable()  # as in run_command
        gc.freeze()
        cleanup_distributed()


def import_engine() -> None:
    """What a training job's workers import on their way to the first step, imported by
    torchrun's agent before it forks them (trainyard.runtime.launch.torchrun), so that each
    starts with all of it (trainyard.runtime.forked)."""
    with _collector_paused():
        for name in ENGINE_MODULES:
            importlib.import_module(name)
    gc.freeze()


# main's and run_job's imports, and torch._dynamo, which DDP's constructor imports (~1 s).
ENGINE_MODULES = (
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing.errors",
    "trainyard.dist",
    "trainyard.engine.jobs",
    "trainyard.project",
    "trainyard.runs.record",
    "trainyard.runtime.failures",
    "trainyard.storage",
)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


if __name__ == "__main__":
    run_as_process(main)
