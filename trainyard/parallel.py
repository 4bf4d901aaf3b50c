"""The one place models get wrapped for distributed training."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainyard.dist import DistContext


def wrap_model(model: nn.Module, ctx: DistContext, strategy: str = "ddp") -> nn.Module:
    model = model.to(ctx.device)
    if strategy == "fsdp":
        # FSDP2: each layer with parameters is its own shard unit (its parameters are
        # gathered just before it runs), then the root; gradients are reduce-scattered and
        # averaged over ranks, like DDP's all-reduce, so the loss scaling is the same.
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for module in model.modules():
            if module is not model and any(True for _ in module.parameters(recurse=False)):
                fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module (fully_shard works in place, so an FSDP model is its own)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
