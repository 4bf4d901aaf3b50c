"""The data-parallel training loop and the exact, sharded evaluation it uses."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainyard.checkpoint import CheckpointWriter, NullCheckpointWriter, strip_wrapper_prefixes
from trainyard.config import TrainyardConfig
from trainyard.data.sharding import ShardedBatches
from trainyard.data.tensors import TensorSplit
from trainyard.dist import DistContext, all_gather_objects, all_reduce_sum
from trainyard.meter import StepMeter
from trainyard.models import build_model
from trainyard.objectives import Classification, Objective
from trainyard.parallel import unwrap, wrap_model
from trainyard.resume import capture_rng, restore_rng
from trainyard.sharded import ShardStager, load_shards
from trainyard.tracking import Tracker

log = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0  # global step reached (counting steps done before a resume)
    samples_per_s: float = 0.0  # this rank's mean over the steps this process ran
    resumed_step: int | None = None  # the checkpoint step this process continued from
    first_step_at: float | None = None  # wall-clock time the first update finished


@dataclass(frozen=True)
class Resume:
    """A verified checkpoint state to start from; `warm_start` takes its weights only.
    A sharded checkpoint's model and optimizer are in the verified files in `shards`."""

    state: dict[str, Any]
    warm_start: bool = False
    shards: Path | None = None


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear warm-up (large global batches need it), then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, config: TrainyardConfig) -> torch.optim.Optimizer:
    cfg = config.train
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=config.scaled_lr, weight_decay=cfg.weight_decay
        )
    return torch.optim.SGD(
        model.parameters(),
        lr=config.scaled_lr,
        momentum=cfg.momentum,
        nesterov=cfg.momentum > 0,
        weight_decay=cfg.weight_decay,
    )


