"""The one place models get wrapped for distributed training."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainyard.dist import DistContext


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    model = model.to(ctx.device)
    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
