"""What a torchrun worker does for each command, built from the run record in the store.

Results go back to the flow through the store (`runs/<id>/training.json`,
`runs/<id>/evaluation.json`), which works the same when workers span machines. The training
job also scores the test split with its final weights, so a run is one torchrun launch;
`evaluate` scores any checkpoint on any split.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from trainyard.checkpoint.layout import checkpoint_key, step_of
from trainyard.checkpoint.loading import load_model
from trainyard.checkpoint.reader import fetch_files, latest_committed, load_checkpoint
from trainyard.checkpoint.resume import check_compatible, checkpoint_meta
from trainyard.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from trainyard.config import TrainyardConfig, config_from_dict
from trainyard.data.split import SCHEMA_FILE, SplitSchema
from trainyard.data.tensors import open_split
from trainyard.dist import DistContext, all_gather_objects
from trainyard.engine.hooks import Hook
from trainyard.engine.interrupt_checkpoint import StopTraining, keep_interrupted_work, stop_request
from trainyard.engine.live import LiveHook, live_path
from trainyard.engine.tracking import ExperimentRef, Tracker, start_tracker
from trainyard.errors import DataError
from trainyard.objectives import Objective, best_by, monitored, objective_for
from trainyard.project import ProjectPaths
from trainyard.runs.continuation import flatten
from trainyard.runs.contracts import CheckpointManifest, EvaluationResult, TrainingResult
from trainyard.runs.lease import LEASE_TOKEN_ENV
from trainyard.runs.record import RunRecord
from trainyard.runtime.progress import (
    AttemptLog,
    NullAttemptLog,
    Watchdog,
    attempt_number,
    peak_rss_mb,
)
from trainyard.storage import Store

if TYPE_CHECKING:  # optuna is imported by sweep trials only, DCP by FSDP jobs only
    from trainyard.checkpoint.sharded import ShardStager
    from trainyard.sweeps.pruning import PruningHook
from trainyard.engine.training import Resume, Split, TrainOutcome, evaluate_split, train

log = logging.getLogger(__name__)


def training_key(run_id: str) -> str:
    return f"runs/{run_id}/training.json"


def evaluation_key(run_id: str) -> str:
    return f"runs/{run_id}/evaluation.json"


def train_job(ctx: DistContext, store: Store, record: RunRecord, paths: ProjectPaths) -> None:
    started = time.monotonic()
    run_id = record.run_id
    config = config_from_dict(record.params)
    folder = split_folder(record, paths)
    schema = SplitSchema.read(folder)
    train_split = open_split(folder, "train", schema, paths.root)
    val_split = open_split(folder, "val", schema, paths.root)
    objective = objective_for(config.task, schema)
    # torchrun counts restarts of the whole worker group; each restart resumes.
    attempt = attempt_number()  # and so does a lost agent's relaunch

    tracker = _start_tracking(ctx, record, config, paths)
    checkpointer, shard_stager = _checkpoint_writers(ctx, store, run_id, config, objective, paths)
    writers = (checkpointer, shard_stager)
    attempts = AttemptLog(paths.staging / run_id) if ctx.is_main else NullAttemptLog()
    dataset_md5 = record.dataset.dvc_md5 if record.dataset else None
    meta = checkpoint_meta(run_id, record.params, schema, dataset_md5, ctx.world_size)
    resume, resumed_from = _resume_point(ctx, store, record, config, meta, attempt, paths)
    if resume is not None and not resume.warm_start:
        attempts.resumed(attempt, resume.state["step"], resumed_from)

    pruner = _sweep_pruner(ctx, record, config, objective, paths)
    live = _live_status(ctx, config, objective, paths, run_id)
    stop = stop_request(config, ctx.world_size)

    def on_step(step: int) -> None:
        watchdog.beat()
        attempts.step(step)

    try:
        with Watchdog(config.train.hang_timeout_s, ctx.rank) as watchdog:
            outcome = train(
                ctx,
                config,
                train_split,
                val_split,
                objective,
                tracker,
                checkpointer,
                meta,
                resume=resume,
                on_step=on_step,
                shard_stager=shard_stager,
                extra_hooks=[pruner, live] if pruner else [live],
                data=schema.spec,
                stop=stop,
            )
            if stop is not None:
                stop.training_over(outcome.steps)
            scored = _score_test(
                ctx, outcome.model, open_split(folder, "test", schema, paths.root), objective
            )
            _track_outcome(tracker, store, run_id, outcome, scored[0], objective)
    except StopTraining as interrupted:
        assert stop is not None
        keep_interrupted_work(ctx.is_main, writers, stop, interrupted.step, paths.staging / run_id)
    finally:
        experiment = tracker.end()
    report = _resume_report(attempt, resume, resumed_from, attempts)
    report["pruned_at_epoch"] = pruner.pruned_at_epoch if pruner else None
    _finish(ctx, store, run_id, outcome, experiment, writers, report, started, scored)


def _live_status(
    ctx: DistContext,
    config: TrainyardConfig,
    objective: Objective,
    paths: ProjectPaths,
    run_id: str,
) -> Hook:
    """Rank 0 keeps the status the CLI's progress bar shows; other ranks do nothing."""
    if not ctx.is_main:
        return Hook()
    monitor = monitored(config.task, objective)
    path = live_path(paths.staging, run_id)
    return LiveHook(path, run_id, config.train.epochs, ctx.world_size, monitor)


