"""The data-parallel training loop and the exact, sharded evaluation it uses.

The loop is short on purpose: the state it advances is `TrainState` (with where and how it
trains), and what happens around the steps (straggler detection, tracking, progress, a
sweep's pruner, checkpoints) comes in as hooks built before it starts (`LoopHooks`: a job's
in trainyard.engine.job_setup, an in-process run's in trainyard.engine.standalone).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from trainyard.config import TrainyardConfig
from trainyard.data.prefetch import MicroBatches, can_help, prefetched, step_reader
from trainyard.data.sharding import Batch
from trainyard.data.tensors import TensorSplit, resident
from trainyard.datasets.augment import FlipCrop, augmented
from trainyard.datasets.base import MapDataset
from trainyard.dist import DistContext, all_reduce_sum
from trainyard.engine.hooks import Hook
from trainyard.engine.loop_hooks import LoopHooks
from trainyard.engine.train_state import Resume, TrainState
from trainyard.objectives import Classification, Objective
from trainyard.parallel.pipelined import PipelinedModel
from trainyard.parallel.wrap import no_gradient_sync
from trainyard.runs.record import RankLanes, Straggler
from trainyard.sync.communication import Communication, ddp_communication

__all__ = ["Resume", "Splits", "TrainOutcome", "evaluate_split", "lr_text", "train"]

Split = TensorSplit | MapDataset  # what the loop reads: len() rows, take(indices) a batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Splits:
    """What the loop trains on and validates with."""

    train: Split
    val: Split

    @classmethod
    def prepared(
        cls, ctx: DistContext, config: TrainyardConfig, train: Split, val: Split
    ) -> Splits:
        """The train split augmented as `data.augment` says, then each held on the device
        (or in this process's memory) where it fits."""
        # A TensorSplit is read as a MapDataset is (len, take), and flip_crop needs images.
        train = augmented(train, config.data.augment, config.train.seed)  # type: ignore[arg-type]
        return cls(resident(train, ctx.device), resident(val, ctx.device))


@dataclass
class TrainOutcome:
    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0  # global step reached (counting steps done before a resume)
    samples_per_s: float = 0.0  # this rank's mean over the steps this process ran
    resumed_step: int | None = None  # the checkpoint step this process continued from
    stragglers: list[Straggler] = field(default_factory=list)  # the same on every rank
    rank_lanes: RankLanes | None = None  # the same on every rank
    checkpoint_steps: list[int] = field(default_factory=list)  # saved by this process
    # every_n_epochs checkpoints skipped by checkpoint.max_overhead (the store was behind)
    skipped_checkpoint_epochs: list[int] = field(default_factory=list)
    communication: Communication | None = None  # this rank's syncs (None: not counted)


def train(
    state: TrainState, splits: Splits, objective: Objective, hooks: LoopHooks
) -> TrainOutcome:
    """Train `state` for the rest of its `train.epochs` (all of them unless it was resumed),
    calling `hooks` in their order (LoopHooks.in_order); any may end training at an epoch's
    end (`state.stop`), which is then the run's last and checkpointed. An interrupt (the
    checkpoint hook's StopRequest) ends training at a step every rank agrees on, with that
    step's checkpoint (StopTraining)."""
    state.clock = hooks.stragglers.clock  # the straggler hook reads each step's own part
    _log_plan(state)
    try:
        _train_epochs(state, splits, objective, hooks.in_order())
    except BaseException:
        if state.sync is not None:  # a parameter server stops serving at once
            state.sync.close(graceful=False)
        raise
    if state.sync is not None:  # stopped early: end on the model that was validated
        state.sync.settle()
        state.sync.close(graceful=True)
    hooks.tracking.finish()
    hooks.checkpoints.log_cadence()
    return TrainOutcome(
        model=state.model,
        history=state.history,
        steps=state.steps,
        samples_per_s=state.meter.samples_per_s,
        resumed_step=state.resumed_step,
        stragglers=hooks.stragglers.found(),
        rank_lanes=hooks.stragglers.lanes(),
        checkpoint_steps=hooks.checkpoints.saved_steps,
        skipped_checkpoint_epochs=hooks.checkpoints.skipped_epochs,
        communication=_communication(state, hooks.checkpoints.gathers),
    )


def _train_epochs(
    state: TrainState, splits: Splits, objective: Objective, hooks: list[Hook]
) -> None:
    epochs = state.config.train.epochs
    for epoch in range(state.epoch, epochs):
        _train_epoch(state, epoch, splits.train, objective, hooks)
        _end_epoch(state, epochs, splits.val, objective, hooks)
        if state.stop:
            log.info("stopping after epoch %d: a hook asked to", epoch + 1)
            return


def _communication(state: TrainState, gathers: Communication) -> Communication | None:
    """What syncing the replicas cost this rank over the updates this process ran: the
    periodic sync's own count, or DDP's (None for the layouts whose syncs are not counted
    yet: fsdp, a pipeline, a tensor split); with the checkpoints' `gathers` beside it."""
    counted: Communication | None
    if state.sync is not None:
        counted = state.sync.counted()
    else:
        updates = state.steps - (state.resumed_step or 0)
        counted = ddp_communication(getattr(state.wrapped, "_orig_mod", state.wrapped), updates)
    if counted is not None:
        counted.checkpoint_bytes = gathers.checkpoint_bytes
        counted.checkpoint_wait_s = gathers.checkpoint_wait_s
    return counted


def _agreed_weights(state: TrainState) -> AbstractContextManager[None]:
    """Inside the block the model holds the weights every replica agreed on: under local_sgd
    and diloco, those of their last sync; otherwise they are its own."""
    return nullcontext() if state.sync is None else state.sync.agreed_weights()


def _log_plan(state: TrainState) -> None:
    config = state.config
    log.info(
        "training %d epochs x %d steps, global batch %d, %s",
        config.train.epochs,
        state.batches.steps_per_epoch,
        state.batches.global_batch_size,
        lr_text(config),
    )
    if folded := state.batches.folded_rows:
        log.info(
            "each epoch's last %d row(s), fewer than the %d workers, join its last step",
            folded,
            state.batches.world_size,
        )
    if state.steps:
        _log_resumed_lr(state)


# Below this share of its peak the cosine schedule's tail learns little: said at a resume.
LOW_LR_SHARE = 0.05


def _log_resumed_lr(state: TrainState) -> None:
    """Where a resume enters the schedule: a finished run given more epochs continues at the
    tail of the cosine, stretched to the new length, which users expect to train more."""
    lr, peak = float(state.optimizer.param_groups[0]["lr"]), state.config.scaled_lr
    total = state.config.train.epochs * state.batches.steps_per_epoch
    note = ""
    if lr < LOW_LR_SHARE * peak:
        note = (
            "; the cosine schedule is near its end there, so these steps learn little: "
            "`trainyard run --resume-from RUN_ID --warm-start` trains on from the weights "
            "with a schedule of its own"
        )
    log.info(
        "resuming at step %d of %d: lr %.3g there, %.1f%% of its peak %.4g%s",
        state.steps,
        total,
        lr,
        100 * lr / peak,
        peak,
        note,
    )


def lr_text(config: TrainyardConfig) -> str:
    """The learning rate training starts from; where linear scaling moved it off train.lr
    (a batch size or worker count change alone does), by how much and why."""
    cfg = config.train
    if config.scaled_lr == cfg.lr:
        return f"lr {cfg.lr:.4g}"
    return (
        f"lr {config.scaled_lr:.4g} (train.lr {cfg.lr:.4g} scaled linearly: global batch "
        f"{config.global_batch_size} / train.lr_reference_batch_size {cfg.lr_reference_batch_size})"
    )


def _train_epoch(
    state: TrainState, epoch: int, split: Split, objective: Objective, hooks: list[Hook]
) -> None:
    ctx, config = state.ctx, state.config
    cfg = config.train
    state.wrapped.train()
    first = state.start_epoch(epoch)
    if isinstance(split, FlipCrop):  # its draws depend on the epoch (set before any read)
        split.set_epoch(epoch)
    batches = state.batches.epoch(epoch, start_step=first)
    ahead = cfg.prefetch and can_help(split, cfg.workers)
    pin = ctx.device if ahead and ctx.device.type == "cuda" else None
    read = _step_reader(split, state.grad_accum_steps, pin, ctx.data_size)
    with prefetched(batches, read, enabled=ahead) as steps:  # the thread ends with the epoch
        started = time.perf_counter()
        state.clock.start()
        for step_in_epoch, (batch, pieces) in enumerate(steps, first + 1):
            waited = time.perf_counter() - started  # reading the batch, or waiting for it
            loss_sum, copied = _accumulate_gradients(state, batch, pieces, ctx, config, objective)
            if cfg.grad_clip_norm is not None:  # the gradients are the global batch's by now
                _clip_gradients(state, cfg.grad_clip_norm)
            if state.sync is None:
                state.optimizer.step()
            else:  # local_sgd, diloco: sync every train.sync_every; a parameter server steps
                state.sync.step(state.optimizer)
            state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.steps += 1
            state.step_in_epoch = step_in_epoch
            rows = batch.indices.shape[0]  # not len(): Tensor.__len__ is Python, once a step
            state.meter.record(loss_sum, rows, time.perf_counter() - started, waited + copied)
            for hook in hooks:
                hook.on_step(state)
            started = time.perf_counter()
            state.clock.start()


def _step_reader(
    split: Split, pieces: int, pin: torch.device | None, replicas: int
) -> Callable[[Batch], MicroBatches]:
    """Reads an update as `pieces` micro-batches, never an empty one: a step whose smallest
    share holds fewer rows (an epoch's last, at most) is read in as many pieces as that
    share has rows. Every rank reads the same count, so each runs the same forward passes
    (a sharded model gathers its parameters in each) and syncs its gradients in the last."""
    full = step_reader(split, pieces, pin)

    def read(batch: Batch) -> MicroBatches:
        fewest = batch.global_count // replicas  # shares differ by one row at most
        if fewest >= pieces:
            return full(batch)
        return step_reader(split, max(fewest, 1), pin)(batch)

    return read


def _accumulate_gradients(
    state: TrainState,
    batch: Batch,
    pieces: MicroBatches,
    ctx: DistContext,
    config: TrainyardConfig,
    objective: Objective,
) -> tuple[torch.Tensor, float]:
    """Forward and backward this rank's rows of one update, read as `state.grad_accum_steps`
    micro-batches (`pieces`, some may be empty); returns their summed loss and the time spent
    copying them to the device.

    Gradients are summed over micro-batches and synchronized after the last one only.
    DDP averages them over the replicas (the ranks, without model parallelism); the scale
    makes the update the mean over the whole global batch, exactly what one worker would
    compute on it."""
    bf16 = config.train.precision == "bf16"
    if isinstance(state.wrapped, PipelinedModel):
        return _pipeline_gradients(state, state.wrapped, batch, pieces, objective, bf16)
    scale = ctx.data_size / batch.global_count
    total: torch.Tensor | None = None
    copied = 0.0
    for last, inputs, targets, seconds in _on_device(pieces, ctx.device):
        copied += seconds
        if last:  # alone in most updates: it enters no context manager
            loss_sum = _forward_backward(state, inputs, targets, objective, scale, bf16, True)
        else:
            with no_gradient_sync(state.wrapped):
                loss_sum = _forward_backward(state, inputs, targets, objective, scale, bf16, False)
        total = loss_sum if total is None else total + loss_sum
    assert total is not None, "an update reads at least one micro-batch"
    return total, copied


def _on_device(
    pieces: MicroBatches, device: torch.device
) -> Iterator[tuple[bool, torch.Tensor, torch.Tensor, float]]:
    """An update's micro-batches on `device`: whether it is the last, its inputs and targets,
    and the seconds their copy took (0 on the CPU, where they already are)."""
    for i, (inputs, targets) in enumerate(pieces):
        seconds = 0.0
        if device.type != "cpu":
            inputs, targets, seconds = _to_device(inputs, targets, device)
        yield i == len(pieces) - 1, inputs, targets, seconds


def _to_device(
    inputs: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, float]:
    copy = time.perf_counter()
    # From pinned memory the copy is queued on the GPU's stream and the thread moves on;
    # from pageable memory it waits for the copy.
    inputs = inputs.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    return inputs, targets, time.perf_counter() - copy


def _pipeline_gradients(
    state: TrainState,
    model: PipelinedModel,
    batch: Batch,
    pieces: MicroBatches,
    objective: Objective,
    bf16: bool,
) -> tuple[torch.Tensor, float]:
    """`_accumulate_gradients` through a pipeline's schedule: every worker of a pipeline
    reads its replica's rows (the first stage feeds the inputs, the last scores the
    targets). The replicas' gradients are summed, not averaged as DDP does: the scale is
    one over the global batch, the same update (times the replicas where FSDP averages)."""
    scale = model.replicas_averaged / batch.global_count
    total: torch.Tensor | None = None
    copied = 0.0
    for last, inputs, targets, seconds in _on_device(pieces, state.ctx.device):
        copied += seconds
        if last:
            state.clock.stop()  # this one waits for the other stages, then the replicas
        loss_sum = model.train_step(inputs, targets, objective.loss_sum, scale, bf16)
        if loss_sum is not None:
            total = loss_sum if total is None else total + loss_sum
    model.sync_gradients()
    return model.batch_loss(total, state.ctx.device), copied


def _clip_gradients(state: TrainState, max_norm: float) -> None:
    model = state.wrapped
    if isinstance(model, PipelinedModel):  # the norm over every stage's gradients
        model.clip_gradients(max_norm)
    elif state.config.train.parallel.tensor > 1:
        # Imported here: DTensor's modules take about a second, which only a split model pays.
        from trainyard.parallel.tensor import clip_gradients

        clip_gradients(list(model.parameters()), max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _forward_backward(
    state: TrainState,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    objective: Objective,
    scale: float,
    bf16: bool,
    last: bool,
) -> torch.Tensor:
    """One micro-batch's forward and backward; returns its summed loss, detached. A step of
    the digits MLP is ~0.7 ms, and every context manager or op that does nothing costs it
    microseconds: autocast is entered only when on."""
    if bf16:  # matmuls in bfloat16, reductions such as the loss in fp32, no loss scaler
        with torch.autocast(inputs.device.type, torch.bfloat16):
            loss_sum = objective.loss_sum(state.wrapped(inputs), targets)
    else:
        loss_sum = objective.loss_sum(state.wrapped(inputs), targets)
    if last:
        state.clock.stop()  # this backward waits for the slowest rank's gradients
    # The scale seeds the backward pass, the same gradients as (loss_sum * scale) in one
    # kernel instead of three: on a GPU the step is often launch-bound.
    loss_sum.backward(torch.full_like(loss_sum, scale))
    return loss_sum.detach()


def _end_epoch(
    state: TrainState,
    epochs: int,
    val_split: Split,
    objective: Objective,
    hooks: list[Hook],
) -> None:
    """Validate, add the epoch's row to the history, then the hooks (checkpoint last)."""
    meter, ctx = state.meter, state.ctx
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # the epoch's time is its kernels' time
    if state.sync is not None and state.sync.due_at_epoch_end(last=state.epoch + 1 == epochs):
        state.sync.sync()
    train_s = time.perf_counter() - meter.epoch_started
    with _agreed_weights(state):  # every worker scores its rows with the one, agreed model
        val = evaluate_split(state.model, val_split, ctx, objective)
    row = {
        "epoch": state.epoch + 1,
        "train_loss": meter.epoch_loss_sum / max(meter.epoch_rows, 1),
        **_prefixed("val_", val),
        "rows": meter.epoch_rows,  # this rank's share of the epoch
        "train_s": train_s,  # the step loop, tracking included
        "data_wait_s": meter.epoch_wait_s,  # of which waiting for batches
    }
    state.history.append(row)
    log.info(
        "epoch %d/%d  train_loss %.4f  %s",
        state.epoch + 1,
        epochs,
        row["train_loss"],
        "  ".join(f"val_{name} {val[name]:.4f}" for name in objective.metrics),
    )
    state.epoch, state.step_in_epoch = state.epoch + 1, 0
    for hook in hooks:
        hook.on_epoch_end(state, row)
    row["epoch_s"] = time.perf_counter() - meter.epoch_started  # validation and checkpoint


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    split: Split,
    ctx: DistContext,
    objective: Objective | None = None,
    chunk: int = 4096,
) -> dict[str, float]:
    """The task's metrics over the whole split, exactly: rank r scores rows r, r+W, ...
    (no padding, so nothing is counted twice), then the task's sums are all-reduced.

    Every rank runs the same number of forward passes (some on fewer rows; one with none
    scores a stand-in row and drops it): a sharded model gathers its parameters in each,
    with every rank taking part."""
    objective = objective or Classification()
    if objective.target_kind == "tokens":
        chunk = max(1, chunk // 64)  # a window's logits are context x vocabulary values
    was_training = model.training
    model.eval()
    totals = torch.zeros(objective.num_sums, dtype=torch.float64, device=ctx.device)
    rows = len(split)
    # From min(rank, rows): a split smaller than the world leaves the ranks past it none.
    mine = torch.arange(min(ctx.data_rank, rows), rows, ctx.data_size)
    passes = max(1, math.ceil(math.ceil(rows / ctx.data_size) / chunk))
    for indices in mine.tensor_split(passes):
        # A rank with no rows left still runs the pass (a sharded model gathers its
        # parameters in each, with every rank), on row 0 as a stand-in whose sums it drops:
        # no model is asked to score an empty batch, and no row is counted twice.
        empty = indices.shape[0] == 0
        if empty and rows == 0:
            continue  # alike on every rank: nothing to score anywhere
        features, labels = split.take(torch.zeros(1, dtype=torch.long) if empty else indices)
        features, labels = features.to(ctx.device), labels.to(ctx.device)
        sums = _scored(model, features, labels, objective)
        if not empty and sums is not None:
            totals += sums
    all_reduce_sum(totals)
    totals /= _scorers(model, ctx)  # of each replica's rows
    model.train(was_training)
    return {**objective.finish(totals.tolist()), "rows": rows}


def _scored(
    model: nn.Module, features: torch.Tensor, labels: torch.Tensor, objective: Objective
) -> torch.Tensor | None:
    """The objective's sums for a batch; None on a pipeline's workers but the last stage's."""
    if isinstance(model, PipelinedModel):
        outputs = model.outputs(features)
        return None if outputs is None else objective.batch_sums(outputs, labels)
    return objective.batch_sums(model(features), labels)


def _scorers(model: nn.Module, ctx: DistContext) -> int:
    """The workers of a replica that score each of its rows: all of them (tensor parallel
    gathers the outputs), the last stage's alone in a pipeline."""
    if isinstance(model, PipelinedModel):
        return ctx.model_workers // model.pipeline.workers
    return ctx.model_workers


def _prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {prefix + k: v for k, v in values.items() if k != "rows"}
