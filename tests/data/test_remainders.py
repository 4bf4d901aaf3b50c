"""No rank ever gets an empty or mismatched batch, whatever the dataset's size.

A last global batch of 1 to world_size - 1 rows used to leave some rank an empty batch, which
the transformer cannot even reshape. Each data kind (table, images decoded from PNGs, tokens, a user's
own map-style dataset) trains here with its built-in model (a user's model for the user's
dataset) on 2 and 3 real gloo workers, for every such remainder (and a remainder of
world_size rows, 1 a rank, fewer than its micro-batches), through the real loop: every
rank runs the same number of updates, none reads an empty micro-batch, each row is read once
an epoch, and evaluation counts every sample once, also when a rank has no row to score.
One real `trainyard run` proves the reported case end to end.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from trainyard.config import TrainyardConfig
from trainyard.data.sharding import ShardedBatches
from trainyard.data.tensors import TensorSplit
from trainyard.data_spec import DataSpec
from trainyard.datasets import MapDataset, Subset
from trainyard.datasets.images import ChannelStats, ImageFolder, open_image_array
from trainyard.datasets.tokens import token_splits, tokenize_file
from trainyard.errors import DataError
from trainyard.objectives import Objective
from trainyard.runs.record import load_record

from conftest import trainyard_cli

BATCH, ACCUM = 2, 2  # per worker: an update reads 2 micro-batches of 2 rows
KINDS = ("table", "images", "tokens", "user")
# Each kind replicated (DDP), and the transformer also sharded: FSDP gathers its parameters in
# every forward pass, so a rank that ran one pass fewer would stall the others.
CASES = [(kind, "ddp") for kind in KINDS] + [("tokens", "fsdp")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_every_rank_gets_equal_steps_of_nonempty_shares_covering_each_row_once(world, batch):
    for rows in [world + r for r in range(world)] + [
        full * batch * world + r for full in (1, 3) for r in range(world + 2)
    ]:
        per_rank = [
            list(ShardedBatches(rows, batch, world, rank, 5).epoch(1)) for rank in range(world)
        ]
        steps = {len(batches) for batches in per_rank}
        assert steps == {ShardedBatches(rows, batch, world, 0, 5).steps_per_epoch}, rows
        for step in zip(*per_rank, strict=True):
            sizes = [len(b.indices) for b in step]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (rows, sizes)
            assert sum(sizes) == step[0].global_count
        seen = Counter(int(i) for batches in per_rank for b in batches for i in b.indices)
        assert sorted(seen) == list(range(rows)) and set(seen.values()) == {1}


def test_fewer_rows_than_workers_is_one_clear_error():
    with pytest.raises(DataError, match="2 row.*fewer than the 3 workers.*train.workers"):
        ShardedBatches(2, 4, 3, 0, seed=1)


# --- each data kind, trained by real gloo workers -------------------------------------------


def _write_sources(folder: Path) -> None:
    rng = np.random.default_rng(0)
    # The images are PNGs of three sizes, decoded as a split decodes them into its arrays.
    for i in range(60):
        height, width = ((6, 6), (8, 5), (7, 9))[i % 3]
        pixels = rng.integers(0, 256, (height, width), dtype=np.uint8)
        (folder / "png" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / "png" / f"c{i % 3}" / f"{i:02d}.png")
    pngs = ImageFolder(folder / "png", stats=ChannelStats((0.0,), (1.0,)), image_size=(6, 6))
    np.save(folder / "x.npy", pngs.read(np.arange(60)))
    np.save(folder / "y.npy", pngs.labels)
    text = "".join(f"row {i}: the fox jumps over {i * 7 % 13} dogs\n" for i in range(80))
    (folder / "c.txt").write_text(text, encoding="utf-8")
    tokenize_file(folder / "c.txt", folder / "c.bin", "char")
    with open(folder / "points.jsonl", "w") as out:
        for i in range(60):
            out.write(json.dumps({"x": rng.normal(0, 1, 2).tolist(), "label": i % 3}) + "\n")


def _open(kind: str, folder: Path) -> tuple[MapDataset | TensorSplit, dict, Objective]:
    """The kind's whole dataset, its model settings and its task, as a worker builds them."""
    from trainyard.objectives import Classification, LanguageModel, TargetStats

    from tests_support import points, smoothed_classification

    three = TargetStats(3)
    if kind == "table":
        generator = torch.Generator().manual_seed(0)
        table = TensorSplit(torch.randn(60, 3, generator=generator), torch.arange(60) % 3)
        return table, {"name": "mlp", "options": {"hidden_sizes": [8]}}, Classification(three)
    if kind == "images":
        images = open_image_array(folder / "x.npy", folder / "y.npy", train_rows=np.arange(40))
        return images, {"name": "cnn", "options": {"channels": [2]}}, Classification(three)
    if kind == "tokens":
        windows = token_splits(folder / "c.bin", context=8)["train"]
        model = {"name": "transformer", "options": {"layers": 1, "heads": 2, "width": 8}}
        return windows, model, LanguageModel(TargetStats(windows.spec.vocab_size))
    model = {"name": "tests_support:spec_mlp", "options": {"width": 4}}
    return points(folder / "points.jsonl"), model, smoothed_classification(three)