def _start_tracking(
    ctx: DistContext, record: RunRecord, config: TrainyardConfig, paths: ProjectPaths
) -> Tracker:
    """This rank's experiment, tagged and grouped with the rest of its run (or sweep), and
    told what it trains on: the dataset version and the code."""
    group = f"sweep:{record.sweep.sweep_id}" if record.sweep else record.group
    tags = [group] if group else []
    group = group or f"run:{record.run_id}"
    tracker = start_tracker(
        config.tracking, record.run_id, ctx.rank, paths.comet / record.run_id, tags
    )
    tracker.log_params(
        {**flatten(record.params, whole=()), "world_size": ctx.world_size, "rank": ctx.rank}
    )
    others = {
        "group": group,
        "dataset_md5": record.dataset.dvc_md5 if record.dataset else None,
        "dataset_path": record.dataset.path if record.dataset else None,
        "code_commit": record.code.get("git_commit"),
        "code_dirty": record.code.get("git_dirty"),
    }
    if record.sweep:
        others |= {"sweep_id": record.sweep.sweep_id, "sweep_trial": record.sweep.trial}
    tracker.log_others({k: v for k, v in others.items() if v is not None})
    return tracker


def _track_outcome(
    tracker: Tracker,
    store: Store,
    run_id: str,
    outcome: TrainOutcome,
    scores: dict[str, float],
    objective: Objective,
) -> None:
    """What every rank's experiment learns at the end: the test metrics (exact, all-reduced),
    the checkpoints taken (their URIs; retention may delete older ones) and the stragglers."""
    tracker.log_metrics({f"test_{k}": scores[k] for k in objective.metrics}, step=outcome.steps)
    # One value per key: Comet cuts a logged value at about 1,000 characters.
    others = {
        f"checkpoint/step-{step:08d}": store.uri(checkpoint_key(run_id, step))
        for step in outcome.checkpoint_steps
    }
    ranks = sorted({found.rank for found in outcome.stragglers})
    others["straggler_ranks"] = ",".join(map(str, ranks)) or "none"
    for episode, found in enumerate(outcome.stragglers):  # a rank may be slow more than once
        others[f"straggler/{episode}/rank{found.rank}"] = (
            f"steps {found.first_step}-{found.last_step}: {found.slowdown:.2f}x the other "
            f"ranks' median step ({found.median_step_ms:.1f} ms vs {found.ranks_median_step_ms:.1f} ms)"
        )
    tracker.log_others(others)


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


def _finish(
    ctx: DistContext,
    store: Store,
    run_id: str,
    outcome: TrainOutcome,
    experiment: ExperimentRef,
    writers: tuple[CheckpointWriter | NullCheckpointWriter, ShardStager | None],
    report: dict,
    started: float,
    scored: tuple[dict[str, float], float],
) -> None:
    """Gather what every rank reports, drain the uploads, and (rank 0) write the result."""
    mine = {
        "experiments": dataclasses.asdict(experiment),
        "samples_per_s_per_rank": outcome.samples_per_s,
        "peak_rss_mb_per_rank": peak_rss_mb(),
        "worker_pids": os.getpid(),
    }
    ranks = all_gather_objects(mine)  # once, before the uploads drain, while ranks are in step
    gathered = {key: [rank[key] for rank in ranks] for key in mine}
    # Every rank waits for its last uploads (checkpoint.upload_timeout_s): ranks > 0 for
    # their shards, rank 0 for the commits, which need those shards.
    checkpointer, shard_stager = writers
    if shard_stager is not None:
        shard_stager.close()
    checkpointer.close()
    if not ctx.is_main:
        return
    # A resume from the final checkpoint has nothing left to train or save.
    final = checkpointer.committed[-1] if checkpointer.committed else report["resumed_from"]
    evaluation = _evaluation(final, outcome.steps, *scored)
    if evaluation is not None:
        store.write_json(evaluation_key(run_id), evaluation.model_dump(mode="json"))
    result = TrainingResult(
        world_size=ctx.world_size,
        device=str(ctx.device),
        backend=ctx.backend,
        steps=outcome.steps,
        history=outcome.history,
        checkpoints=checkpointer.committed,
        final_checkpoint=final,
        first_step_at=outcome.first_step_at,
        seconds=time.monotonic() - started,
        evaluation=evaluation,
        stragglers=outcome.stragglers,  # every rank reached the same verdicts
        rank_lanes=outcome.rank_lanes,
        skipped_checkpoint_epochs=outcome.skipped_checkpoint_epochs,
        **report,
        **gathered,
    )
    store.write_json(training_key(run_id), result.model_dump(mode="json"))
    log.info("training finished: %d steps, final checkpoint %s", outcome.steps, final)


