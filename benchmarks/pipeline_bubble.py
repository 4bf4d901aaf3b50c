"""Pipeline bubble: the share of a step each stage of trainyard.parallel.pipeline sits idle,
measured, against the schedule's own (p - 1) / (m + p - 1) for p stages and m micro-batches
(GPipe and 1F1B alike; 1F1B holds fewer micro-batches' activations, not less idle time).

Each stage is one piece whose forward waits FORWARD_S and whose backward waits twice that
(a backward costs about two forwards), without using the CPU: p stages on a 2-core machine
then run as on p machines, and what is left idle is the schedule's, plus what sending the
activations between workers costs. A stage's busy time is what its piece's waits add up to;
idle is the rest of the step. Each run is a torchrun of p gloo workers on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import BenchProject, summary

FORWARD_S = 0.01
STEPS = 6  # the first is left out: the stages learn each other's shapes on it
BATCH, WIDTH = 16, 8


class _Wait(torch.autograd.Function):
    """Identity that waits in its forward and, twice as long, in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, busy: list[float]) -> torch.Tensor:
        ctx.busy = busy
        _wait(FORWARD_S, busy)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _wait(2 * FORWARD_S, ctx.busy)
        return grad, None


def _wait(seconds: float, busy: list[float]) -> None:
    time.sleep(seconds)
    busy[0] += seconds


class _Piece(nn.Module):
    def __init__(self, busy: list[float]) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.busy = busy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(self.linear(x), self.busy)


class _Pieces(nn.Module):
    def __init__(self, count: int, busy: list[float]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(_Piece(busy) for _ in range(count))

    def pipeline_stages(self) -> list[nn.Module]:
        return list(self.pieces)


def worker(schedule: str, microbatches: int, out: Path) -> None:
    """One stage of a torchrun: its idle share of each step after the first."""
    from trainyard.parallel.pipeline import build_pipeline

    dist.init_process_group("gloo")
    busy = [0.0]
    stages = dist.get_world_size()
    pipeline = build_pipeline(_Pieces(stages, busy), dist.group.WORLD, schedule, microbatches,
                              lambda out, target: out.pow(2).mean(), torch.device("cpu"))  # fmt: skip
    inputs = torch.randn(BATCH * microbatches, WIDTH)
    targets = torch.zeros(BATCH * microbatches, WIDTH)
    idle = []
    for step in range(STEPS):
        dist.barrier()
        busy[0], started = 0.0, time.perf_counter()
        pipeline.step(inputs, targets)
        dist.barrier()
        if step:
            idle.append(1 - busy[0] / (time.perf_counter() - started))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(idle))
    dist.destroy_process_group()


def _measure(schedule: str, stages: int, microbatches: int) -> list[float]:
    """Every stage's idle share of every step."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={stages}", "-m", "benchmarks.pipeline_bubble", schedule,
             str(microbatches), folder],
            check=True, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"},
            timeout=600,
        )  # fmt: skip
        return [v for path in Path(folder).glob("rank*.json") for v in json.loads(path.read_text())]


def run(project: BenchProject | None, quick: bool) -> dict:
    cases = [(2, 4)] if quick else [(p, m) for p in (2, 4) for m in (4, 8, 16)]
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for schedule in ("gpipe",) if quick else ("gpipe", "1f1b"):
        for stages, microbatches in cases:
            label = f"{schedule}, {stages} stages, {microbatches} micro-batches"
            idle = _measure(schedule, stages, microbatches)
            expected = (stages - 1) / (microbatches + stages - 1)
            figures[f"{label}: idle share of a step"] = summary(idle)
            ratios[f"{label}: idle / (p-1)/(m+p-1) = {expected:.3f}"] = (
                summary(idle)["median"] / expected
            )
    result: dict[str, Any] = {"figures": figures, "ratios": ratios}
    if quick:
        result["left_out"] = "1f1b, 4 stages, and 8 or 16 micro-batches (quick mode)"
    return result


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
