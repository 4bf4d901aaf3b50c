"""A worker's part of a model cut into pipeline stages, seen as a module: what training,
the optimizer, checkpoints and evaluation hold where a data-parallel worker holds the model.

Its parameters and buffers are this worker's stages' own, under their names in the whole
model, so the optimizer's state, DCP's state-dict API and a checkpoint read them as the
whole model's (a checkpoint written by the stages loads into one process, and back). The
model runs batch by batch through the pipeline's schedule (`train_step`, `outputs`), not
through `forward`. Replicas of the pipeline (data parallelism across pipelines) sum their
gradients stage by stage, over the workers holding the same stage, or shard each stage
across them (FSDP, which averages them). A stage's layers may be split across a
tensor-parallel group as well (trainyard.parallel.tensor): its parameters are then DTensors,
whose own shards the collectives here sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainyard.dist import DistContext
from trainyard.parallel.clipping import scale_to_max_norm
from trainyard.parallel.pipeline import (
    Pipeline,
    Stage,
    build_pipeline,
    local_part,
    stage_tensors,
)

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MicroBatchLoss:
    """The pipeline's loss function: a micro-batch's summed loss times the update's scale
    (its share of the update), for the loss and scale of the batch being run."""

    def __init__(self) -> None:
        self.loss_sum: LossSum | None = None
        self.scale = 1.0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.loss_sum is not None, "PipelinedModel.train_step sets it"
        return self.loss_sum(outputs, targets) * self.scale


class PipelinedModel(nn.Module):
    def __init__(
        self,
        pipeline: Pipeline,
        data_group: Any | None,
        loss: MicroBatchLoss,
        replicas_averaged: int = 1,
    ) -> None:
        super().__init__()
        self.pipeline = pipeline  # not a module: its stages are not registered twice
        # The workers holding the same stages, whose gradients sync_gradients sums; None:
        # one replica, or replicas that FSDP reduces as it goes.
        self.data_group = data_group
        # The replicas FSDP averages the gradients over (1: summed by sync_gradients): an
        # update's loss is scaled up by it, to the same sum.
        self.replicas_averaged = replicas_averaged
        self.loss = loss  # what the pipeline's schedules call
        held = {id(t): t for stage in pipeline.stages for t in stage_tensors(stage)}
        for key, names in pipeline.names.items():  # in the whole model's order
            for name in names if key in held else ():
                _register(self, name, held[key])
        # The tensor-split or sharded ones (DTensors), found once: a plain pipeline has none
        # and so never pays a look at each parameter's gradient layout.
        self.split_parameters = [p for p in self.parameters() if hasattr(p, "device_mesh")]

    def forward(self, *args: Any) -> torch.Tensor:
        raise TypeError(
            "a pipelined model runs batch by batch through its schedule: call train_step or "
            "outputs, not the module"
        )

    def train(self, mode: bool = True) -> PipelinedModel:
        super().train(mode)
        for stage in self.pipeline.stages:  # dropout lives in the stages, not in this view
            stage.train(mode)
        return self

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_sum: LossSum,
        scale: float,
        bf16: bool = False,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch, each micro-batch's `loss_sum` (the sum over its
        rows, an objective's) times `scale` seeding its backward; the batch's summed loss
        (unscaled) on the worker holding the last stage, None on the others."""
        self.loss.loss_sum, self.loss.scale = loss_sum, scale
        autocast = torch.autocast(inputs.device.type, torch.bfloat16) if bf16 else nullcontext()
        with autocast:
            scaled = self.pipeline.step(inputs, targets)
        return None if scaled is None else scaled.detach() / scale

    def outputs(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs on the worker holding the last stage, None on the others."""
        return self.pipeline.outputs(inputs)

    def sync_gradients(self) -> None:
        """Once an update's batches are all in: each shared parameter's gradient summed over
        the workers holding it, then every gradient summed over the replicas."""
        for parameter in self.split_parameters:
            _lay_out_as_parameter(parameter)
        self.pipeline.tie_gradients()
        if self.data_group is None:
            return
        grads = [local_part(p.grad) for p in self.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)  # one all-reduce, not one each
        dist.all_reduce(flat, group=self.data_group)
        for grad, summed in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(summed)

    def batch_loss(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss for the batch on every worker of the pipeline (one tiny
        all-reduce): what each worker's meter and log show."""
        shared = torch.zeros((), device=device) if loss is None else loss.float()
        dist.all_reduce(shared, group=self.pipeline.group)
        return shared

    def clip_gradients(self, max_norm: float) -> None:
        """As torch.nn.utils.clip_grad_norm_ on the whole model: the norm over every stage's
        gradients, a shared parameter's once."""
        squares = torch.zeros((), device=self.pipeline.device)
        for parameter in self.pipeline.counted_parameters():
            if parameter.grad is not None:
                own = parameter.grad.detach().float().pow(2).sum()
                # A split or sharded one's (a DTensor): the squares of every worker holding
                # a part. Duck-typed, as local_part is: a plain pipeline imports no DTensor.
                whole = getattr(own, "full_tensor", None)
                squares += own if whole is None else whole()
        dist.all_reduce(squares, group=self.pipeline.group)
        scale_to_max_norm(self.parameters(), math.sqrt(squares.item()), max_norm)


def pipelined(
    model: nn.Module,
    ctx: DistContext,
    stages: int,
    schedule: str,
    microbatches: int,
    strategy: str = "ddp",
    tensor: int = 1,
    shapes: nn.Module | None = None,
) -> PipelinedModel:
    """This worker's part of `model` cut into `stages`, each split across `tensor` workers.
    Neighbouring ranks form a tensor-parallel group, neighbouring groups a pipeline (one
    model replica); the ranks holding the same part of each replica are its data-parallel
    group, along which `strategy` applies: ddp sums the replicas' gradients, fsdp shards
    each stage across them. `shapes`: the same model on the meta device (see
    build_pipeline), which a sharded pipeline needs."""
    # Imported here: the device mesh's module takes about a second, which DDP never pays.
    from torch.distributed.device_mesh import init_device_mesh

    data = ctx.world_size // (stages * tensor)
    names = ("data", "pipeline", "tensor")
    mesh = init_device_mesh(ctx.device.type, (data, stages, tensor), mesh_dim_names=names)
    if tensor > 1:  # the whole model, before it is cut: the plan names its layers so
        # Imported here: DTensor's modules take about a second, which only a split pays.
        from trainyard.parallel.tensor import tensor_parallel

        tensor_parallel(model.to(ctx.device), mesh["tensor"])
    sharded = strategy == "fsdp" and data > 1
    if sharded and shapes is None:
        raise ValueError("an FSDP-sharded pipeline traces its stages' shapes: pass shapes")
    shard = partial(_fully_shard, mesh=mesh["data"]) if sharded else None
    loss = MicroBatchLoss()
    group = mesh["pipeline"].get_group()
    pipeline = build_pipeline(model, group, schedule, microbatches, loss, ctx.device, shard, shapes)
    if sharded:
        return PipelinedModel(pipeline, None, loss, replicas_averaged=data)
    return PipelinedModel(pipeline, mesh["data"].get_group() if data > 1 else None, loss)


def _lay_out_as_parameter(parameter: Any) -> None:
    """A split parameter's gradient in its parameter's layout: a tensor-split embedding's
    comes back whole (DTensor's rule for its backward), and the collectives here sum each
    worker's own shard. `parameter`: a DTensor (PipelinedModel.split_parameters), typed Any
    so that a plain pipeline need not import DTensor's modules."""
    grad = parameter.grad
    placements = getattr(grad, "placements", None)  # None: no gradient, or a plain one
    if placements is not None and placements != parameter.placements:
        parameter.grad = grad.redistribute(parameter.device_mesh, parameter.placements)


def _fully_shard(stage: Stage, mesh: Any) -> None:
    """FSDP2 across the stage's replicas: each of its pieces a unit, then the stage. A unit
    is gathered at a batch's first micro-batch and kept whole until its last backward, when
    the schedule reduce-scatters its gradients (torch.distributed.pipelining knows FSDP
    modules): one gather and one reduce-scatter a batch, however many micro-batches each
    replica's rows make (a replica's last batch may have a row more than another's)."""
    # Imported here: FSDP's modules take about a second to import, which DDP never pays.
    from torch.distributed.fsdp import fully_shard

    for piece in stage.pieces:
        fully_shard(piece, mesh=mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False)


def _register(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`tensor` at `name` (dotted) under `root`, making the modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]  # type: ignore[assignment]
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor)
