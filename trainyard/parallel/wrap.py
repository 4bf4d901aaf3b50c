"""The one place models get wrapped for distributed training."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainyard.dist import DistContext


def wrap_model(
    model: nn.Module, ctx: DistContext, strategy: str = "ddp", tensor: int = 1
) -> nn.Module:
    model = model.to(ctx.device)
    if tensor > 1:
        return _tensor_parallel(model, ctx, strategy, tensor)
    if strategy == "fsdp":
        # FSDP2: each block the model declares (`shard_units()`, a transformer's layers) is
        # its own unit, whose parameters are gathered just before it runs, then the root,
        # which holds the rest. Gradients are reduce-scattered and averaged over ranks, like
        # DDP's all-reduce, so the loss scaling is the same.
        # Imported here: FSDP's modules take about a second to import, which DDP never pays.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        declared = getattr(model, "shard_units", None)
        for unit in declared() if callable(declared) else ():
            fully_shard(unit, mesh=mesh)
        return cast(nn.Module, fully_shard(model, mesh=mesh))  # the same module, sharded
    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _tensor_parallel(model: nn.Module, ctx: DistContext, strategy: str, tensor: int) -> nn.Module:
    """Split the model across each tensor-parallel group (neighbouring ranks, on one machine
    where they fit), then data-parallel across the groups: `ddp` replicates it with FSDP2's
    replicate (DDP that takes DTensor parameters), `fsdp` shards it."""
    # Imported here: DTensor and FSDP's modules take about a second to import.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainyard.parallel.tensor import tensor_parallel

    data = ctx.world_size // tensor
    mesh = init_device_mesh(ctx.device.type, (data, tensor), mesh_dim_names=("data", "tensor"))
    tensor_parallel(model, mesh["tensor"])
    if data == 1:
        return model
    if strategy == "fsdp":
        declared = getattr(model, "shard_units", None)
        for unit in declared() if callable(declared) else ():
            fully_shard(unit, mesh=mesh["data"])
        return cast(nn.Module, fully_shard(model, mesh=mesh["data"]))
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return cast(nn.Module, replicate(model, mesh=mesh["data"]))


def no_gradient_sync(model: nn.Module) -> AbstractContextManager[None]:
    """Within it, a backward pass only accumulates gradients (no all-reduce or
    reduce-scatter): every micro-batch of an update but its last one."""
    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync()
    if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(inner)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    """`model` is an FSDPModule, not named here: importing FSDP costs about a second."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module: under torch.compile's and DDP's wrappers (fully_shard works in
    place, so an FSDP model is its own)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model
