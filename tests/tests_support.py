"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

from torch import nn


def write_params(folder: Path, text: str) -> Path:
    path = folder / "params.yaml"
    path.write_text(text)
    return path


def tiny_model(in_features: int, num_classes: int, width: int = 4) -> nn.Module:
    """A user-supplied factory, referenced as tests_support:tiny_model."""
    return nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))
