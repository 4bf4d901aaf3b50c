"""The task seam. A task turns model outputs and targets into a loss and into metrics that
are exact across ranks: each batch gives sums, the sums are all-reduced, then finished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

Mode = Literal["max", "min"]


@dataclass(frozen=True)
class TargetStats:
    """What a task knows about the targets, from the training split (it travels in the
    split's schema and the checkpoint manifest)."""

    num_classes: int | None = None  # classification: classes; language model: vocabulary
    mean: float | None = None  # regression: targets are trained standardized
    std: float | None = None


class Objective:
    name: ClassVar[str]
    target_kind: ClassVar[Literal["class", "value", "tokens"]]
    metrics: ClassVar[tuple[str, ...]]  # what `finish` returns, in order
    modes: ClassVar[dict[str, Mode]]  # the direction of each metric
    default_monitor: ClassVar[str]
    num_sums: ClassVar[int]  # length of `batch_sums`'s vector

    def __init__(self, stats: TargetStats | None = None):
        self.stats = stats or TargetStats()

    @property
    def num_outputs(self) -> int:
        raise NotImplementedError

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss summed over the batch (the loop scales it to the global batch's mean)."""
        raise NotImplementedError

    def batch_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """float64 sums over the batch that `finish` turns into metrics."""
        raise NotImplementedError

    def finish(self, sums: list[float]) -> dict[str, float]:
        raise NotImplementedError

    def predictions(
        self, outputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """What batch inference writes per row, in the task's own terms: "prediction" (a
        class index, a value in the target's units, or a language model's next token) and,
        for classes, "probabilities". A language model is also given its windows' targets."""
        raise NotImplementedError(f"the {self.name} task has no per-row predictions")

    def mode(self, metric: str) -> Mode:
        if metric not in self.modes:
            raise ValueError(
                f"task.monitor = {metric!r}: the {self.name} task has no such metric "
                f"(it has {', '.join(self.metrics)})"
            )
        return self.modes[metric]

    def better(self, metric: str, a: float, b: float) -> bool:
        """Whether `a` is better than `b` on `metric`."""
        return a > b if self.mode(metric) == "max" else a < b
