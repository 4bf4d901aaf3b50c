"""17. Parameter server: throughput and staleness when workers' speeds differ.

Two workers on one machine train the digits MLP under `train.sync` allreduce and
parameter_server (max_staleness 4 and 64), the same data, seed and epochs, in two cases:
- one worker slowed 2x: every training step of rank 1 sleeps twice as long as rank 0's;
- steps that jitter: each step of each worker sleeps the base time, and one step in four
  (each worker's own draw) four times more, so on average both are equally fast.

Per arm: samples per second over the training (both workers' rows over the epochs'
training seconds), the pushes by staleness, the seconds each rank waited on communication
and the test accuracy. Ratios: each parameter-server arm's samples/s over allreduce's in the
same case. The sleeps stand in for compute, so the ratios show what waiting costs, not what
two machines' cores would do.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from typing import Any

from torch import nn

from benchmarks.common import REPO, BenchProject, run_trainyard_worker, summary

STEP_S = 0.02  # the sleep every training step takes, standing in for its compute
CASES = {
    "one worker slowed 2x": {"slow_rank_factor": 2.0, "jitter": 0.0},
    "steps that jitter": {"slow_rank_factor": 1.0, "jitter": 0.25},
}
ARMS = {
    "allreduce": ["train.sync=allreduce"],
    "parameter_server, max_staleness 4": ["train.sync=parameter_server", "train.max_staleness=4"],
    "parameter_server, max_staleness 64": [
        "train.sync=parameter_server",
        "train.max_staleness=64",
    ],
}


class _Uneven(nn.Module):
    """Sleeps in each training forward: `step_s` x `factor`, and with probability `jitter`
    (this worker's own draws) four times more."""

    def __init__(self, inner: nn.Module, step_s: float, factor: float, jitter: float) -> None:
        super().__init__()
        self.inner, self.step_s, self.factor, self.jitter = inner, step_s, factor, jitter
        self.draws = random.Random(int(os.environ.get("RANK", "0")))

    def forward(self, x):
        if self.training:
            extra = 4 if self.draws.random() < self.jitter else 0
            time.sleep(self.step_s * (self.factor + extra))
        return self.inner(x)


def uneven_mlp(
    in_features: int,
    num_classes: int,
    step_s: float = STEP_S,
    slow_rank_factor: float = 1.0,
    jitter: float = 0.0,
) -> nn.Module:
    """benchmarks.parameter_server:uneven_mlp: the digits MLP whose steps sleep, rank 1's
    `slow_rank_factor` times longer."""
    slow = int(os.environ.get("RANK", "0")) == 1
    inner = nn.Sequential(
        nn.Linear(in_features, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )  # fmt: skip
    return _Uneven(inner, step_s, slow_rank_factor if slow else 1.0, jitter)


def run(project: BenchProject, quick: bool) -> dict:
    epochs = 2 if quick else 6
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    staleness: dict[str, dict[str, int]] = {}  # pushes by staleness, per arm
    run_ids = (f"bench-ps-{n}" for n in itertools.count())
    for case, options in CASES.items():
        model = "{" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}"
        common = [
            "model.name=benchmarks.parameter_server:uneven_mlp",
            f"model.options={model}",
            "train.workers=2",
            f"train.epochs={epochs}",
            f"checkpoint.every_n_epochs={epochs}",
        ]
        arms = {
            arm: _arm(project, [*common, *settings], next(run_ids))
            for arm, settings in ARMS.items()
        }
        for arm, measured in arms.items():
            if pushes := measured.pop("staleness"):
                staleness[f"{case}, {arm}"] = pushes
            figures.update({f"{case}, {arm}, {k}": summary([v]) for k, v in measured.items()})
            if arm != "allreduce":
                base = arms["allreduce"]["samples/s"]
                ratios[f"{case}, {arm} / allreduce, samples/s"] = measured["samples/s"] / base
    return {
        "figures": figures,
        "ratios": ratios,
        "pushes_by_staleness": staleness,
        "step_s": STEP_S,
        "epochs": epochs,
    }


def _arm(project: BenchProject, overrides: list[str], run_id: str) -> dict[str, Any]:
    training = run_trainyard_worker(project, overrides, run_id, env={"PYTHONPATH": str(REPO)})
    history = training["history"]
    rows = sum(row["rows"] for row in history) * 2  # rank 0's share x the two workers
    communication = training["communication"] or {}
    return {
        "samples/s": rows / sum(row["train_s"] for row in history),
        "wait s, most of any rank": max(communication.get("wait_s_per_rank") or [0.0]),
        "test accuracy": training["evaluation"]["metrics"]["accuracy"],
        "staleness": communication.get("staleness"),
    }
