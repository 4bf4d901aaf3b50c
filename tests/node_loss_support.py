"""A model for tests/flows/test_node_loss.py, which the training workers import by name
(`node_loss_support:alone_held_mlp`; tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

# The file whose existence holds a run's training while its world is one worker.
HOLD_ENV = "TRAINYARD_TEST_ALONE_HOLD"
# The file that holds a run's training while its world spans nodes: it says how many
# micro-batches each worker may train so (from its start); where it is missing, any number.
GATE_ENV = "TRAINYARD_TEST_ACROSS_GATE"


def _allowed_across() -> int | None:
    gate = os.environ.get(GATE_ENV)
    try:
        return int(Path(gate).read_text()) if gate else None
    except FileNotFoundError:
        return None


class _AloneHeld(nn.Module):
    def __init__(self, inner: nn.Module, seconds: float, alone_batches: int) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = seconds
        self.alone_batches = alone_batches
        self.batches_alone = 0
        self.batches_across = 0

    def forward(self, x):
        if self.training:
            time.sleep(self.seconds)
            world = os.environ.get("WORLD_SIZE")
            if world == "1":
                self.batches_alone += 1
                hold = os.environ.get(HOLD_ENV)
                while self.batches_alone > self.alone_batches and hold and Path(hold).exists():
                    time.sleep(0.05)
            elif world != os.environ.get("LOCAL_WORLD_SIZE"):  # across nodes
                self.batches_across += 1
                while (allowed := _allowed_across()) is not None and self.batches_across > allowed:
                    time.sleep(0.05)
        return self.inner(x)


def alone_held_mlp(
    in_features: int, num_classes: int, seconds: float = 0.04, alone_batches: int = 30
) -> nn.Module:
    """node_loss_support:alone_held_mlp: tests_support:slow_mlp's MLP, whose steps take at
    least `seconds`; a worker alone in its world (WORLD_SIZE 1) trains `alone_batches`
    micro-batches (15 steps of a 2-worker run's global batch), then waits before each further
    one while the file named by $TRAINYARD_TEST_ALONE_HOLD exists: an elastic run that lost a
    host is still training when the host comes back, however long that takes. A worker whose
    world spans nodes trains as many micro-batches as the file named by
    $TRAINYARD_TEST_ACROSS_GATE allows: a test loses a host while the run has steps left, on a
    machine however fast or busy."""
    inner = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))
    return _AloneHeld(inner, seconds, alone_batches)
