"""The baseline: a minimal hand-written torchrun DDP script, as a user would write it without
trainyard. Same model (MLP), same data (the prepared split), same batch size and workers, and
the same recipe a careful user writes by hand (SGD with Nesterov momentum and weight decay,
linear warm-up then cosine decay), so the comparison measures orchestration, not the recipe.
Deliberately imports nothing from trainyard.

    torchrun --standalone --nproc_per_node=2 benchmarks/raw_ddp.py --data DIR --out result.json
"""

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def load(folder, name, schema):
    """The prepared split's arrays (float32 features, int64 class ids), standardized with
    the training statistics, whole in memory as a hand-written script would hold them."""
    x = torch.from_numpy(np.load(f"{folder}/{name}_x.npy"))
    x = (x - torch.tensor(schema["feature_mean"])) / torch.tensor(schema["feature_std"])
    y = torch.from_numpy(np.load(f"{folder}/{name}_y.npy"))
    return x, y


def train_loop(x, y, hidden, classes, epochs, batch_size, lr):
    """The model (an MLP), recipe and loop, on this rank's shard of each epoch's permutation;
    returns (the DDP model, each epoch's seconds, when the first step ended, rows read per
    epoch). Every row is read once per epoch, as trainyard reads them, so the last batch may
    be short (dropping it made this script's samples/s ~2% higher on digits with 2 workers:
    22 steps of 64 rows against trainyard's 22 and one of 29). Every rank runs the same
    steps: its shard has len(y) // world rows, or one more."""
    rank, world = dist.get_rank(), dist.get_world_size()
    widths = [x.shape[1], *hidden, classes]
    layers = []
    for a, b in zip(widths[:-1], widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*layers[:-1]))
    opt = torch.optim.SGD(
        model.parameters(), lr=lr * world, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    steps = math.ceil(len(y) // world / batch_size)
    rows = sum(min(len(range(r, len(y), world)), steps * batch_size) for r in range(world))
    warmup, total = steps, steps * epochs

    def schedule(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)

    epoch_s, first_step_at = [], None
    for epoch in range(epochs):
        started = time.perf_counter()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        shard = order[rank::world]
        for step in range(steps):
            idx = shard[step * batch_size : (step + 1) * batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            scheduler.step()
            if first_step_at is None:
                first_step_at = time.time()
        epoch_s.append(time.perf_counter() - started)
    return model, epoch_s, first_step_at, rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", default="128,64")
    parser.add_argument("--checkpoint", help="save the final model here (torch.save)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schema = json.loads(Path(args.data, "schema.json").read_text())
    x, y = load(args.data, "train", schema)
    hidden = [int(width) for width in args.hidden.split(",")]
    model, epoch_s, first_step_at, rows_per_epoch = train_loop(
        x, y, hidden, len(schema["classes"]), args.epochs, args.batch_size, args.lr
    )

    accuracy = None
    if args.checkpoint:
        if rank == 0:
            torch.save(model.module.state_dict(), args.checkpoint)
        tx, ty = load(args.data, "test", schema)
        with torch.no_grad():
            mine = torch.arange(rank, len(ty), world)
            correct = torch.tensor(
                [(model.module(tx[mine]).argmax(1) == ty[mine]).sum().item(), len(mine)]
            )
        dist.all_reduce(correct)
        accuracy = (correct[0] / correct[1]).item()
    if rank == 0:
        result = {
            "epoch_s": epoch_s,
            "rows_per_epoch": rows_per_epoch,
            "first_step_at": first_step_at,
            "test_accuracy": accuracy,
            "world_size": world,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
