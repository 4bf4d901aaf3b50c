"""Tensor parallelism (Megatron-style, through DTensor's `parallelize_module`): a model's
layers split across the workers of a tensor-parallel group, as the model's own plan says.

A model declares `tensor_plan(degree) -> {module name pattern: style}` (trainyard.models.zoo's
transformer does). Styles: "columns" splits a Linear by output, so each worker computes its
slice (whole heads, a slice of the MLP's hidden layer) with no communication; "rows" splits
one by input and ends in an all-reduce; on an Embedding, "rows" splits the vocabulary;
"columns_gathered" splits by output, then gathers the whole output (the logits, so the loss
and everything after it is computed as without parallelism). Parameters the model shares
between modules (a head tied to the token embedding) stay one parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from trainyard.parallel.clipping import scale_to_max_norm

STYLES = ("columns", "rows", "columns_gathered")


def tensor_plan(model: nn.Module, degree: int) -> dict[str, str]:
    """The model's plan for `degree` workers; ValueError, saying why, where it has none or
    cannot be split so (the caller words it as a settings error)."""
    declared = getattr(model, "tensor_plan", None)
    if not callable(declared):
        raise ValueError(
            f"the model ({type(model).__name__}) declares no tensor_plan(degree), which says "
            "how its layers split: use model.name transformer, or add the method to yours "
            "(docs/data-and-models.md)"
        )
    plan = declared(degree)
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ValueError(f"tensor_plan() names unknown styles {unknown}: use {list(STYLES)}")
    return dict(plan)


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split `model` in place across `mesh`, the 1-D mesh of a tensor-parallel group."""
    plan = tensor_plan(model, mesh.size())
    shared = _shared_parameters(model)
    styles = {pattern: _style(model, pattern, style) for pattern, style in plan.items()}
    parallelize_module(model, mesh, styles)
    for names in shared:  # each module got its own copy: one parameter again, as before
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    return model


def _style(model: nn.Module, pattern: str, style: str) -> ParallelStyle:
    if style == "columns":
        return ColwiseParallel()
    if style == "columns_gathered":
        return ColwiseParallel(output_layouts=Replicate())
    # rows: an Embedding reads whole token ids, a Linear its input's slice from "columns".
    embedding = any(isinstance(module, nn.Embedding) for name, module in _matching(model, pattern))
    return RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel()


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    parts = pattern.split(".")
    return [
        (name, module)
        for name, module in model.named_modules()
        if len(name.split(".")) == len(parts)
        and all(p in ("*", n) for p, n in zip(parts, name.split("."), strict=True))
    ]


def _shared_parameters(model: nn.Module) -> list[list[str]]:
    """Names of each parameter that more than one module holds."""
    names: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            names.setdefault(id(param), []).append(f"{module_name}.{attr}".lstrip("."))
    return [group for group in names.values() if len(group) > 1]


def clip_gradients(parameters: list[nn.Parameter], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ for a split model: its gradients live on two meshes
    (the split layers' 2-D one, the rest's data-parallel one), which that function cannot
    stack, so each gradient's norm is made whole (a collective each) before they are."""
    norms = []
    for parameter in parameters:
        if parameter.grad is not None:
            norm = torch.linalg.vector_norm(parameter.grad.detach(), 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0).item()
    scale_to_max_norm(parameters, total, max_norm)
