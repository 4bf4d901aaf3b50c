"""Which rows each worker reads, per epoch and step.

Every epoch is one seeded permutation of the training rows, cut into global batches of
`batch_size * world_size`; rank r takes every world_size-th row of each global batch. So the
shards are disjoint, together cover the split exactly once per epoch (no padding, nothing
dropped), every rank runs the same number of steps, and the state needed to resume is just
(epoch, step).

No rank's batch is ever empty. A last global batch of at least world_size rows gives every
rank one or more (shares differ by one row at most, and the loss is scaled by the global
count). A smaller remainder, 1 to world_size - 1 rows, could not: it joins the step before,
whose shares then hold batch_size or batch_size + 1 rows. PyTorch's DistributedSampler
would pad by repeating rows (counted twice) or drop them (never read); this keeps each row
once. Only that epoch's last step changes: every earlier step, and so a resume, is as before.

Step s of an epoch reads rows [s * G, (s + 1) * G) of its permutation (G the global batch;
the last step reads the rest) whatever the world size: rank r's share is the rows of that
range at positions r, r + W, ... So the position in an epoch is a count of rows read
(`rows_read`, `step_after`), and a resume at another world size with the same global batch
continues at the same row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trainyard.errors import DataError


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
        assert self.batch_size > 0
        if self.num_rows < self.world_size:
            raise DataError(
                f"the training split has {self.num_rows} row(s), fewer than the "
                f"{self.world_size} workers: every worker needs one; use fewer workers "
                "(train.workers) or more data"
            )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        full, remainder = divmod(self.num_rows, self.global_batch_size)
        # A remainder too small to give every rank a row joins the last full step (there is
        # one: num_rows >= world_size, so a split smaller than a global batch is no such case).
        return full + (1 if remainder >= self.world_size else 0)

    @property
    def folded_rows(self) -> int:
        """Rows of each epoch that join its last full step (0 when none do)."""
        remainder = self.num_rows % self.global_batch_size
        return remainder if remainder < self.world_size else 0

    def rows_read(self, steps: int) -> int:
        """Rows of an epoch its first `steps` steps read, on all ranks together."""
        return self.num_rows if steps >= self.steps_per_epoch else steps * self.global_batch_size

    def step_after(self, rows: int) -> int:
        """The last step boundary at or before `rows` read rows of an epoch: where a run that
        had read that many continues (the rows past the boundary are read again)."""
        if rows >= self.num_rows:
            return self.steps_per_epoch
        return min(rows // self.global_batch_size, self.steps_per_epoch - 1)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_rows, generator=generator)
        # Every world_size-th row from rank's: step s's share of its global batch is the
        # s-th run of batch_size of them, one slice a step; the last step takes the rest.
        mine = order[self.rank :: self.world_size]
        size, batch, last = self.global_batch_size, self.batch_size, self.steps_per_epoch - 1
        for step in range(start_step, last):
            yield Batch(mine[step * batch : (step + 1) * batch], size)
        if start_step <= last:
            yield Batch(mine[last * batch :], self.num_rows - last * size)
