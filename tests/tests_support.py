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


class _Exploding(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        import os

        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1 exploded")
        return self.linear(x)


def exploding_model(in_features: int, num_classes: int) -> nn.Module:
    """Fails inside rank 1's forward pass, as a user's bug would."""
    return _Exploding(in_features, num_classes)
