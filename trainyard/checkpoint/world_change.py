"""An exact resume at another world size: how the global batch is cut there, and where in the
epoch the run goes on (the rule is in trainyard.checkpoint.resume's docstring).

A global step reads the same rows of the epoch's permutation at any world size with the
same global batch (trainyard.data.sharding), so keeping the checkpoint's global batch keeps
the position exact: nothing skipped, nothing read twice. Only a global batch the new world
size cannot divide changes, to the nearest one it can; the position is then the last step
boundary at or before the rows already read, and the resume counts the rows read again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainyard.config import TrainConfig
from trainyard.data.sharding import ShardedBatches
from trainyard.runs.contracts import CheckpointManifest


@dataclass(frozen=True)
class Geometry:
    """How one update's global batch is cut: each worker's rows, read in micro-batches."""

    world_size: int
    rows_per_worker: int  # of one update, on each rank
    grad_accum_steps: int  # micro-batches those rows are read in

    @property
    def global_batch_size(self) -> int:
        return self.rows_per_worker * self.world_size

    @classmethod
    def of(cls, train: TrainConfig, world_size: int) -> Geometry:
        """What the run's own settings say at `world_size`."""
        rows = train.batch_size * train.grad_accum_steps
        return cls(world_size, rows, train.grad_accum_steps)


@dataclass(frozen=True)
class WorldChange:
    """A resume at another world size: the geometry it continues with and where."""

    geometry: Geometry
    step_in_epoch: int  # where the epoch goes on, in the new geometry's steps
    details: dict[str, Any]  # what the run record's resumes entry says about it

    @property
    def exact(self) -> bool:
        return self.details["samples_skipped"] == 0 and self.details["samples_repeated"] == 0


def continued_geometry(global_batch: int, world_size: int, train: TrainConfig) -> Geometry:
    """The global batch `global_batch` at `world_size`: the settings' own geometry when it
    is that already; else each worker's share of it, read in as few micro-batches as keep
    each within train.batch_size. A share that is not whole becomes the nearest that is."""
    own = Geometry.of(train, world_size)
    if own.global_batch_size == global_batch:
        return own
    rows = max(1, round(global_batch / world_size))
    return Geometry(world_size, rows, math.ceil(rows / train.batch_size))


def plan_world_change(
    manifest: CheckpointManifest, world_size: int, train: TrainConfig, num_rows: int
) -> WorldChange | None:
    """How an exact resume of `manifest`'s checkpoint goes on at `world_size` (None: at the
    checkpoint's own geometry, where nothing changes). At the checkpoint's world size the
    batch may still be cut otherwise than the settings say: an elastic run that lost nodes
    keeps its global batch on fewer workers, and goes on so after a restart there."""
    own = Geometry.of(train, world_size)
    if (manifest.data_workers, manifest.global_batch_size) == (world_size, own.global_batch_size):
        return None
    saved = manifest.global_batch_size
    before = Geometry(manifest.data_workers, saved // manifest.data_workers, 1)
    after = continued_geometry(saved, world_size, train)
    return world_change(before, after, num_rows, train.seed, manifest.step_in_epoch)


def world_change(
    before: Geometry, after: Geometry, num_rows: int, seed: int, step_in_epoch: int
) -> WorldChange:
    """Where a run that had done `step_in_epoch` steps of an epoch in `before` goes on in
    `after`, and the rows of that epoch it thereby skips or reads again."""
    old = ShardedBatches(num_rows, before.rows_per_worker, before.world_size, 0, seed)
    new = ShardedBatches(num_rows, after.rows_per_worker, after.world_size, 0, seed)
    read = old.rows_read(step_in_epoch)
    step = new.step_after(read)
    reread = new.rows_read(step)
    details = {
        "world_size_before": before.world_size,
        "world_size_after": after.world_size,
        "global_batch_before": before.global_batch_size,
        "global_batch_after": after.global_batch_size,
        "rows_per_worker": after.rows_per_worker,
        "grad_accum_steps": after.grad_accum_steps,
        "samples_skipped": max(0, reread - read),
        "samples_repeated": max(0, read - reread),
    }
    return WorldChange(after, step, details)


def same_world(world_size: int) -> dict[str, Any]:
    """A resume entry's world-size fields when the world size stayed."""
    return {
        "world_size_before": world_size,
        "world_size_after": world_size,
        "samples_skipped": 0,
        "samples_repeated": 0,
    }


def change_text(change: WorldChange) -> str:
    """One line saying what a resume at another world size changed."""
    d = change.details
    text = (
        f"resuming at world size {d['world_size_after']} (checkpoint: "
        f"{d['world_size_before']}): each worker reads {d['rows_per_worker']} rows an update "
        f"in {d['grad_accum_steps']} micro-batch(es)"
    )
    if d["global_batch_before"] != d["global_batch_after"]:
        text += (
            f"; the global batch {d['global_batch_before']} does not divide by "
            f"{d['world_size_after']} workers, it is {d['global_batch_after']} from here"
        )
    return text + (
        f"; {d['samples_skipped']} sample(s) of this epoch skipped, "
        f"{d['samples_repeated']} read again"
    )