def train(
    ctx: DistContext,
    config: TrainyardConfig,
    train_split: TensorSplit,
    val_split: TensorSplit,
    objective: Objective,
    tracker: Tracker,
    checkpointer: CheckpointWriter | NullCheckpointWriter,
    checkpoint_meta: dict[str, Any],
    resume: Resume | None = None,
    on_step: Callable[[int], None] = lambda step: None,
    shard_stager: ShardStager | None = None,
) -> TrainOutcome:
    cfg = config.train
    if ctx.device.type == "cuda":
        train_split, val_split = train_split.to(ctx.device), val_split.to(ctx.device)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = build_model(config.model, train_split.features.shape[1], objective.num_outputs)
    if resume is not None and resume.shards is None:
        # Into the bare model, before wrapping: DDP then broadcasts the same weights anyway.
        model.load_state_dict(strip_wrapper_prefixes(resume.state["model"]))
    elif resume is not None and resume.warm_start:
        load_shards(model, None, resume.shards)  # full weights from a sharded checkpoint
    ddp_model = wrap_model(model, ctx, cfg.strategy)
    torch.manual_seed(cfg.seed * 1_000 + ctx.rank)  # independent dropout masks per rank
    optimizer = build_optimizer(ddp_model, config)
    batches = ShardedBatches(len(train_split), cfg.batch_size, ctx.world_size, ctx.rank, cfg.seed)
    total_steps = cfg.epochs * batches.steps_per_epoch
    warmup_steps = round(cfg.warmup_epochs * batches.steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps)
    )
    outcome = TrainOutcome(model=model)
    meter = StepMeter(ctx.device, config.tracking.log_every_n_steps)
    start_epoch, start_step = 0, 0
    if resume is not None and not resume.warm_start:
        state = resume.state
        if resume.shards is not None:  # this rank's slices of model and optimizer
            load_shards(ddp_model, optimizer, resume.shards)
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"][ctx.rank])
        start_epoch, start_step = state["epoch"], state["step_in_epoch"]
        outcome.steps = outcome.resumed_step = state["step"]
        outcome.history = list(state["history"])
        log.info(
            "resumed at step %d: epoch %d, step %d of %d in it",
            outcome.steps,
            start_epoch + 1,
            start_step,
            batches.steps_per_epoch,
        )
    elif resume is not None:
        outcome.resumed_step = 0
        log.info(
            "warm start: weights from step %d, fresh optimizer and schedule", resume.state["step"]
        )
    log.info(
        "training %d epochs x %d steps, global batch %d, lr %.4g (scaled from %.4g at batch %d)",
        cfg.epochs,
        batches.steps_per_epoch,
        batches.global_batch_size,
        config.scaled_lr,
        cfg.lr,
        cfg.lr_reference_batch_size,
    )
    every_n_steps = config.checkpoint.every_n_steps
    # bf16 autocast: matmuls in bfloat16, reductions such as the loss in fp32, no loss scaler.
    autocast = torch.autocast(ctx.device.type, torch.bfloat16, enabled=cfg.precision == "bf16")

    def save(epoch: int, step_in_epoch: int, metrics: dict[str, float] | None = None) -> None:
        # Every rank takes part (its RNG state is gathered); only rank 0's writer stores it.
        rng = all_gather_objects(capture_rng())
        state = {
            "scheduler": scheduler.state_dict(),
            "rng": rng,
            "epoch": epoch,  # where to continue: this epoch, after step_in_epoch steps of it
            "step_in_epoch": step_in_epoch,
            "step": outcome.steps,
            # this rank's loss and rows so far in a checkpoint taken mid-epoch
            "epoch_loss": meter.epoch_loss_sum if step_in_epoch else 0.0,
            "epoch_rows": meter.epoch_rows if step_in_epoch else 0,
            "history": outcome.history,
        }
        position = {"epoch": epoch, "step_in_epoch": step_in_epoch, "metrics": metrics or {}}
        meta = {**checkpoint_meta, **position}
        if shard_stager is not None:  # fsdp: one file per rank, written by every rank
            shards, uploaded = shard_stager.stage(outcome.steps, ddp_model, optimizer)
            checkpointer.save(outcome.steps, state, meta, shards=shards, uploaded=uploaded)
            return
        state["model"] = strip_wrapper_prefixes(unwrap(ddp_model).state_dict())
        state["optimizer"] = optimizer.state_dict()
        checkpointer.save(outcome.steps, state, meta)

    def log_window() -> None:
        metrics = meter.window()
        if metrics:
            tracker.log_metrics({**metrics, "lr": scheduler.get_last_lr()[0]}, step=outcome.steps)

    for epoch in range(start_epoch, cfg.epochs):
        ddp_model.train()
        first = start_step if epoch == start_epoch else 0
        if epoch == start_epoch and resume is not None and not resume.warm_start:
            meter.start_epoch(resume.state["epoch_loss"], resume.state["epoch_rows"])
        else:
            meter.start_epoch()
        for step_in_epoch, batch in enumerate(batches.epoch(epoch, start_step=first), first + 1):
            started = time.perf_counter()
            features, labels = train_split.take(batch.indices)
            features, labels = features.to(ctx.device), labels.to(ctx.device)
            waited = time.perf_counter() - started  # what the step spent waiting for its batch
            with autocast:
                loss_sum = objective.loss_sum(ddp_model(features), labels)
            # DDP averages gradients over ranks; this scale makes the update the mean over the
            # whole global batch, exactly what one worker would compute on it.
            (loss_sum * ctx.world_size / batch.global_count).backward()
            if cfg.grad_clip_norm is not None:  # the gradients are the global batch's by now
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            outcome.steps += 1
            if outcome.first_step_at is None:
                outcome.first_step_at = time.time()
            step_s = time.perf_counter() - started
            if meter.record(loss_sum, len(batch.indices), step_s, waited):
                log_window()
            on_step(outcome.steps)
            mid_epoch = step_in_epoch < batches.steps_per_epoch
            if mid_epoch and every_n_steps and outcome.steps % every_n_steps == 0:
                save(epoch, step_in_epoch)
        log_window()  # the epoch's last partial window
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)  # the epoch's time is its kernels' time
        train_s = time.perf_counter() - meter.epoch_started
        val = evaluate_split(model, val_split, ctx, objective)
        row = {
            "epoch": epoch + 1,
            "train_loss": meter.epoch_loss_sum / max(meter.epoch_rows, 1),
            **_prefixed("val_", val),
            "rows": meter.epoch_rows,  # this rank's share of the epoch
            "train_s": train_s,  # the step loop, tracking included
            "data_wait_s": meter.epoch_wait_s,  # of which waiting for batches
        }
        outcome.history.append(row)
        tracker.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=outcome.steps)
        log.info(
            "epoch %d/%d  train_loss %.4f  %s",
            epoch + 1,
            cfg.epochs,
            row["train_loss"],
            "  ".join(f"val_{name} {val[name]:.4f}" for name in objective.metrics),
        )
        on_step(outcome.steps)  # validation was progress too (for the hang watchdog)
        if (
            (epoch + 1) % config.checkpoint.every_n_epochs == 0
            or epoch + 1 == cfg.epochs
            or (every_n_steps and outcome.steps % every_n_steps == 0)
        ):
            save(epoch + 1, 0, _prefixed("val_", val))
        row["epoch_s"] = time.perf_counter() - meter.epoch_started  # validation and checkpoint
    outcome.samples_per_s = meter.samples_per_s
    return outcome


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    split: TensorSplit,
    ctx: DistContext,
    objective: Objective | None = None,
    chunk: int = 4096,
) -> dict[str, float]:
    """The task's metrics over the whole split, exactly: rank r scores rows r, r+W, ...
    (no padding, so nothing is counted twice), then the task's sums are all-reduced."""
    objective = objective or Classification()
    was_training = model.training
    model.eval()
    totals = torch.zeros(objective.num_sums, dtype=torch.float64, device=ctx.device)
    mine = torch.arange(ctx.rank, len(split), ctx.world_size)
    for indices in mine.split(chunk):
        features, labels = split.take(indices)
        features, labels = features.to(ctx.device), labels.to(ctx.device)
        totals += objective.batch_sums(model(features), labels)
    all_reduce_sum(totals)
    model.train(was_training)
    rows = len(split)
    return {**objective.finish(totals.tolist()), "rows": rows}


def _prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {prefix + k: v for k, v in values.items() if k != "rows"}
