"""How the workers train: the `train` section (processes, nodes, optimizer, precision, limits)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainyard.config.base import MAX_JOB_S, MAX_WAIT_S, Section

MAX_EPOCHS = 100_000
MAX_NODES = 4096
MAX_STAGES = 1024


class ParallelConfig(Section):
    """How one model replica is cut across workers (model parallelism); the data-parallel
    degree is what is left of the world: world size / (pipeline x tensor)."""

    pipeline: int = Field(
        1, ge=1, le=MAX_STAGES, description="pipeline stages: consecutive blocks per worker"
    )
    tensor: int = Field(
        1,
        ge=1,
        le=MAX_STAGES,
        description="tensor-parallel degree: each attention and MLP projection split this "
        "many ways (Megatron-style, DTensor)",
    )

    @property
    def model_workers(self) -> int:
        """Workers that hold one replica between them."""
        return self.pipeline * self.tensor


class TrainConfig(Section):
    workers: int = Field(2, ge=1, le=1024, description="processes per node (one per GPU on CUDA)")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: replicated model; fsdp: FSDP2 fully_shard, sharded checkpoints"
    )
    nnodes: int | str = Field(
        1,
        description="machines the run spans: N, or MIN:MAX (torchrun's elastic range, e.g. "
        '"1:2"): it trains on any MIN to MAX of them, losing one costs a restart from the last '
        "commit and one that joins is taken in at the next restart",
    )
    node_rank: int = Field(0, ge=0, description="this machine's index, 0 .. max_nodes-1")
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of node 0's rendezvous (torchrun c10d) when you start each node "
        "yourself (`trainyard join`); unset with nnodes > 1: node 0 picks it and starts the "
        "other nodes on the work pool's workers of other hosts",
    )
    node_timeout_s: float = Field(
        300,
        gt=0,
        le=MAX_WAIT_S,
        description="nnodes > 1: how long node 0 waits for the other nodes' hosts and for "
        "every node to join the rendezvous before it fails the run",
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="model parallelism: {pipeline: P, tensor: T}; the other factor of the "
        "world size is data parallel, along which train.strategy applies",
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b",
        description="parallel.pipeline > 1: the order micro-batches run through the stages "
        "(torch.distributed.pipelining); 1f1b holds fewer activations than gpipe, "
        "interleaved_1f1b gives each worker two stages and a smaller bubble",
    )
    microbatches: int = Field(
        4,
        ge=1,
        le=4096,
        description="parallel.pipeline > 1: micro-batches each batch is cut into on its way "
        "through the stages; the idle share of a step is about (stages-1)/(microbatches+stages-1)",
    )
    sync: Literal["allreduce", "local_sgd", "diloco", "parameter_server"] = Field(
        "allreduce",
        description="how data-parallel replicas agree: allreduce averages every step's "
        "gradients; local_sgd steps each replica alone and averages the weights every "
        "sync_every updates; diloco steps the weights every sync_every updates with an outer "
        "Nesterov SGD on the replicas' mean change (outer_lr, outer_momentum); "
        "parameter_server steps weights held by servers (parameter_servers) with each "
        "worker's gradients as they come, a worker at most max_staleness updates ahead of "
        "the slowest",
    )
    sync_every: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="local_sgd, diloco: updates each replica takes alone between syncs "
        "(one all-reduce of the weights per sync instead of one of the gradients per update)",
    )
    outer_lr: float = Field(
        0.7, gt=0, le=10, description="diloco: the outer optimizer's learning rate"
    )
    outer_momentum: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="diloco: the outer optimizer's Nesterov momentum (the DiLoCo paper's 0.9 "
        "suits thousands of outer steps; over tens it overshot: docs/performance.md)",
    )
    parameter_servers: int = Field(
        0,
        ge=0,
        le=1024,
        description="parameter_server: ranks that each hold a part of the parameters, "
        "0..S-1, which train too (0: rank 0 holds them all)",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        le=1_000_000,
        description="parameter_server: updates a worker may be ahead of the slowest",
    )
    epochs: int = Field(20, ge=1, le=MAX_EPOCHS)
    batch_size: int = Field(
        32,
        ge=1,
        description="per data-parallel worker (a model-parallel group shares one); the global "
        "batch is this x the data-parallel degree x grad_accum_steps",
    )
    lr: float = Field(0.05, gt=0, le=10, description="learning rate at lr_reference_batch_size")
    lr_reference_batch_size: int = Field(32, ge=1)
    warmup_epochs: float = Field(1.0, ge=0, le=MAX_EPOCHS)
    optimizer: Literal["sgd", "adamw"] = Field(
        "sgd", description="sgd (Nesterov momentum) or adamw (decoupled weight decay)"
    )
    grad_clip_norm: float | None = Field(
        None, gt=0, description="clip the global gradient norm to this before each update"
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="micro-batches of batch_size per update; the global batch counts them "
        "(batch_size x workers x grad_accum_steps) and the update is its exact mean gradient",
    )
    compile: bool = Field(False, description="torch.compile the model before wrapping it")
    prefetch: bool = Field(
        True,
        description="read the next steps' batches on a background thread while this step "
        "trains, where a core is free for it (workers x threads_per_worker below the cores); "
        "same batches, same order. false: read on the training thread, e.g. for a data.dataset "
        "whose take() draws from the global RNG or holds thread-bound handles",
    )
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(
        1e-4, ge=0, le=1, description="0 to 1: each update shrinks the weights by lr x this"
    )
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: forward and loss under bfloat16 autocast (weights, gradients and "
        "optimizer stay fp32); the fast path on GPUs with bf16 tensor cores",
    )
    threads_per_worker: int = Field(1, ge=1, le=256)
    gpus: list[int] | None = Field(
        None,
        description="the CUDA devices this run's workers use, one each (CUDA_VISIBLE_DEVICES); "
        "default all; a sweep gives each trial slot its own",
    )
    timeout_s: float = Field(
        3600, gt=0, le=MAX_JOB_S, description="the torchrun job is killed after this"
    )
    max_restarts: int = Field(
        3, ge=0, le=100, description="torchrun restarts all workers this often when one dies"
    )
    hang_timeout_s: float = Field(
        300,
        gt=0,
        le=MAX_WAIT_S,
        description="a worker without progress (or a collective stuck) this long fails the run",
    )

    @field_validator("nnodes", mode="before")
    @classmethod
    def _node_range(cls, value: object) -> int | str:
        """N (an int, or "N" or "N:N") becomes the int N; MIN:MAX with MIN < MAX stays a
        string, written "MIN:MAX" without leading zeros."""
        bounds = _node_bounds(value)
        if bounds is None or not 1 <= bounds[0] <= bounds[1] <= MAX_NODES:
            raise ValueError(
                f"must be a number of machines (1 to {MAX_NODES}) or MIN:MAX such as 1:2 "
                "(1 <= MIN <= MAX)"
            )
        low, high = bounds
        return low if low == high else f"{low}:{high}"

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d{1,5}", value):
            raise ValueError("must be host:port of node 0, e.g. 10.0.0.1:29400")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        if not value or min(value) < 0 or max(value) > 1023 or len(set(value)) != len(value):
            raise ValueError("must list distinct GPU indices (0, 1, ...), or be null for all")
        workers = info.data.get("workers")
        if workers is not None and len(value) < workers:
            raise ValueError(f"lists {len(value)} GPU(s), fewer than train.workers={workers}")
        return value

    @model_validator(mode="after")
    def _nodes(self) -> TrainConfig:
        if self.node_rank >= self.max_nodes:
            raise ValueError(
                f"node_rank {self.node_rank} must be below nnodes {self.nnodes} "
                f"(0 to {self.max_nodes - 1})"
            )
        if self.elastic and self.max_restarts == 0:
            raise ValueError(
                f"nnodes {self.nnodes} goes on without a lost node by restarting the workers, "
                "which train.max_restarts=0 forbids: set train.max_restarts to 1 or more"
            )
        self._check_layout()
        self._check_sync()
        if self.node_rank > 0 and not self.rdzv_endpoint:
            raise ValueError(
                f"node_rank {self.node_rank} needs rdzv_endpoint: host:port of node 0's "
                "rendezvous, which node 0 printed or set in this node's flow-run parameters"
            )
        return self

    def _check_layout(self) -> None:
        """The model-parallel group divides every world this run may train in; a pipeline's
        every batch divides into its micro-batches."""
        group = self.parallel.model_workers
        if group == 1:
            return
        worlds = [self.workers] if self.elastic else [self.workers * self.max_nodes]
        for world in worlds:
            if world % group:
                where = "workers per node" if self.elastic else "world size (workers x nnodes)"
                raise ValueError(
                    f"parallel pipeline {self.parallel.pipeline} x tensor {self.parallel.tensor} "
                    f"= {group} does not divide the {where}, {world}: set train.workers to a "
                    f"multiple of {group}"
                )
        if self.parallel.pipeline == 1:
            return
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} does not divide into microbatches "
                f"{self.microbatches}: make batch_size a multiple of train.microbatches"
            )
        if (
            self.pipeline_schedule == "interleaved_1f1b"
            and self.microbatches % self.parallel.pipeline
        ):
            raise ValueError(
                f"interleaved_1f1b runs micro-batches in rounds of the {self.parallel.pipeline} "
                f"stages: make train.microbatches ({self.microbatches}) a multiple of "
                f"{self.parallel.pipeline}"
            )

    def _check_sync(self) -> None:
        """Replicas that sync every few steps: plain data parallelism on a fixed world."""
        if self.sync == "allreduce":
            return
        if self.sync == "parameter_server" and self.parameter_servers > self.world_size:
            raise ValueError(
                f"parameter_servers {self.parameter_servers} is more than the "
                f"{self.world_size} workers, which host them: set train.parameter_servers "
                f"to at most {self.world_size} (0: rank 0 holds every parameter)"
            )
        if self.strategy != "ddp" or self.parallel.model_workers > 1:
            raise ValueError(
                f"sync {self.sync} trains whole replicas of the model: it runs with "
                "train.strategy ddp and no train.parallel split; set train.sync allreduce "
                "for fsdp, a pipeline or a tensor split"
            )
        if self.elastic:
            raise ValueError(
                f"sync {self.sync} needs a fixed set of workers (each one's own state is "
                "checkpointed; a parameter server's RPC world is fixed at start): set "
                f"train.nnodes to one number, not {self.nnodes}"
            )

    @property
    def sharded_checkpoints(self) -> bool:
        """Each worker saves its own part of the model (DCP): it holds only a part."""
        return self.strategy == "fsdp" or self.parallel.model_workers > 1

    @property
    def data_workers(self) -> int:
        """The data-parallel degree of the run's intended world: replicas of the model."""
        return self.world_size // self.parallel.model_workers

    @property
    def min_nodes(self) -> int:
        """The fewest machines the run trains on (nnodes, or MIN of MIN:MAX)."""
        return _validated_bounds(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        """The most machines the run trains on (nnodes, or MAX of MIN:MAX)."""
        return _validated_bounds(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """nnodes is a range: nodes may leave and join while the run trains."""
        return self.min_nodes < self.max_nodes

    @property
    def world_size(self) -> int:
        """The run's intended world, all max_nodes machines: its global batch is set here,
        and a world of fewer workers keeps that batch (checkpoint.world_change.Geometry)."""
        return self.workers * self.max_nodes


def _validated_bounds(nnodes: int | str) -> tuple[int, int]:
    bounds = _node_bounds(nnodes)
    if bounds is None:  # TrainConfig._node_range admits no such value
        raise ValueError(f"train.nnodes = {nnodes!r} is neither N nor MIN:MAX")
    return bounds


def _node_bounds(value: object) -> tuple[int, int] | None:
    """(MIN, MAX) of an nnodes value (N is N:N), or None where it is neither form."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d{1,6})\s*(?::\s*(\d{1,6})\s*)?", value)
        if match:
            low = int(match[1])
            return low, int(match[2] or low)
    return None