def _evaluation(
    final: str | None, steps: int, scores: dict[str, float], seconds: float
) -> EvaluationResult | None:
    """The in-job test scores as the final checkpoint's, if that checkpoint holds the weights
    they were computed with (it was taken at the last step, not dropped while uploads lag)."""
    if final is None or step_of(final) != steps:
        return None
    metrics = {name: value for name, value in scores.items() if name != "rows"}
    rows = int(scores["rows"])
    return EvaluationResult(
        split="test", checkpoint=final, rows=rows, metrics=metrics, seconds=seconds
    )


def _resume_report(
    attempt: int, resume: Resume | None, resumed_from: str | None, attempts: AttemptLog
) -> dict:
    """What a TrainingResult says about restarts and resumes."""
    return {
        "restarts": attempt,
        "resumed_from": resumed_from,
        "warm_start": bool(resume and resume.warm_start),
        "resumes": attempts.resumes,
        "steps_redone": sum(e["steps_redone"] for e in attempts.resumes),
    }


def _sweep_pruner(
    ctx: DistContext,
    record: RunRecord,
    config: TrainyardConfig,
    objective: Objective,
    paths: ProjectPaths,
) -> PruningHook | None:
    """A sweep trial's pruner; rank 0 alone talks to the study."""
    if record.sweep is None:
        return None
    from trainyard.sweeps.pruning import PruningHook
    from trainyard.sweeps.study import load_trial, storage_url

    trial, reported = None, set()
    if ctx.is_main:
        url = storage_url(config.sweep, paths, record.sweep.sweep_id)
        trial, reported = load_trial(
            url, record.sweep.study_name, record.sweep.trial, config.sweep, config.train.epochs
        )
    metric = "val_" + monitored(config.task, objective)
    return PruningHook(ctx, trial, metric, reported, config.train.epochs)


def _checkpoint_writers(
    ctx: DistContext,
    store: Store,
    run_id: str,
    config: TrainyardConfig,
    objective: Objective,
    paths: ProjectPaths,
) -> tuple[CheckpointWriter | NullCheckpointWriter, ShardStager | None]:
    """Rank 0 commits (while the run's lease is this job's, keeping the best by the task's
    metric); with fsdp every rank also uploads its own shards."""
    writer = (
        CheckpointWriter(
            store,
            run_id,
            paths.staging,
            config.checkpoint,
            os.environ.get(LEASE_TOKEN_ENV),
            best_by(config.checkpoint.keep_best_by, config.task, objective),
        )
        if ctx.is_main
        else NullCheckpointWriter()
    )
    if config.train.strategy != "fsdp":
        return writer, None
    from trainyard.checkpoint.sharded import ShardStager

    stager = ShardStager(
        store, run_id, paths.staging, config.checkpoint, ctx.rank, writer.staged_steps
    )
    return writer, stager


def _resume_point(
    ctx: DistContext,
    store: Store,
    record: RunRecord,
    config: TrainyardConfig,
    meta: dict,
    attempt: int,
    paths: ProjectPaths,
) -> tuple[Resume | None, str | None]:
    """Rank 0 picks the checkpoint (this run's latest, else the one the flow planned), every
    rank loads and verifies that same one."""
    choice: tuple[str, bool] | None = None
    if ctx.is_main:
        own = None
        # After a restart this run's own checkpoints always win, whatever checkpoint.resume says.
        if config.checkpoint.resume == "auto" or attempt > 0:
            own = latest_committed(store, record.run_id)
        if own is not None:
            choice = (own[0], False)
        elif record.resume_checkpoint:
            choice = (record.resume_checkpoint, record.warm_start)
    choice = all_gather_objects(choice)[0]
    if choice is None:
        return None, None
    uri, warm_start = choice
    state, manifest = load_checkpoint(store, uri)
    check_compatible(manifest, meta, full=not warm_start)
    shards = _fetch_shards(store, uri, manifest, paths, record.run_id, ctx.rank)
    log.info("%s from %s (attempt %d)", "warm start" if warm_start else "resuming", uri, attempt)
    return Resume(state, warm_start, shards), uri


def _fetch_shards(
    store: Store,
    uri: str,
    manifest: CheckpointManifest,
    paths: ProjectPaths,
    run_id: str,
    rank: int,
) -> Path | None:
    """A sharded checkpoint's files, verified, in a folder private to this rank."""
    if manifest.strategy != "fsdp":
        return None
    dest = paths.staging / run_id / f"restore-rank{rank}" / f"step-{manifest.step:08d}"
    return fetch_files(store, uri, manifest, dest)


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
    objective = objective_for(config_from_dict(record.params).task, loaded.schema)
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
