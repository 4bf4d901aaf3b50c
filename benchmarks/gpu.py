"""7. GPU: the trainyard training loop vs a hand-written loop on one GPU, fp32 and bf16
autocast (and bf16 with `train.compile`), with the model FLOP/s each achieves.

A model big enough to keep a GPU busy (MLP 1024 -> 4096 x 3 -> 10, 38M parameters, global
batch 4096) on generated data held in GPU memory; nccl, one process per GPU (one GPU here,
so a one-rank group). Both loops train the same recipe (SGD Nesterov, weight decay, warm-up
+ cosine); trainyard's is `trainyard.engine.training.train` itself, with tracking and checkpoints
off (their cost is measured on CPU by `throughput` and `checkpoint_cost`); what a checkpoint
costs the training thread on a GPU, the snapshot, is measured beside them. Skipped without
CUDA. Needs no store: `python -m benchmarks.run --only gpu` runs it alone.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import interleaved, one_worker_env, per_repetition, ratio, summary

IN, HIDDEN, CLASSES, BATCH = 1024, [4096, 4096, 4096], 10, 4096
FLOPS_PER_SAMPLE = 6 * sum(a * b for a, b in zip([IN, *HIDDEN], [*HIDDEN, CLASSES], strict=True))


def run(project: object, quick: bool) -> dict:
    if not torch.cuda.is_available():
        return {"figures": {}, "ratios": {}, "skipped": "no CUDA device"}
    from trainyard.dist import cleanup_distributed, init_distributed

    epochs, reps, rows = (3, 1, 16 * BATCH) if quick else (5, 5, 128 * BATCH)
    ctx = _one_rank_group(init_distributed)
    try:
        data, val = _clustered_data(ctx.device, rows)
        measured = interleaved(
            reps,
            {
                "raw fp32": lambda: _raw_loop(ctx.device, data, epochs, "fp32"),
                "trainyard fp32": lambda: _trainyard_loop(ctx, data, val, epochs, "fp32"),
                "raw bf16": lambda: _raw_loop(ctx.device, data, epochs, "bf16"),
                "trainyard bf16": lambda: _trainyard_loop(ctx, data, val, epochs, "bf16"),
                "trainyard bf16 compiled": lambda: _trainyard_loop(
                    ctx, data, val, epochs, "bf16", compiled=True
                ),
            },
        )
        snapshot = _snapshot_costs(ctx.device, reps)
    finally:
        cleanup_distributed()
    figures = {name: summary(values) for name, values in snapshot.items()}
    for name, values in measured.items():
        figures[f"{name}, samples/s"] = summary(values)
        figures[f"{name}, model TFLOP/s"] = summary([v * FLOPS_PER_SAMPLE / 1e12 for v in values])
    return {
        "figures": figures,
        "ratios": {
            "trainyard / raw, fp32": ratio(measured["trainyard fp32"], measured["raw fp32"]),
            "trainyard / raw, bf16": ratio(measured["trainyard bf16"], measured["raw bf16"]),
            **per_repetition(
                "trainyard / raw, fp32", measured["trainyard fp32"], measured["raw fp32"]
            ),
            **per_repetition(
                "trainyard / raw, bf16", measured["trainyard bf16"], measured["raw bf16"]
            ),
            "bf16 / fp32, trainyard": ratio(measured["trainyard bf16"], measured["trainyard fp32"]),
            "compiled / eager, bf16, trainyard": ratio(
                measured["trainyard bf16 compiled"], measured["trainyard bf16"]
            ),
            "training thread blocked per checkpoint snapshot / one copy to CPU memory": ratio(
                snapshot[SNAPSHOT_BLOCKED], snapshot[SNAPSHOT_COPY]
            ),
        },
        "device": torch.cuda.get_device_name(0),
    }


def _clustered_data(device: torch.device, rows: int):
    """`rows` samples around one random center per class, in GPU memory; the first batch of
    them again as the validation split."""
    from trainyard.data.tensors import TensorSplit

    generator = torch.Generator(device=device).manual_seed(0)
    centers = torch.randn(CLASSES, IN, device=device, generator=generator)
    labels = torch.randint(0, CLASSES, (rows,), device=device, generator=generator)
    features = centers[labels] + torch.randn(rows, IN, device=device, generator=generator)
    return TensorSplit(features, labels), TensorSplit(features[:BATCH], labels[:BATCH])


def _trainyard_loop(ctx, data, val, epochs: int, precision: str, compiled: bool = False) -> float:
    """`trainyard.engine.training.train` itself, tracking and checkpoints off: samples/s after the
    first epoch (which, with `train.compile`, holds the compilation)."""
    from trainyard.checkpoint.writer import NullCheckpointWriter
    from trainyard.config import TrainyardConfig
    from trainyard.engine.standalone import train_standalone as train
    from trainyard.engine.tracking import NullTracker
    from trainyard.objectives import Classification, TargetStats

    config = TrainyardConfig.model_validate(
        {
            "train": {
                "workers": 1, "epochs": epochs, "batch_size": BATCH, "precision": precision,
                "compile": compiled, "lr": 0.05, "lr_reference_batch_size": BATCH,
            },
            "model": {"options": {"hidden_sizes": HIDDEN, "dropout": 0}},
            "tracking": {"backend": "none"},
        }
    )  # fmt: skip
    objective = Classification(TargetStats(CLASSES))
    outcome = train(ctx, config, data, val, objective, NullTracker(0), NullCheckpointWriter(), {})
    steady = outcome.history[1:]
    return sum(h["rows"] for h in steady) / sum(h["train_s"] for h in steady)


def _raw_loop(device: torch.device, data, epochs: int, precision: str) -> float:
    """What a user writes by hand: the same model, recipe and batches, DDP on one GPU."""
    torch.manual_seed(0)
    widths = [IN, *HIDDEN, CLASSES]
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*layers[:-1]).to(device), device_ids=[device.index]
    )
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    steps = math.ceil(len(data) / BATCH)
    total = steps * epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / steps
            if s < steps
            else 0.5 * (1 + math.cos(math.pi * (s - steps) / (total - steps)))
        ),
    )
    rates = []
    for epoch in range(epochs):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            x, y = data.take(order[step * BATCH : (step + 1) * BATCH])
            with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            scheduler.step()
        torch.cuda.synchronize(device)
        rates.append(len(data) / (time.perf_counter() - started))
    return sum(rates[1:]) / len(rates[1:])


SNAPSHOT_BLOCKED = "training thread blocked per checkpoint snapshot (save()'s copy), ms"
SNAPSHOT_COPY = "one copy of the state to CPU memory (.to('cpu')), ms"
SNAPSHOT_LANDED = "the snapshot's queued copies landed (the stream's time per snapshot), ms"


def _snapshot_costs(device: torch.device, reps: int) -> dict[str, list[float]]:
    """What a checkpoint costs the training thread on a GPU: the writer's snapshot (copies
    queued into pinned memory it reuses) against the plain copy a user would write. The
    state is this benchmark's model and SGD momentum, 38M parameters each (305 MB)."""
    from trainyard.checkpoint.snapshot import cpu_snapshot, snapshot_ready

    weights = [
        torch.randn(a, b, device=device)
        for a, b in zip([IN, *HIDDEN], [*HIDDEN, CLASSES], strict=True)
    ]
    state = {"model": weights, "optimizer": [w.clone() for w in weights]}
    spare = None
    costs: dict[str, list[float]] = {SNAPSHOT_BLOCKED: [], SNAPSHOT_LANDED: [], SNAPSHOT_COPY: []}
    for rep in range(1 + max(3, reps * 3)):  # the first pins its memory: not steady state
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        snapshot = cpu_snapshot(state, spare)
        ready = snapshot_ready()
        assert ready is not None  # a CUDA state's copy has an event to wait on
        blocked = time.perf_counter() - started
        ready.synchronize()
        landed = time.perf_counter() - started
        spare = snapshot
        started = time.perf_counter()
        copied = {name: [w.to("cpu") for w in ws] for name, ws in state.items()}
        copy = time.perf_counter() - started
        del copied
        if rep:
            costs[SNAPSHOT_BLOCKED].append(blocked * 1000)
            costs[SNAPSHOT_LANDED].append(landed * 1000)
            costs[SNAPSHOT_COPY].append(copy * 1000)
    return costs


def _one_rank_group(init_distributed):
    """torchrun's environment for a single worker, then trainyard's own init (nccl)."""
    os.environ.update(one_worker_env())
    return init_distributed("cuda", timeout_s=300)
