"""Reading ahead changes where a batch is read, never which: the same micro-batches in the
same order (mid-epoch starts too), a dataset's error reaches the training thread as itself,
and no reader thread outlives training."""

from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch
import torch.distributed as dist

from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data import tensors
from trainyard.data.prefetch import THREAD_NAME, prefetched, step_reader
from trainyard.data.sharding import ShardedBatches
from trainyard.data.split import prepare_splits
from trainyard.data.tables import write_digits
from trainyard.data.tensors import load_split
from trainyard.datasets.base import MapDataset
from trainyard.dist import DistContext
from trainyard.engine.hooks import Hook
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.errors import DataError
from trainyard.objectives import Classification, TargetStats


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits table's train and val splits, as workers read them (memory-mapped)."""
    folder = tmp_path_factory.mktemp("digits")
    config = TrainyardConfig()
    write_digits(folder / "digits.csv")
    schema = prepare_splits(config.data, config.split, folder / "digits.csv", folder / "processed")
    return (
        load_split(folder / "processed", "train", schema),
        load_split(folder / "processed", "val", schema),
    )


@pytest.fixture(autouse=True)
def streamed(monkeypatch):
    """The digits table stands for one too large to hold: training reads it from its
    arrays, as these tests are about reading."""
    monkeypatch.setattr(tensors, "HOST_RESIDENT_BYTES", 0)


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


CORES = len(os.sched_getaffinity(0))
# One worker with one intra-op thread leaves the reader a core only on 2 or more.
needs_a_free_core = pytest.mark.skipif(CORES < 2, reason="needs 2 cores")


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def read_epoch(split, start_step: int, ahead: bool) -> list[tuple[list[int], list]]:
    batches = ShardedBatches(len(split), 96, world_size=2, rank=1, seed=7)
    read = step_reader(split, pieces=3)  # grad accumulation: 3 micro-batches
    with prefetched(batches.epoch(2, start_step=start_step), read, enabled=ahead) as steps:
        return [(batch.indices.tolist(), pieces) for batch, pieces in steps]


@pytest.mark.parametrize("start_step", [0, 4])
def test_a_prefetched_epoch_reads_the_very_batches_of_a_synchronous_one(digits, start_step):
    ahead, synchronous = (read_epoch(digits[0], start_step, flag) for flag in (True, False))
    assert len(ahead) == len(synchronous) == 7 - start_step  # 1,257 rows / 192 a step
    for (rows, pieces), (want_rows, want_pieces) in zip(ahead, synchronous, strict=True):
        assert rows == want_rows
        assert len(pieces) == len(want_pieces) == 3
        for got, want in zip(pieces, want_pieces, strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not readers()


class BadRow(MapDataset):
    """Digits with one unreadable row, as a damaged file would have: take raises DataError.
    It notes the threads that read it."""

    def __init__(self, base: MapDataset, bad: int):
        self.base, self.bad, self.read_by = base, bad, set[int]()

    def __len__(self) -> int:
        return len(self.base)

    def take(self, indices):
        self.read_by.add(threading.current_thread().name)
        if self.bad in indices.tolist():
            raise DataError(f"row {self.bad}: unreadable")
        return self.base.take(indices)

    @property
    def spec(self):
        return self.base.spec


def train_digits(group, train_split, val_split, hooks=(), threads=1, **settings):
    config = TrainyardConfig.model_validate(
        {"train": {"workers": 1, "epochs": 2, "batch_size": 64, **settings}}
    )
    torch.set_num_threads(threads)
    try:
        return train(
            group, config, train_split, val_split, Classification(TargetStats(10)),
            NullTracker(0), NullCheckpointWriter(), {}, extra_hooks=hooks,
        )  # fmt: skip
    finally:
        torch.set_num_threads(1)


class _CountsSteps(Hook):
    def __init__(self):
        self.steps = 0

    def on_step(self, state):
        self.steps = state.steps


@needs_a_free_core
@pytest.mark.parametrize("bad_row", [500, 1000])
def test_a_datasets_error_reaches_the_training_thread_as_itself(digits, group, bad_row):
    """At the same step as without reading ahead: every batch read before it is trained."""
    train_split, val_split = digits
    reached = {}
    for prefetch in (False, True):
        bad, counts = BadRow(train_split, bad_row), _CountsSteps()
        with pytest.raises(DataError, match=f"row {bad_row}: unreadable") as raised:
            train_digits(group, bad, val_split, hooks=[counts], prefetch=prefetch)
        assert [name.startswith(THREAD_NAME) for name in bad.read_by] == [prefetch]
        frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
        assert frames[-1] == "take"  # the traceback reaches where it was raised
        reached[prefetch] = counts.steps
        assert not readers()
    assert reached[True] == reached[False] > 0


class _StopAfterFirstEpoch(Hook):
    def on_epoch_end(self, state, row):
        state.stop = True


class _FailAtStep(Hook):
    def __init__(self, step: int):
        self.step = step

    def on_step(self, state):
        if state.steps == self.step:  # mid-epoch, with reads ahead under way
            raise RuntimeError("hook failed")


class _SeesReaders(Hook):
    def __init__(self):
        self.seen = 0

    def on_step(self, state):
        self.seen = max(self.seen, len(readers()))


@needs_a_free_core
def test_no_reader_thread_outlives_training(digits, group):
    train_split, val_split = digits
    watch = _SeesReaders()
    outcome = train_digits(group, train_split, val_split, hooks=[watch])
    assert watch.seen == 1  # one reader while an epoch runs
    assert len(outcome.history) == 2 and not readers()
    outcome = train_digits(group, train_split, val_split, hooks=[_StopAfterFirstEpoch()])
    assert len(outcome.history) == 1 and not readers()
    with pytest.raises(RuntimeError, match="hook failed"):
        train_digits(group, train_split, val_split, hooks=[_FailAtStep(5)])
    assert not readers()


def test_no_reader_where_the_intra_op_threads_fill_the_cores(digits, group):
    train_split, val_split = digits
    watch = _SeesReaders()
    train_digits(group, train_split, val_split, hooks=[watch], threads=CORES)
    assert watch.seen == 0


def test_prefetch_on_and_off_train_the_same_weights(digits, group):
    train_split, val_split = digits
    on, off = (train_digits(group, train_split, val_split, prefetch=p) for p in (True, False))
    assert [h["train_loss"] for h in on.history] == [h["train_loss"] for h in off.history]
    for a, b in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a, b)
