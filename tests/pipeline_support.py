"""Run under torchrun (gloo, CPU) by tests/engine/test_pipeline_parallel.py: the transformer
trained STEPS steps as pipeline stages, under each schedule; or, outside torchrun, in one
process. Writes each run's losses (the last stage's) and its parameters, by their names in
the whole model, to the folder argv[1], and the stages' parameters as one DCP checkpoint."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from trainyard.models.zoo import GPT
from trainyard.parallel.pipeline import build_pipeline

VOCAB, CONTEXT, BATCH, STEPS, MICROBATCHES = 64, 16, 8, 50, 4
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, CONTEXT, layers=4, heads=4, width=32, dropout=0.0)


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences with a pattern to learn: each a multiple of 1, 2 or 3, mod VOCAB."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
        stride = torch.randint(1, 4, (BATCH, 1), generator=generator)
        sequence = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
        yield sequence[:, :-1], sequence[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the batch's mean loss: its summed loss over the batch's."""
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return summed / (BATCH * CONTEXT)


def one_process(out: Path) -> None:
    whole = model()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=3e-3)
    losses = []
    for inputs, targets in batches():
        optimizer.zero_grad()
        loss = loss_fn(whole(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    (out / "one.json").write_text(json.dumps(losses))
    torch.save({name: t.detach() for name, t in whole.state_dict().items()}, out / "one.pt")


def stages(out: Path, schedule: str) -> None:
    rank = dist.get_rank()
    pipeline = build_pipeline(model(), dist.group.WORLD, schedule, MICROBATCHES,
                              micro_batch_loss, torch.device("cpu"))  # fmt: skip
    optimizer = torch.optim.AdamW(pipeline.parameters(), lr=3e-3)
    losses = []
    for inputs, targets in batches():
        optimizer.zero_grad()
        loss = pipeline.step(inputs, targets)
        pipeline.tie_gradients()
        optimizer.step()
        if loss is not None:
            losses.append(loss.item())
    if losses:
        (out / f"{schedule}.json").write_text(json.dumps(losses))
    state = {name: t.detach() for name, t in pipeline.state_dict().items()}
    torch.save(state, out / f"{schedule}-rank{rank}.pt")
    # As a checkpoint: DCP's files, every stage writing its own tensors under their names.
    dcp.save({"model": state}, checkpoint_id=str(out / f"{schedule}-dcp"))


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    if "RANK" not in os.environ:
        one_process(folder)
    else:
        dist.init_process_group("gloo")
        for name in SCHEDULES:
            stages(folder, name)
        dist.destroy_process_group()
