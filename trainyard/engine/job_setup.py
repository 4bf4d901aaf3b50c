"""What a training job builds before its loop, from the run's record: the tracker, the
checkpoint writers, the checkpoint to resume from, a sweep trial's pruner, the live status,
the interrupt request, and from them every hook the loop calls (`JobParts.loop_hooks`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.checkpoint.reader import fetch_files, latest_committed, load_checkpoint
from trainyard.checkpoint.resume import check_compatible, checkpoint_meta
from trainyard.checkpoint.world_change import change_text, plan_world_change, same_world
from trainyard.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from trainyard.data.split import SplitSchema
from trainyard.dist import DistContext, all_gather_objects
from trainyard.engine.hooks import CheckpointHook, Hook, ProgressHook
from trainyard.engine.interrupt_checkpoint import StopRequest, stop_request
from trainyard.engine.live import LiveHook
from trainyard.engine.loop_hooks import LoopHooks
from trainyard.engine.tracking import Tracker, start_tracker
from trainyard.engine.train_state import Resume
from trainyard.objectives import Objective, best_by, monitored
from trainyard.project import ProjectPaths
from trainyard.runs.continuation import flatten
from trainyard.runs.contracts import CheckpointManifest
from trainyard.runs.lease import LEASE_TOKEN_ENV
from trainyard.runs.live_files import live_path
from trainyard.runs.record import RunRecord
from trainyard.runtime.hosts import gather_hosts
from trainyard.runtime.progress import AttemptLog, NullAttemptLog, Watchdog
from trainyard.storage import Store
from trainyard.util.attempts import attempt_number

if TYPE_CHECKING:  # optuna is imported by sweep trials only, DCP by FSDP jobs only
    from trainyard.checkpoint.sharded import ShardStager
    from trainyard.engine.pruning import PruningHook

log = logging.getLogger(__name__)

Writers = tuple[CheckpointWriter | NullCheckpointWriter, "ShardStager | None"]


@dataclass
class JobParts:
    """A training job's parts, built in the order the job has always built them."""

    tracker: Tracker
    writers: Writers
    attempt: int  # torchrun's restarts of the worker group (and a lost agent's relaunches)
    attempts: AttemptLog | NullAttemptLog
    meta: dict[str, Any]  # what each checkpoint's manifest says about the run
    resume: Resume | None
    resumed_from: str | None
    pruner: PruningHook | None
    live: Hook
    stop: StopRequest | None

    @classmethod
    def build(
        cls,
        ctx: DistContext,
        store: Store,
        record: RunRecord,
        paths: ProjectPaths,
        schema: SplitSchema,
        objective: Objective,
    ) -> JobParts:
        run_id, config = record.run_id, record.config
        # torchrun counts restarts of the whole worker group; each restart resumes.
        attempt = attempt_number()  # and so does a lost agent's relaunch
        this_round = gather_hosts(ctx, attempt, paths.staging / run_id)  # each rank's host
        tracker = start_tracking(ctx, record, paths)
        writers = checkpoint_writers(ctx, store, record, objective, paths)
        regrouped = bool(this_round.get("regrouped"))  # rank 0's, whose log this is
        launch_began = attempt == 0 and not regrouped
        attempts: AttemptLog | NullAttemptLog = (
            AttemptLog(paths.staging / run_id, launch_began) if ctx.is_main else NullAttemptLog()
        )
        meta = checkpoint_meta(record, schema, ctx.world_size)
        resume, resumed_from = resume_point(ctx, store, record, meta, attempt, paths)
        if resume is not None and not resume.warm_start:
            assert resumed_from is not None  # a resume always names its checkpoint
            world = resume.change.details if resume.change else same_world(ctx.world_size)
            attempts.resumed(attempt, resume.state["step"], resumed_from, regrouped, **world)
            if resume.change:  # its checkpoints keep the global batch it goes on with
                meta["global_batch_size"] = resume.change.geometry.global_batch_size
        pruner = sweep_pruner(ctx, record, objective, paths)
        live = live_status(ctx, record, objective, paths)
        stop = stop_request(config, ctx.world_size)
        return cls(
            tracker, writers, attempt, attempts, meta, resume, resumed_from, pruner, live, stop
        )

    def loop_hooks(self, ctx: DistContext, record: RunRecord, watchdog: Watchdog) -> LoopHooks:
        """Every hook the loop calls: progress beats `watchdog` and counts the steps for a
        restart's report; a sweep's pruner and the live status come before the checkpoints."""

        def on_step(step: int) -> None:
            watchdog.beat()
            self.attempts.step(step)

        config = record.config
        checkpointer, shard_stager = self.writers
        checkpoints = CheckpointHook(
            config.checkpoint,
            config.train.epochs,
            checkpointer,
            self.meta,
            shard_stager,
            ctx,
            self.stop,
        )
        between = [ProgressHook(on_step), *([self.pruner] if self.pruner else []), self.live]
        return LoopHooks.build(ctx, config, self.tracker, checkpoints, between)

    def report(self) -> dict[str, Any]:
        """What a TrainingResult says about restarts, resumes and pruning."""
        resumes = self.attempts.resumes
        return {
            "restarts": self.attempt,
            "resumed_from": self.resumed_from,
            "warm_start": bool(self.resume and self.resume.warm_start),
            "resumes": resumes,
            "steps_redone": sum(e["steps_redone"] for e in resumes),
            # The launch's first: a restart's own would count the attempts before as start-up.
            "first_step_at": self.attempts.first_step_at,
            "pruned_at_epoch": self.pruner.pruned_at_epoch if self.pruner else None,
            "layout": self.meta["layout"],
        }


