"""Pipeline parallelism (through `torch.distributed.pipelining`): a model's layers cut into
stages, one per worker of a pipeline group (two per worker under interleaved 1F1B), each
batch cut into micro-batches that flow through the stages as the schedule orders them.

A model declares its pipeline with `pipeline_stages() -> list[nn.Module]`: the ordered
pieces whose composition is its forward (trainyard.models.zoo's transformer returns its
embedding, each block, then its head). Consecutive pieces are grouped into as many stages as
the schedule needs, the same number of pieces to each where they divide. A parameter two
stages share (a head tied to the token embedding) stays one parameter: each stage holding it
adds the other's gradient to its own before the optimizer steps, as one process would have
summed both uses. Each parameter keeps its name in the whole model (`names`), so that a
checkpoint written by the stages reads as the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def pipeline_pieces(model: nn.Module) -> list[nn.Module]:
    """The model's ordered pieces; ValueError, saying why, where it declares none."""
    declared = getattr(model, "pipeline_stages", None)
    if not callable(declared):
        raise ValueError(
            f"the model ({type(model).__name__}) declares no pipeline_stages(), the ordered "
            "pieces its forward runs through: use model.name transformer, or add the method "
            "to yours (docs/data-and-models.md)"
        )
    return list(declared())


def stage_ranges(pieces: int, stages: int) -> list[range]:
    """Consecutive pieces per stage, as equal as they divide (the first stages one more)."""
    if pieces < stages:
        raise ValueError(
            f"the model has {pieces} pipeline pieces, fewer than the {stages} stages asked "
            "for: lower train.parallel.pipeline (interleaved_1f1b needs 2 per worker)"
        )
    size, extra = divmod(pieces, stages)
    starts = [n * size + min(n, extra) for n in range(stages + 1)]
    return [range(starts[n], starts[n + 1]) for n in range(stages)]


class Stage(nn.Module):
    """Consecutive pieces of a model, run one after another."""

    def __init__(self, pieces: Sequence[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x


@dataclass
class Pipeline:
    """This worker's stages of the model and the schedule that runs them."""

    stages: list[Stage]
    schedule: Any  # a torch.distributed.pipelining schedule
    names: dict[int, list[str]]  # id(tensor) -> its names in the whole model's state_dict
    first: bool  # holds the first stage: feeds the inputs
    last: bool  # holds the last stage: computes the loss
    shared: list[tuple[nn.Parameter, Any]]  # parameters shared with another worker's stage

    def parameters(self) -> list[nn.Parameter]:
        """Each of this worker's parameters once."""
        return list({id(p): p for stage in self.stages for p in stage.parameters()}.values())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch (gradients accumulate on the stages'
        parameters): the mean of its micro-batches' losses on the worker holding the last
        stage, None on the others."""
        losses: list[torch.Tensor] = []
        fed = (inputs,) if self.first else ()
        scored = {"target": targets, "losses": losses} if self.last else {}
        self.schedule.step(*fed, **scored)
        for parameter, group in self.shared:  # every holder joins, a gradient or not
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)
        return torch.stack(losses).mean() if losses else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's parameters and buffers under their names in the whole model (a
        tied one under each of its names, as the model's own state_dict has it)."""
        return {
            name: tensor
            for stage in self.stages
            for tensor in _tensors(stage)
            for name in self.names.get(id(tensor), ())  # none: a buffer not saved
        }


def build_pipeline(
    model: nn.Module,
    group: Any,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> Pipeline:
    """This worker's stages of `model` in the pipeline group `group` (its ranks in order are
    the pipeline's), run by `schedule` ("gpipe", "1f1b" or "interleaved_1f1b")."""
    # Imported here: torch.distributed.pipelining takes about a second to import, which a
    # run without a pipeline never pays.
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pieces = pipeline_pieces(model)
    workers, rank = dist.get_world_size(group), dist.get_rank(group)
    per_worker = 2 if schedule == "interleaved_1f1b" else 1
    count = workers * per_worker
    ranges = stage_ranges(len(pieces), count)
    # Interleaved: worker r holds stages r, r + workers, ... (the schedule's loop order).
    mine = [rank + n * workers for n in range(per_worker)]
    stages = [Stage([pieces[i] for i in ranges[index]]).to(device) for index in mine]
    # Named once moved: moving a module replaces its buffers (its parameters stay the same
    # objects), and the model holds the stages' pieces themselves.
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # a tied one twice
        names.setdefault(id(tensor), []).append(name)
    runs: list[Any] = [PipelineStage(stage, index, count, device, group=group)
                       for stage, index in zip(stages, mine, strict=True)]  # fmt: skip
    if schedule == "interleaved_1f1b":
        runner: Any = ScheduleInterleaved1F1B(runs, microbatches, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = kind(runs[0], microbatches, loss_fn=loss_fn)
    shared = _shared_across_workers(pieces, ranges, workers, rank, group)
    return Pipeline(stages, runner, names, 0 in mine, count - 1 in mine, shared)


def _shared_across_workers(
    pieces: list[nn.Module], ranges: list[range], workers: int, rank: int, group: Any
) -> list[tuple[nn.Parameter, Any]]:
    """The parameters this worker holds that another worker's stage holds too, each with the
    process group of the workers holding it (made by those workers alone, in the same order
    on each: the pieces' order)."""
    holders: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for index, pieces_of_stage in enumerate(ranges):
        for piece in (pieces[i] for i in pieces_of_stage):
            for parameter in piece.parameters():
                holders.setdefault(id(parameter), (parameter, []))[1].append(index % workers)
    found = []
    ranks = dist.get_process_group_ranks(group)
    for parameter, holding in holders.values():
        if len(set(holding)) < len(holding):
            # The schedule scales each stage's gradients by 1/microbatches: twice, for one
            # parameter in two stages of one worker.
            raise ValueError(
                "a parameter is shared by two pipeline stages of one worker (interleaved): "
                "use train.pipeline_schedule 1f1b, or more workers per pipeline"
            )
        if len(holding) < 2 or rank not in holding:
            continue
        members = [ranks[w] for w in sorted(holding)]
        found.append((parameter, dist.new_group(members, use_local_synchronization=True)))
    return found


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())