class CountingReads(MapDataset):
    """Records every read of a split (composer's test_ddp idea), then reads it for real."""

    def __init__(self, base: MapDataset | TensorSplit, rows: range, spec: DataSpec) -> None:
        self.base, self.rows, self._spec, self.reads = base, rows, spec, list[list[int]]()

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices):
        self.reads.append(indices.tolist())
        return self.base.take(indices + self.rows.start)

    @property
    def spec(self) -> DataSpec:
        return self._spec


def _train_one(ctx, kind: str, strategy: str, remainder: int, folder: Path) -> dict:
    """Two epochs of `kind` whose last global batch has `remainder` rows, validated each
    epoch on `remainder` rows (fewer than the workers: some rank scores none)."""
    from trainyard.checkpoint.writer import NullCheckpointWriter
    from trainyard.config import TrainyardConfig
    from trainyard.engine.standalone import train_standalone as train
    from trainyard.engine.tracking import NullTracker
    from trainyard.engine.training import evaluate_split
    from trainyard.models.registry import table_spec

    world = ctx.world_size
    rows = 2 * BATCH * ACCUM * world + remainder
    data, model, objective = _open(kind, folder)
    spec = getattr(data, "spec", None) or table_spec(3, 3)
    train_split = CountingReads(data, range(rows), spec)
    val_split: Subset | TensorSplit
    if isinstance(data, TensorSplit):  # the table
        val_split = TensorSplit(*data.take(torch.arange(rows, rows + remainder)))
    else:
        val_split = Subset(data, np.arange(rows, rows + remainder))
    config = TrainyardConfig.model_validate(
        {
            "model": model,
            # Plain SGD, so that _sgd_on_one_process can replay the updates.
            "train": {"workers": world, "strategy": strategy, "epochs": 2, "batch_size": BATCH, "grad_accum_steps": ACCUM,
                      "prefetch": False, "warmup_epochs": 0, "optimizer": "sgd", "momentum": 0,
                      "weight_decay": 0},
        }
    )  # fmt: skip
    outcome = train(
        ctx, config, train_split, val_split, objective, NullTracker(ctx.rank),
        NullCheckpointWriter(), {}, data=spec,
    )  # fmt: skip
    # Many passes of one row each: in the last, the ranks past the remainder have none.
    wide = TensorSplit(*data.take(torch.arange(2 * world + remainder)))
    return {
        "reads": train_split.reads,
        "steps": outcome.steps,
        "val": {k: outcome.history[-1][f"val_{k}"] for k in objective.metrics},
        "wide": evaluate_split(outcome.model, wide, ctx, objective, chunk=1),
        "expected_val": _one_process(outcome.model, val_split, objective),
        "expected_wide": _one_process(outcome.model, wide, objective),
        "finite": all(torch.isfinite(p).all().item() for p in outcome.model.parameters()),
        "weights_off_by": max(
            (a - b).abs().max().item()
            for a, b in zip(
                map(_whole, outcome.model.parameters()),
                _sgd_on_one_process(config, data, rows, spec, objective),
                strict=True,
            )
        ),
    }


def _sgd_on_one_process(config, data, rows: int, spec, objective) -> list[torch.Tensor]:
    """The weights one process reaches taking, at each step, the plain mean gradient over
    the rows all ranks read in it (the folded remainder included) with the run's schedule."""
    from trainyard.engine.train_state import warmup_cosine
    from trainyard.models.registry import build_model

    cfg, world = config.train, config.train.workers
    torch.manual_seed(cfg.seed)  # the run's initial weights
    model = build_model(config.model, spec)
    per_rank = [ShardedBatches(rows, BATCH * ACCUM, world, r, cfg.seed) for r in range(world)]
    total, step = cfg.epochs * per_rank[0].steps_per_epoch, 0
    for epoch in range(cfg.epochs):
        for shares in zip(*(batches.epoch(epoch) for batches in per_rank), strict=True):
            features, targets = data.take(torch.cat([share.indices for share in shares]))
            loss = objective.loss_sum(model(features), targets) / len(targets)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            lr = config.scaled_lr * warmup_cosine(step, 0, total)
            with torch.no_grad():
                for parameter, grad in zip(model.parameters(), grads, strict=True):
                    parameter.sub_(lr * grad)
            step += 1
    return [parameter.detach() for parameter in model.parameters()]


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter whole: FSDP's are sharded DTensors (gathered with every rank alike)."""
    full = getattr(parameter, "full_tensor", None)
    return full() if full is not None else parameter


