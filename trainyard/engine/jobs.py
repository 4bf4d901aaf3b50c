"""What a torchrun worker does for each command, built from the run record in the store.

Results go back to the flow through the store (`runs/<id>/training.json`,
`runs/<id>/evaluation.json`), which works the same when workers span machines. The training
job also scores the test split with its final weights, so a run is one torchrun launch;
`evaluate` scores any checkpoint on any split.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from torch import nn

from trainyard.checkpoint.loading import load_model
from trainyard.data.split import SCHEMA_FILE, SplitSchema
from trainyard.data.tensors import open_split
from trainyard.dist import DistContext
from trainyard.engine.interrupt_checkpoint import StopTraining, keep_interrupted_work
from trainyard.engine.job_results import finish, track_outcome
from trainyard.engine.job_setup import JobParts
from trainyard.engine.train_state import TrainState
from trainyard.engine.training import Split, Splits, evaluate_split, train
from trainyard.errors import DataError
from trainyard.objectives import Objective, objective_for
from trainyard.project import ProjectPaths
from trainyard.runs.contracts import EvaluationResult, evaluation_key, training_key
from trainyard.runs.record import RunRecord
from trainyard.runtime.progress import Watchdog
from trainyard.storage import Store

__all__ = ["evaluate_job", "evaluation_key", "split_folder", "train_job", "training_key"]

log = logging.getLogger(__name__)


def train_job(ctx: DistContext, store: Store, record: RunRecord, paths: ProjectPaths) -> None:
    """Train the run's model on its split (resuming where it should), score the test split
    with the final weights and hand the result back; every hook is built here."""
    started = time.monotonic()
    run_id, config = record.run_id, record.config
    ctx = replace(ctx, model_workers=config.train.parallel.model_workers)
    folder = split_folder(record, paths)
    schema = SplitSchema.read(folder)
    train_split = open_split(folder, "train", schema, paths.root)
    val_split = open_split(folder, "val", schema, paths.root)
    objective = objective_for(config.task, schema)
    job = JobParts.build(ctx, store, record, paths, schema, objective)
    try:
        with Watchdog(config.train.hang_timeout_s, ctx.rank) as watchdog:
            splits = Splits.prepared(ctx, config, train_split, val_split)
            state = TrainState.build(ctx, config, len(splits.train), schema.spec, job.resume)
            outcome = train(state, splits, objective, job.loop_hooks(ctx, record, watchdog))
            if job.stop is not None:
                job.stop.training_over(outcome.steps)
            test_split = open_split(folder, "test", schema, paths.root)
            scored = _score_test(ctx, outcome.model, test_split, objective)
            track_outcome(job.tracker, store, run_id, outcome, scored[0], objective)
    except StopTraining as interrupted:
        assert job.stop is not None
        staged = paths.staging / run_id
        keep_interrupted_work(ctx.is_main, job.writers, job.stop, interrupted.step, staged)
    finally:
        experiment = job.tracker.end()
    finish(ctx, store, run_id, outcome, experiment, job.writers, job.report(), started, scored)


def _score_test(
    ctx: DistContext, model: nn.Module, test_split: Split, objective: Objective
) -> tuple[dict[str, float], float]:
    """(the test split's metrics and rows, seconds) with the weights training ended on: in
    this job, so a run needs no second torchrun launch to score its final checkpoint."""
    clock = time.monotonic()
    scores = evaluate_split(model, test_split, ctx, objective)
    log.info("test %s over %d rows", _scores_text(scores, objective), scores["rows"])
    return scores, time.monotonic() - clock


def _scores_text(scores: dict[str, float], objective: Objective) -> str:
    return "  ".join(f"{name} {scores[name]:.4f}" for name in objective.metrics)


def split_folder(record: RunRecord, paths: ProjectPaths) -> Path:
    """The folder holding the split this run's flow prepared: its own cached one, or
    data/processed for records written before runs had their own."""
    key = record.dataset.split_key if record.dataset else None
    if key is None:
        return paths.processed
    folder = paths.split_cache(key)
    if not (folder / SCHEMA_FILE).is_file():
        raise DataError(
            f"run {record.run_id}: its split {key} is not on this machine ({folder}); node 0's "
            "`trainyard run` prepares it there, `trainyard join` on the other nodes, from the "
            "same dataset file and split settings"
        )
    return folder


def evaluate_job(
    ctx: DistContext,
    store: Store,
    record: RunRecord,
    paths: ProjectPaths,
    checkpoint: str,
    split: str,
) -> None:
    clock = time.monotonic()
    run_id = record.run_id
    loaded = load_model(store, checkpoint, paths.staging / run_id, ctx.rank)
    model = loaded.model.to(ctx.device)
    data = open_split(split_folder(record, paths), split, loaded.schema, paths.root)
    objective = objective_for(record.config.task, loaded.schema)
    result = evaluate_split(model, data, ctx, objective)
    log.info(
        "%s %s over %d rows (%s)",
        split,
        _scores_text(result, objective),
        result["rows"],
        checkpoint,
    )
    if ctx.is_main:
        rows = int(result.pop("rows"))
        scored = EvaluationResult(
            split=split,
            checkpoint=checkpoint,
            rows=rows,
            metrics=result,
            seconds=time.monotonic() - clock,
        )
        store.write_json(evaluation_key(run_id), scored.model_dump(mode="json"))
