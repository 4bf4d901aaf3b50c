"""Which rows each worker reads, per epoch and step.

Every epoch is one seeded permutation of the training rows, cut into global batches of
`batch_size * world_size`; rank r takes every world_size-th row of each global batch. So the
shards are disjoint, together cover the split exactly once per epoch (no padding), every rank
runs the same number of steps (a rank may get a short or empty last batch), and the state
needed to resume is just (epoch, step).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor  # rows this rank reads
    global_count: int  # rows all ranks read in this step, for an exact mean loss


@dataclass(frozen=True)
class ShardedBatches:
    num_rows: int
    batch_size: int  # per worker
    world_size: int
    rank: int
    seed: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, "rank must lie in [0, world_size)"
        assert self.num_rows > 0 and self.batch_size > 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.global_batch_size)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_rows, generator=generator)
        # Every world_size-th row from rank's: step s's share of its global batch is the
        # s-th run of batch_size of them, one slice a step.
        mine = order[self.rank :: self.world_size]
        size, batch = self.global_batch_size, self.batch_size
        for step in range(start_step, self.steps_per_epoch):
            global_count = min(size, self.num_rows - step * size)
            yield Batch(mine[step * batch : (step + 1) * batch], global_count)
