from __future__ import annotations

import torch
import torch.nn.functional as F

from trainyard.objectives.base import Objective


class Classification(Objective):
    """Single-label classification: cross-entropy; accuracy and mean loss."""

    name = "classification"
    target_kind = "class"
    metrics = ("accuracy", "loss")
    modes = {"accuracy": "max", "loss": "min"}
    default_monitor = "accuracy"
    num_sums = 3  # correct, loss, rows

    @property
    def num_outputs(self) -> int:
        if not self.stats.num_classes:
            raise ValueError("classification needs the number of classes")
        return self.stats.num_classes

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, reduction="sum")

    def batch_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [
                (outputs.argmax(dim=1) == targets).sum().double(),
                F.cross_entropy(outputs, targets, reduction="sum").double(),
                torch.tensor(float(len(targets)), dtype=torch.float64, device=outputs.device),
            ]
        )

    def predictions(
        self, outputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        probabilities = F.softmax(outputs.float(), dim=1)
        return {"prediction": outputs.argmax(dim=1), "probabilities": probabilities}

    def finish(self, sums: list[float]) -> dict[str, float]:
        correct, loss, rows = sums
        return {"accuracy": correct / rows, "loss": loss / rows}
