"""One train state: the model (bare and wrapped), optimizer, schedule, position and meters.

What a checkpoint saves is `state_dict()`; a resume is `load_state_dict()`. The four ways a
job starts (fresh, full resume, full resume of a sharded checkpoint, warm start) differ only
in what is loaded, here, and the loop never asks which one it was.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from trainyard.checkpoint.reader import strip_wrapper_prefixes
from trainyard.checkpoint.resume import ResumeRefused, restore_rng
from trainyard.checkpoint.world_change import WorldChange, continued_geometry
from trainyard.config import TrainyardConfig
from trainyard.data.sharding import ShardedBatches
from trainyard.data_spec import DataSpec
from trainyard.dist import DistContext, on_cpu
from trainyard.engine.meter import NullClock, OwnTimeClock, StepMeter
from trainyard.models.registry import build_model
from trainyard.models.zoo import split_fused_qkv
from trainyard.parallel.pipelined import PipelinedModel, pipelined
from trainyard.parallel.wrap import unwrap, wrap_model
from trainyard.sync.parameter_server import ParameterServerSync, ServerSettings
from trainyard.sync.periodic import OuterSettings, PeriodicSync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """A verified checkpoint state to start from; `warm_start` takes its weights only.
    A sharded checkpoint's model and optimizer are in the verified files in `shards`;
    `change` says how a full resume goes on at another world size than the checkpoint's."""

    state: dict[str, Any]
    warm_start: bool = False
    shards: Path | None = None
    change: WorldChange | None = None


