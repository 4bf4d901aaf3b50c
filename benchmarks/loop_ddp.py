"""Under torchrun: the raw loop of `raw_ddp.py` and trainyard's `train()`, alternately, in the
same processes on the same tensors (the digits split as trainyard reads it), so that process
start, imports and environment are the same for both and only the loops differ. trainyard
runs without a tracker or checkpoint store (a checkpoint at the end only), with and without
its straggler check. Rank 0 writes {arm: [samples/s over the second half of the epochs, per
repetition]}.

    torchrun --standalone --nproc_per_node=2 benchmarks/loop_ddp.py --data DIR --out result.json

With --arm, one process runs that arm once and writes {"rows_per_epoch": n}: what `loop`
runs under callgrind, whose instruction counts the VM's scheduling noise cannot move.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.raw_ddp import train_loop
from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data.split import SplitSchema
from trainyard.data.tensors import load_split
from trainyard.dist import DistContext
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.objectives import Classification, TargetStats

BATCH = 32  # per worker, as in the throughput benchmark


def raw_loop(x: torch.Tensor, y: torch.Tensor, classes: int, epochs: int) -> float:
    """raw_ddp.py's loop itself; samples/s over the second half of the epochs."""
    _, epoch_s, _, rows = train_loop(x, y, [128, 64], classes, epochs, BATCH, lr=0.05)
    half = epoch_s[epochs // 2 :]
    return rows * len(half) / sum(half)


def trainyard_loop(ctx: DistContext, splits: tuple, classes: int, epochs: int, **sections) -> float:
    config = TrainyardConfig.model_validate(
        {
            "train": {"workers": ctx.world_size, "epochs": epochs, "batch_size": BATCH},
            "model": {"options": {"hidden_sizes": [128, 64], "dropout": 0}},
            "tracking": {"backend": "none"},
            # As the digits job checkpoints with a real store: its store cannot take one an
            # epoch (checkpoint.max_overhead), so they are rare. Here none would be skipped
            # (no store), and each costs both ranks ~2 ms (the RNG states gathered).
            "checkpoint": {"every_n_epochs": epochs},
            **sections,
        }
    )
    objective = Classification(TargetStats(classes))
    outcome = train(
        ctx,
        config,
        splits[0],
        splits[1],
        objective,
        NullTracker(ctx.rank),
        NullCheckpointWriter(),
        {},
    )
    half = outcome.history[epochs // 2 :]
    return sum(h["rows"] for h in half) * ctx.world_size / sum(h["train_s"] for h in half)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--arm", help="run only this arm, once (no timings written)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    schema = SplitSchema.read(Path(args.data))
    splits = tuple(load_split(args.data, name, schema) for name in ("train", "val"))
    x, y = splits[0].take(torch.arange(len(splits[0])))  # standardized, as trainyard reads it
    classes = len(schema.classes)
    arms = {
        "raw": lambda: raw_loop(x, y, classes, args.epochs),
        "trainyard": lambda: trainyard_loop(ctx, splits, classes, args.epochs),
        "trainyard_no_stragglers": lambda: trainyard_loop(
            ctx, splits, classes, args.epochs, stragglers={"enabled": False}
        ),
    }
    if args.arm:
        arms[args.arm]()
        Path(args.out).write_text(json.dumps({"rows_per_epoch": len(splits[0])}))
        dist.destroy_process_group()
        return
    measured: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.reps):  # interleaved
        for name, arm in arms.items():
            measured[name].append(arm())
    if rank == 0:
        Path(args.out).write_text(json.dumps(measured))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
