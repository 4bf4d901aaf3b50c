"""A resume at another world size: the global batch it keeps, the row of the epoch it goes on
at, and what it says when it cannot keep them (the real sampler, no processes)."""

from __future__ import annotations

import torch

from trainyard.checkpoint.world_change import (
    Geometry,
    change_text,
    continued_geometry,
    world_change,
)
from trainyard.config import config_from_dict
from trainyard.data.sharding import ShardedBatches


def train_settings(**train):
    return config_from_dict({"train": train}).train


def step_rows(num_rows: int, rows_per_worker: int, world_size: int) -> list[list[int]]:
    """Each step's rows of epoch 3, all ranks together, sorted."""
    ranks = [
        list(ShardedBatches(num_rows, rows_per_worker, world_size, rank, seed=7).epoch(3))
        for rank in range(world_size)
    ]
    return [
        sorted(torch.cat([b.indices for b in step]).tolist()) for step in zip(*ranks, strict=True)
    ]


def test_a_step_reads_the_same_rows_at_any_world_size_with_the_same_global_batch():
    # (A remainder smaller than the world size folds into the step before: see the last test.)
    for num_rows in (100, 116, 64):
        one = step_rows(num_rows, 16, 1)
        assert sorted(row for step in one for row in step) == list(range(num_rows))
        assert step_rows(num_rows, 8, 2) == one
        assert step_rows(num_rows, 4, 4) == one


def test_the_global_batch_is_kept_by_accumulating_or_by_the_runs_own_settings():
    two_by_16 = Geometry(2, 16, 1)
    # 1 worker with train.batch_size 16: 32 rows an update in 2 micro-batches.
    assert continued_geometry(32, 1, train_settings(batch_size=16)) == Geometry(1, 32, 2)
    # The settings already give 32 at one worker: they are kept.
    assert continued_geometry(32, 1, train_settings(batch_size=32)) == Geometry(1, 32, 1)
    # Back to 2 workers from 1 x 16 x 2 micro-batches: 16 rows each, one micro-batch.
    settings = train_settings(batch_size=16, grad_accum_steps=2)
    assert continued_geometry(32, 2, settings) == two_by_16
    change = world_change(two_by_16, Geometry(1, 32, 2), 1000, seed=7, step_in_epoch=5)
    assert change.step_in_epoch == 5 and change.exact
    assert change.details["world_size_before"] == 2 and change.details["world_size_after"] == 1


def test_a_global_batch_that_does_not_divide_becomes_the_nearest_and_says_what_it_redoes():
    after = continued_geometry(32, 3, train_settings(batch_size=16))
    assert after == Geometry(3, 11, 1) and after.global_batch_size == 33
    change = world_change(Geometry(2, 16, 1), after, 1000, seed=7, step_in_epoch=5)
    # 160 rows were read; step 4 of 33 has read 132: the 28 rows after it are read again.
    assert change.step_in_epoch == 4 and not change.exact
    assert change.details["samples_repeated"] == 28 and change.details["samples_skipped"] == 0
    assert change.details["global_batch_before"] == 32
    assert change.details["global_batch_after"] == 33
    text = change_text(change)
    assert "global batch 32 does not divide by 3 workers, it is 33" in text
    assert "28 read again" in text


def test_an_epoch_whose_last_step_folds_otherwise_counts_the_rows_it_reads_again():
    # 97 rows, global batch 16: 1 worker reads 6 full steps and a 7th of 1 row, 2 workers
    # fold that row into the 6th (one row cannot be cut in two).
    assert ShardedBatches(97, 16, 1, 0, 7).steps_per_epoch == 7
    assert ShardedBatches(97, 8, 2, 0, 7).steps_per_epoch == 6
    change = world_change(Geometry(1, 16, 1), Geometry(2, 8, 1), 97, seed=7, step_in_epoch=6)
    assert change.step_in_epoch == 5 and change.details["samples_repeated"] == 16
    done = world_change(Geometry(1, 16, 1), Geometry(2, 8, 1), 97, seed=7, step_in_epoch=7)
    assert done.step_in_epoch == 6 and done.exact  # the epoch was read whole
