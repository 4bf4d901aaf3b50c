"""Each worker reads a disjoint shard; together they read the training split once per epoch."""

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainyard.data.sharding import ShardedBatches


@pytest.mark.parametrize(
    ("rows", "batch", "world"), [(100, 8, 2), (101, 8, 2), (7, 4, 3), (1258, 32, 2)]
)
def test_shards_partition_every_epoch(rows, batch, world):
    for epoch in range(3):
        per_rank = [
            [b for b in ShardedBatches(rows, batch, world, rank, seed=5).epoch(epoch)]
            for rank in range(world)
        ]
        assert len({len(batches) for batches in per_rank}) == 1, (
            "every rank must run the same number of steps"
        )
        seen = Counter(int(i) for batches in per_rank for b in batches for i in b.indices)
        assert sorted(seen) == list(range(rows)) and set(seen.values()) == {1}
        for step in zip(*per_rank, strict=True):
            assert sum(len(b.indices) for b in step) == step[0].global_count


def test_order_is_reshuffled_per_epoch_and_reproducible_by_seed():
    def order(seed, epoch):
        return torch.cat(
            [b.indices for b in ShardedBatches(64, 8, 1, 0, seed).epoch(epoch)]
        ).tolist()

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)


def test_resuming_mid_epoch_continues_the_same_order():
    batches = ShardedBatches(50, 4, 2, 1, seed=3)
    full = [b.indices.tolist() for b in batches.epoch(2)]
    assert [b.indices.tolist() for b in batches.epoch(2, start_step=5)] == full[5:]


class CountingRows:
    """A dataset that records every row it is asked for (composer's test_ddp idea)."""

    def __init__(self, rows):
        self.rows, self.reads = rows, []

    def take(self, indices):
        self.reads.extend(indices.tolist())
        return indices


def _worker(rank, world, init_file, out_dir, rows, epochs):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = CountingRows(rows)
    batches = ShardedBatches(rows, 16, world, rank, seed=11)
    per_epoch = []
    for epoch in range(epochs):
        data.reads = []
        for batch in batches.epoch(epoch):
            data.take(batch.indices)
            dist.barrier()  # lock-step, as DDP's all-reduce would force
        per_epoch.append(data.reads)
    gathered = [None] * world
    dist.all_gather_object(gathered, per_epoch)
    if rank == 0:
        (out_dir / "reads.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_real_gloo_workers_read_disjoint_shards_covering_the_split(tmp_path):
    rows, epochs, world = 203, 2, 2
    mp.start_processes(
        _worker,
        args=(world, tmp_path / "init", tmp_path, rows, epochs),
        nprocs=world,
        start_method="spawn",
    )
    reads = json.loads((tmp_path / "reads.json").read_text())  # [rank][epoch] -> rows read
    for epoch in range(epochs):
        rank0, rank1 = set(reads[0][epoch]), set(reads[1][epoch])
        assert not rank0 & rank1
        assert sorted(reads[0][epoch] + reads[1][epoch]) == list(range(rows))
    assert reads[0][0] != reads[0][1], "the shard must be reshuffled each epoch"


def _evaluate_worker(rank, world, init_file, out_dir):
    from trainyard.data.tensors import TensorSplit
    from trainyard.dist import DistContext
    from trainyard.engine.training import evaluate_split

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    split = TensorSplit(torch.randn(7, 3), torch.tensor([0, 1, 2, 3, 0, 1, 2]))
    result = evaluate_split(
        model, split, DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    )
    if rank == 0:
        (out_dir / "evaluation.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_sharded_evaluation_of_an_odd_split_equals_one_process(tmp_path):
    """7 rows on 2 workers: 4 + 3, nothing padded or counted twice."""
    from trainyard.data.tensors import TensorSplit

    mp.start_processes(
        _evaluate_worker, args=(2, tmp_path / "init", tmp_path), nprocs=2, start_method="spawn"
    )
    distributed = json.loads((tmp_path / "evaluation.json").read_text())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    split = TensorSplit(torch.randn(7, 3), torch.tensor([0, 1, 2, 3, 0, 1, 2]))
    logits = model(split.features)
    assert distributed["rows"] == 7
    expected = (logits.argmax(1) == split.labels).float().mean().item()
    assert distributed["accuracy"] == pytest.approx(expected, abs=1e-9)
    loss = torch.nn.functional.cross_entropy(logits, split.labels).item()
    assert distributed["loss"] == pytest.approx(loss, rel=1e-6)
