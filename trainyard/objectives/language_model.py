from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainyard.objectives.base import Objective


class LanguageModel(Objective):
    """Next-token prediction: cross-entropy per token; loss (nats per token) and perplexity.

    A sample is a window of tokens, so `loss_sum` adds each window's mean token loss: the
    loop's division by the global sample count is then the mean over every token of the
    global batch (all windows have the same length)."""

    name = "language_model"
    target_kind = "tokens"
    metrics = ("loss", "perplexity", "accuracy")
    modes = {"loss": "min", "perplexity": "min", "accuracy": "max"}
    default_monitor = "loss"
    num_sums = 3  # loss over tokens, correct next tokens, tokens

    @property
    def num_outputs(self) -> int:
        if not self.stats.num_classes:
            raise ValueError("a language model needs the vocabulary size")
        return self.stats.num_classes

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(
            outputs.flatten(0, 1).float(), targets.flatten(), reduction="sum"
        )
        return per_token / targets.shape[1]

    def batch_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, flat = outputs.flatten(0, 1).float(), targets.flatten()
        return torch.stack(
            [
                F.cross_entropy(logits, flat, reduction="sum").double(),
                (logits.argmax(dim=1) == flat).sum().double(),
                torch.tensor(float(flat.numel()), dtype=torch.float64, device=outputs.device),
            ]
        )

    def predictions(
        self, outputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Per window: the token the model predicts after it, and, given the window's own
        next tokens, its mean loss in nats per token (what evaluation averages)."""
        result = {"prediction": outputs[:, -1].argmax(dim=-1)}
        if targets is not None:
            per_token = F.cross_entropy(outputs.float().transpose(1, 2), targets, reduction="none")
            result["loss"] = per_token.mean(dim=1)
        return result

    def finish(self, sums: list[float]) -> dict[str, float]:
        loss, correct, tokens = sums
        mean = loss / tokens
        return {
            "loss": mean,
            "perplexity": math.exp(min(mean, 700.0)),
            "accuracy": correct / tokens,
        }
