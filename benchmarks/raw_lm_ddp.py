"""The language-model baseline: a minimal hand-written torchrun DDP script, as a user would
write it without trainyard, training a character-level GPT on the prepared token split.

The model class is imported from `trainyard.models.zoo.GPT`, so that both contenders train the very
same network (layers, tied head, initialization); nothing else comes from trainyard. The rest
is written here: reading `tokens.bin` through `np.memmap` in the same non-overlapping windows
of context + 1 tokens (nanoGPT's gather of slices), a per-rank shard of a per-epoch shuffle
(what `DistributedSampler` does), AdamW with linear warm-up then cosine decay, gradient
clipping, and the loop.

    torchrun --standalone --nproc_per_node=2 benchmarks/raw_lm_ddp.py --data DIR --out result.json
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
from torch.nn.parallel import DistributedDataParallel

from trainyard.models.zoo import GPT  # the model only, so the network is identical


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="the split folder (tokens.bin, schema.json)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="windows per worker")
    parser.add_argument("--lr", type=float, default=3e-3, help="for the global batch")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--checkpoint", help="save model and optimizer here at the end")
    return parser.parse_args()


def open_train_tokens(folder):
    """The training range of the token file, memory-mapped, and its context and vocabulary."""
    schema = json.loads(Path(folder, "schema.json").read_text())
    vocab = schema["vocab_size"]
    dtype = np.uint8 if vocab <= 256 else np.uint16  # as the file was written
    tokens = np.memmap(Path(folder, "tokens.bin"), dtype=dtype, mode="r")
    start, stop = schema["token_cuts"][0], schema["token_cuts"][1]
    return tokens[start:stop], schema["input_shape"][0], vocab


def get_batch(tokens, rows, context):
    """Window i is tokens[i*context : i*context + context + 1]: inputs and the same shifted."""
    block = torch.stack(
        [torch.from_numpy(tokens[i * context : i * context + context + 1].astype(np.int64)) for i in rows.tolist()]
    )  # fmt: skip
    return block[:, :-1], block[:, 1:]


def lr_factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, context, vocab = open_train_tokens(args.data)
    windows = (len(tokens) - 1) // context  # the last target needs one token more
    torch.manual_seed(0)  # same initial weights on every rank (DDP broadcasts them anyway)
    model = DistributedDataParallel(GPT(vocab, context, args.layers, args.heads, args.width, 0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps = windows // (args.batch_size * world)  # equal step counts on every rank
    warmup, total = round(args.warmup_epochs * steps), steps * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, total))

    epoch_s, losses = [], []
    for epoch in range(args.epochs):
        started = time.perf_counter()
        order = torch.randperm(windows, generator=torch.Generator().manual_seed(epoch))
        shard = order[rank::world]
        for step in range(steps):
            rows = shard[step * args.batch_size : (step + 1) * args.batch_size]
            x, y = get_batch(tokens, rows, context)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            scheduler.step()
        epoch_s.append(time.perf_counter() - started)
        losses.append(loss.item())  # the epoch's last loss: the run trained, not only ran

    if args.checkpoint and rank == 0:
        torch.save(
            {"model": model.module.state_dict(), "optimizer": opt.state_dict()}, args.checkpoint
        )
    if rank == 0:
        tokens_per_epoch = steps * args.batch_size * world * context
        result = {"epoch_s": epoch_s, "tokens_per_epoch": tokens_per_epoch, "last_loss": losses}
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