def by_parameter_name(optim_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, as DCP's API wants it. Checkpoints
    written before trainyard used that API key it by position (`Optimizer.state_dict()`),
    and positions follow `model.named_parameters()`, which the optimizer was built from."""
    groups = optim_state["param_groups"]
    if not groups or not all(isinstance(p, int) for g in groups for p in g["params"]):
        return optim_state
    names = [name for name, _ in model.named_parameters()]
    return {
        "state": {names[i]: value for i, value in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear warm-up (large global batches need it), then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def follow_this_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """After a resume, the learning rate of this run's schedule at the loaded step. The
    checkpoint's optimizer holds what its own schedule set last: the same value unless the
    run was given more epochs, whose stretched cosine is past 0 where the old one ended."""
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR), "build()'s schedule"
    groups = scheduler.optimizer.param_groups
    for group, factor, base in zip(groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)  # as LambdaLR.get_lr computes it


def build_optimizer(model: nn.Module, config: TrainyardConfig) -> torch.optim.Optimizer:
    return optimizer_for(model.parameters(), config)


def optimizer_for(
    parameters: Iterable[torch.Tensor], config: TrainyardConfig
) -> torch.optim.Optimizer:
    """train.optimizer over `parameters` (a model's, or a parameter server's part)."""
    cfg = config.train
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=config.scaled_lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        parameters,
        lr=config.scaled_lr,
        momentum=cfg.momentum,
        nesterov=cfg.momentum > 0,
        weight_decay=cfg.weight_decay,
    )


Sync = PeriodicSync | ParameterServerSync


def replica_sync(model: nn.Module, config: TrainyardConfig) -> Sync | None:
    """train.sync's replicas that train apart and agree every train.sync_every updates, or
    a parameter server's workers (None: DDP's all-reduce, or one process alone)."""
    cfg = config.train
    if cfg.sync == "allreduce":
        return None
    if cfg.sync == "parameter_server":
        if not dist.is_initialized():  # one process alone: plain steps on its own weights
            return None
        settings = ServerSettings(cfg.parameter_servers, cfg.max_staleness)
        return ParameterServerSync(model, settings, lambda part: optimizer_for(part, config))
    outer = OuterSettings(cfg.outer_lr, cfg.outer_momentum) if cfg.sync == "diloco" else None
    return PeriodicSync(model, cfg.sync_every, outer)


@dataclass
class TrainState:
    ctx: DistContext  # where it trains: this rank, the world, the device
    config: TrainyardConfig  # the run's settings, which the loop reads and never changes
    model: nn.Module  # bare: what validation runs and checkpoints hold (a pipeline's part)
    wrapped: nn.Module  # DDP, fully_shard or a pipeline's part: what trains
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: ShardedBatches
    meter: StepMeter
    grad_accum_steps: int  # micro-batches an update's rows are read in, on each rank
    epoch: int = 0  # where to continue: this epoch, after step_in_epoch steps of it
    step_in_epoch: int = 0
    steps: int = 0  # global step reached (counting steps done before a resume)
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_step: int | None = None  # the checkpoint step this process continued from
    restored_epoch: tuple[float, int] | None = None  # a mid-epoch checkpoint's loss and rows
    stop: bool = False  # set by a hook at an epoch's end: training ends there, cleanly
    # Times each step's own part for the straggler hook, which train() takes it from.
    clock: OwnTimeClock | NullClock = field(default_factory=NullClock)
    # train.sync local_sgd or diloco: brings the replicas together every few updates; a
    # parameter server's worker side (None: DDP's all-reduce does, every update).
    sync: Sync | None = None

    @classmethod
    def build(
        cls,
        ctx: DistContext,
        config: TrainyardConfig,
        rows: int,
        data: DataSpec,
        resume: Resume | None = None,
    ) -> TrainState:
        cfg = config.train
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        model = build_model(config.model, data)
        wrapped: nn.Module
        if cfg.parallel.pipeline > 1:  # this worker's stages: what it trains, saves, scores
            with torch.device("meta"):  # the tensors between its stages are traced on it
                shapes = build_model(config.model, data)
            model = wrapped = pipelined(
                model, ctx, cfg.parallel.pipeline, cfg.pipeline_schedule, cfg.microbatches,
                cfg.strategy, cfg.parallel.tensor, shapes,
            )  # fmt: skip
        elif cfg.sync != "allreduce":  # each replica steps alone; the sync brings them together
            wrapped = model.to(ctx.device)
        else:
            wrapped = wrap_model(model, ctx, cfg.strategy, cfg.parallel.tensor)
        if cfg.compile:  # after wrapping, so DDP's bucketed all-reduce is traced around
            wrapped = cast(nn.Module, torch.compile(wrapped))  # an OptimizedModule
        # Independent dropout masks per replica; a tensor-parallel group's workers draw the
        # same ones, as their activations outside the split layers are one tensor.
        torch.manual_seed(cfg.seed * 1_000 + ctx.data_rank)
        optimizer = build_optimizer(wrapped, config)
        # One step reads grad_accum_steps micro-batches per rank: the sampler's batch is theirs.
        # A resume at another world size keeps the checkpoint's global batch, cut anew; a
        # start on fewer nodes than train.nnodes allows (elastic) keeps the run's own.
        change = resume.change if resume is not None else None
        own_batch = config.global_batch_size
        cut = change.geometry if change else continued_geometry(own_batch, ctx.data_size, cfg)
        batches = ShardedBatches(rows, cut.rows_per_worker, ctx.data_size, ctx.data_rank, cfg.seed)
        total_steps = cfg.epochs * batches.steps_per_epoch
        warmup_steps = round(cfg.warmup_epochs * batches.steps_per_epoch)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps)
        )
        tracking = config.tracking
        meter = StepMeter(ctx.device, tracking.log_every_n_steps, tracking.min_interval_s)
        state = cls(
            ctx, config, model, wrapped, optimizer, scheduler, batches, meter, cut.grad_accum_steps
        )
        state.sync = replica_sync(model, config)
        if resume is not None:
            try:
                state.load_state_dict(resume, ctx.rank)
            except BaseException:
                if state.sync is not None:  # a parameter server stops serving at once
                    state.sync.close(graceful=False)
                raise
        return state

    def load_state_dict(self, resume: Resume, rank: int) -> None:
        """Continue where the checkpoint left off; a warm start takes the weights only.

        One path for every case: DCP's state-dict API maps whole tensors (`state.pt`) or
        this rank's slices (a sharded checkpoint's files) onto the model as wrapped, DDP or
        FSDP, and keys the optimizer's state by parameter name, not position."""
        # DCP's state-dict API takes most of a second to import: only a resume pays it.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        model_state, optim_state = self._checkpointed(resume)
        options = StateDictOptions(full_state_dict=resume.shards is None)
        if isinstance(self.wrapped, PipelinedModel):  # this worker's stages' part of it
            model_state = {k: v for k, v in model_state.items() if k in self.wrapped.state_dict()}
        if resume.warm_start:
            set_model_state_dict(self.wrapped, model_state, options=options)
            if self.sync is not None:  # DiLoCo's first interval starts from these weights
                self.sync.restart()
            self.resumed_step = 0
            log.info(
                "warm start: weights from step %d, fresh optimizer and schedule",
                resume.state["step"],
            )
            return
        assert optim_state is not None  # a full resume's checkpoint holds the optimizer's
        set_state_dict(
            self.wrapped,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=options,
        )
        state = resume.state
        self.scheduler.load_state_dict(state["scheduler"])
        follow_this_schedule(self.scheduler)
        # A rank the checkpoint's smaller world had none for keeps the stream build() seeded.
        if rank < len(state["rng"]):
            restore_rng(state["rng"][rank])
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        if resume.change is not None:  # the same row of the epoch, in this world's steps
            self.step_in_epoch = resume.change.step_in_epoch
        self.steps = self.resumed_step = state["step"]
        if self.sync is not None:
            self._load_replica(state, rank)
        self.history = list(state["history"])
        self.restored_epoch = (state["epoch_loss"], state["epoch_rows"])
        log.info(
            "resumed at step %d: epoch %d, step %d of %d in it",
            self.steps,
            self.epoch + 1,
            self.step_in_epoch,
            self.batches.steps_per_epoch,
        )

    def _load_replica(self, state: dict[str, Any], rank: int) -> None:
        """This worker's own weights and optimizer, and the sync's state, where the
        checkpoint holds them (one taken under local_sgd or diloco); a checkpoint of
        replicas that all-reduced every step starts the intervals afresh from its weights."""
        assert self.sync is not None
        self.sync.restart()  # from the weights every rank loaded alike (rank 0's)
        replicas = state.get("replicas")
        if replicas is None:
            return
        if len(replicas) != self.ctx.world_size:  # checked before launch too (check_compatible)
            raise ResumeRefused(
                f"the checkpoint of step {state['step']} holds the weights of each of its "
                f"{len(replicas)} workers, not of {self.ctx.world_size}: resume it with "
                f"{len(replicas)} workers (train.workers x train.nnodes), or with --warm-start"
            )
        if isinstance(self.sync, ParameterServerSync):
            servers = len(state["sync"]["pulled"])
            if servers != len(self.sync.parts):
                raise ResumeRefused(
                    f"the checkpoint of step {state['step']} holds the state of {servers} "
                    f"parameter server(s), this run has {len(self.sync.parts)}: resume it "
                    f"with train.parameter_servers {servers}, or with --warm-start"
                )
            self.sync.load_state_dict(state["sync"], replicas[rank])
            return
        self.sync.load_state_dict(state["sync"])
        self.model.load_state_dict(replicas[rank]["model"])
        self.optimizer.load_state_dict(replicas[rank]["optimizer"])

    def replica_state(self) -> dict[str, Any]:
        """This worker's own weights and optimizer, which differ from the others' between
        syncs (its optimizer's moments always do), or its parameter server's optimizer and
        counters: what a checkpoint gathers from each."""
        if isinstance(self.sync, ParameterServerSync):
            own = self.sync.own_state()
        else:
            own = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        # On the CPU: a GPU tensor sent to rank 0 would be rebuilt on the sender's GPU there.
        return cast(dict[str, Any], on_cpu(own))

    def _checkpointed(self, resume: Resume) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The checkpoint's model and optimizer state dicts (None: a warm start's optimizer)."""
        optimizer = None if resume.warm_start else self.optimizer
        if resume.shards is not None:
            # Imported here: DCP takes most of a second, which only a sharded resume pays.
            from trainyard.checkpoint.sharded import read_shards

            return read_shards(self.wrapped, optimizer, resume.shards)
        model_state = strip_wrapper_prefixes(resume.state["model"])
        if split_fused_qkv(model_state) and optimizer is not None:
            # Its optimizer state is keyed (or ordered) by the fused parameters.
            raise ResumeRefused(
                f"the checkpoint of step {resume.state['step']} holds a transformer saved with "
                "one fused qkv projection, by an earlier trainyard: an exact resume cannot "
                "map its optimizer state; continue with --warm-start (its weights, a fresh "
                "optimizer)"
            )
        if optimizer is None:
            return model_state, None
        return model_state, by_parameter_name(resume.state["optimizer"], unwrap(self.wrapped))

    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """What a checkpoint holds besides every rank's RNG (gathered by the checkpoint hook).
        Sharded: model and optimizer are in each rank's own files instead."""
        mid_epoch = self.step_in_epoch > 0
        state: dict[str, Any] = {
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "step": self.steps,
            # this rank's loss and rows so far in a checkpoint taken mid-epoch
            "epoch_loss": self.meter.epoch_loss_sum if mid_epoch else 0.0,
            "epoch_rows": self.meter.epoch_rows if mid_epoch else 0,
            "history": self.history,
        }
        if self.sync is not None:
            state["sync"] = self.sync.state_dict()
        if not sharded:  # DDP: every rank holds the whole state, keyed as DCP keys it
            # Read directly, not through DCP's state-dict API: importing that takes most of
            # a second of every job's start-up.
            model = self.model.state_dict()
            # The run's model is the one the replicas last agreed on (local_sgd, diloco);
            # each one's own is in the checkpoint's replicas.
            state["model"] = model if self.sync is None else self.sync.agreed_state_dict(model)
            state["optimizer"] = by_parameter_name(self.optimizer.state_dict(), self.model)
        return state

    def start_epoch(self, epoch: int) -> int:
        """Begin `epoch`; returns the step inside it to start from."""
        first = self.step_in_epoch if epoch == self.epoch else 0
        if self.restored_epoch is not None:  # the rest of the epoch a checkpoint had started
            self.meter.start_epoch(*self.restored_epoch)
            self.restored_epoch = None
        else:
            self.meter.start_epoch()
        self.epoch, self.step_in_epoch = epoch, first
        if isinstance(self.sync, PeriodicSync) and first == 0:
            self.sync.synced_in_epoch = False
        return first
