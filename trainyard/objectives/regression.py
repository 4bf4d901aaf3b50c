from __future__ import annotations

import torch

from trainyard.objectives.base import Objective


class Regression(Objective):
    """One numeric target: MSE loss on the standardized target (so the learning rate does
    not depend on the target's units); MSE and MAE reported in the target's own units, R²."""

    name = "regression"
    target_kind = "value"
    metrics = ("mse", "mae", "r2", "loss")
    modes = {"mse": "min", "mae": "min", "r2": "max", "loss": "min"}
    default_monitor = "r2"
    num_sums = 5  # squared error, absolute error, target sum, target squared sum, rows

    @property
    def num_outputs(self) -> int:
        return 1

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ((outputs.squeeze(-1).float() - targets) ** 2).sum()

    def batch_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        error = outputs.squeeze(-1).double() - targets.double()
        y = targets.double()
        rows = torch.tensor(float(len(targets)), dtype=torch.float64, device=outputs.device)
        return torch.stack([(error**2).sum(), error.abs().sum(), y.sum(), (y**2).sum(), rows])

    def predictions(
        self, outputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        # Trained on the standardized target: back to its own units.
        standardized = outputs.squeeze(-1).double()
        return {"prediction": standardized * (self.stats.std or 1.0) + (self.stats.mean or 0.0)}

    def finish(self, sums: list[float]) -> dict[str, float]:
        squared, absolute, y_sum, y_squared, rows = sums
        scale = self.stats.std or 1.0
        total = y_squared - y_sum**2 / rows  # about the split's own mean, as R² defines it
        return {
            "mse": squared / rows * scale**2,
            "mae": absolute / rows * scale,
            "r2": 1.0 - squared / total if total > 0 else 0.0,
            "loss": squared / rows,
        }
