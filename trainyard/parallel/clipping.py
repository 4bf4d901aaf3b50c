"""Gradient clipping for a model whose total gradient norm takes collectives to know (a
pipeline's stages, a tensor split's two meshes): each computes the norm its own way, then
scales as torch.nn.utils.clip_grad_norm_ does."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def scale_to_max_norm(
    parameters: Iterable[nn.Parameter], total_norm: float, max_norm: float
) -> None:
    """Scale every gradient by `max_norm / total_norm` where that is under 1 (with
    clip_grad_norm_'s 1e-6, so a run clips alike whichever way its model is laid out)."""
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.detach().mul_(coef)