def live_status(
    ctx: DistContext, record: RunRecord, objective: Objective, paths: ProjectPaths
) -> Hook:
    """Rank 0 keeps the status the CLI's progress bar shows; other ranks do nothing."""
    if not ctx.is_main:
        return Hook()
    config = record.config
    monitor = monitored(config.task, objective)
    path = live_path(paths.staging, record.run_id)
    return LiveHook(path, record.run_id, config.train.epochs, ctx.data_size, monitor)


def start_tracking(ctx: DistContext, record: RunRecord, paths: ProjectPaths) -> Tracker:
    """This rank's experiment, tagged and grouped with the rest of its run (or sweep), and
    told what it trains on: the dataset version and the code."""
    group = f"sweep:{record.sweep.sweep_id}" if record.sweep else record.group
    tags = [group] if group else []
    group = group or f"run:{record.run_id}"
    tracker = start_tracker(
        record.config.tracking, record.run_id, ctx.rank, paths.comet / record.run_id, tags
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


def sweep_pruner(
    ctx: DistContext, record: RunRecord, objective: Objective, paths: ProjectPaths
) -> PruningHook | None:
    """A sweep trial's pruner; rank 0 alone talks to the study."""
    if record.sweep is None:
        return None
    # Imported here: optuna takes most of a second, which only a sweep's trial pays.
    from trainyard.engine.pruning import PruningHook
    from trainyard.sweeps.study import load_trial, storage_url

    config = record.config
    trial, reported = None, set[int]()
    if ctx.is_main:
        url = storage_url(config.sweep, paths, record.sweep.sweep_id)
        trial, reported = load_trial(
            url, record.sweep.study_name, record.sweep.trial, config.sweep, config.train.epochs
        )
    metric = "val_" + monitored(config.task, objective)
    return PruningHook(ctx, trial, metric, reported, config.train.epochs)


def checkpoint_writers(
    ctx: DistContext, store: Store, record: RunRecord, objective: Objective, paths: ProjectPaths
) -> Writers:
    """Rank 0 commits (while the run's lease is this job's, keeping the best by the task's
    metric); with fsdp every rank also uploads its own shards."""
    config = record.config
    writer = (
        CheckpointWriter(
            store,
            record.run_id,
            paths.staging,
            config.checkpoint,
            os.environ.get(LEASE_TOKEN_ENV),
            best_by(config.checkpoint.keep_best_by, config.task, objective),
        )
        if ctx.is_main
        else NullCheckpointWriter()
    )
    if not config.train.sharded_checkpoints:
        return writer, None
    # Imported here: DCP takes most of a second, which only an FSDP job pays.
    from trainyard.checkpoint.sharded import ShardStager

    stager = ShardStager(
        store, record.run_id, paths.staging, config.checkpoint, ctx.rank, writer.staged_steps
    )
    return writer, stager


def resume_point(
    ctx: DistContext,
    store: Store,
    record: RunRecord,
    meta: dict[str, Any],
    attempt: int,
    paths: ProjectPaths,
) -> tuple[Resume | None, str | None]:
    """Rank 0 picks the checkpoint (this run's latest, else the one the flow planned), every
    rank loads and verifies that same one; at another world size than the checkpoint's, a
    full resume keeps its global batch and position (trainyard.checkpoint.world_change)."""
    choice: tuple[str, bool] | None = None
    if ctx.is_main:
        own = None
        # After a restart this run's own checkpoints always win, whatever checkpoint.resume says.
        if record.config.checkpoint.resume == "auto" or attempt > 0:
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
    rows = meta["schema"]["rows"]["train"]
    train = record.config.train
    change = None if warm_start else plan_world_change(manifest, ctx.data_size, train, rows)
    if change is not None and ctx.is_main:  # a console line; a warning when not exact
        log.log(logging.INFO if change.exact else logging.WARNING, change_text(change))
    return Resume(state, warm_start, shards, change), uri


def _fetch_shards(
    store: Store,
    uri: str,
    manifest: CheckpointManifest,
    paths: ProjectPaths,
    run_id: str,
    rank: int,
) -> Path | None:
    """A sharded checkpoint's files, verified, in a folder private to this rank."""
    if not manifest.sharded:
        return None
    dest = paths.staging / run_id / f"restore-rank{rank}" / f"step-{manifest.step:08d}"
    return fetch_files(store, uri, manifest, dest)