@torch.no_grad()
def _one_process(model, split, objective) -> dict[str, float]:
    """What one process scores on the whole split at once (every rank asks it alike)."""
    model.eval()
    features, labels = split.take(torch.arange(len(split)))
    return objective.finish(objective.batch_sums(model(features), labels).tolist())


def _worker(rank, world, init_file, folder):
    from trainyard.dist import DistContext

    # A rank whose collectives fell out of step would wait 30 minutes by default.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    results = {
        f"{kind}/{strategy}/{remainder}": _train_one(ctx, kind, strategy, remainder, folder)
        for kind, strategy in CASES
        for remainder in range(1, world + 1)
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_every_kind_trains_and_evaluates_exactly_with_every_small_remainder(tmp_path, world):
    _write_sources(tmp_path)
    mp.start_processes(
        _worker, args=(world, tmp_path / "init", tmp_path), nprocs=world, start_method="spawn"
    )
    per_rank = json.loads((tmp_path / "results.json").read_text())
    update = BATCH * ACCUM
    for case in per_rank[0]:
        remainder = int(case.split("/")[-1])
        rows = 2 * update * world + remainder
        results = [ranks[case] for ranks in per_rank]
        # 2 updates an epoch, a remainder smaller than the world folded into the second; one
        # of world_size rows is a third update, of 1 row a rank: on every rank alike.
        assert {r["steps"] for r in results} == {2 * (2 + (remainder == world))}, case
        assert all(r["finite"] for r in results), case
        # Each update, the folded one too, is the mean gradient over its global batch.
        assert max(r["weights_off_by"] for r in results) < 1e-5, case
        reads = [r["reads"] for r in results]
        # Each update is 2 micro-batches, or 1 where a share holds 1 row: none is ever empty.
        assert len({len(r) for r in reads}) == 1 and min(len(i) for r in reads for i in r) >= 1
        seen = Counter(i for r in reads for piece in r for i in piece)
        assert sorted(seen) == list(range(rows)) and set(seen.values()) == {2}, case
        first = results[0]
        for r in results:  # the same metrics on every rank, equal to one process's
            assert r["val"] == first["val"] and r["wide"] == first["wide"]
        for name, value in first["expected_val"].items():
            assert first["val"][name] == pytest.approx(value, rel=1e-5, abs=1e-9), (case, name)
            assert first["wide"][name] == pytest.approx(
                first["expected_wide"][name], rel=1e-5, abs=1e-9
            ), (case, name)
        assert first["wide"]["rows"] == 2 * world + remainder


# --- the reported case, end to end -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_the_transformer_trains_on_2_workers_when_the_last_global_batch_has_one_row(project, store):
    """A corpus whose training windows leave 1 row past the last full global batch."""
    context, batch, world = 16, 4, 2
    windows = 5 * batch * world + 1  # 41 training windows: 5 full global batches + 1 row
    share = 1 - (split := TrainyardConfig().split).val_fraction - split.test_fraction
    # The split's training part is its first `share` of the tokens, cut in `context` windows.
    chars = next(n for n in range(100, 10_000) if (round(n * share) - 1) // context == windows)
    line = "the quick brown fox jumps over the lazy dog\n"
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    (project / "data/raw/corpus.txt").write_text((line * (chars // len(line) + 1))[:chars], "utf-8")
    done = trainyard_cli(
        "run", "--run-id", "one-row", "-S", "tracking.backend=none",
        "-S", "task.name=language_model", "-S", "data.path=data/raw/corpus.txt",
        "-S", f"data.context={context}", "-S", "model.name=transformer",
        "-S", "model.options={layers: 1, heads: 2, width: 16}", "-S", "train.workers=2",
        "-S", f"train.batch_size={batch}", "-S", "train.epochs=2",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "cannot reshape" not in output
    assert "last 1 row(s), fewer than the 2 workers, join its last step" in output
    # 41 windows at a global batch of 8: 5 steps an epoch, the 6th row folded into the 5th
    assert "training 2 epochs x 5 steps, global batch 8" in output
    # What it trained, from its record: the console's relayed worker lines are not the
    # outcome (under load the last ones may follow the summary).
    record = load_record(store, "one-row")
    assert record.status == "completed" and len(record.history) == 2, record.status
    assert record.final_checkpoint.endswith("step-00000010"), record.final_checkpoint
