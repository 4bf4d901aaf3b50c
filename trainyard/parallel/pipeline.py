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
from dataclasses import dataclass, field, replace
from typing import Any, cast

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
        # Under autocast a stage may end in bf16: what it sends on is float32, the dtype the
        # next stage's receive buffer was made with (the shapes are traced without autocast).
        if x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
            return x.float()
        return x


@dataclass(frozen=True)
class Tie:
    """A parameter this worker's stages share with another worker's."""

    parameter: nn.Parameter
    group: Any  # the process group of the workers holding it
    counted_here: bool  # this worker is the first of them


@dataclass
class Pipeline:
    """This worker's stages of the model and the schedules that run them.

    A schedule is built for each batch size it meets: `torch.distributed.pipelining` sizes
    the buffers between stages by the first micro-batch it sees, so an epoch's shorter last
    step and each evaluation chunk get their own (every worker of a pipeline reads the same
    rows, so all build the same ones)."""

    stages: list[Stage]
    indices: list[int]  # each stage's place in the pipeline
    count: int  # stages in all
    group: Any  # the pipeline's process group
    schedule: str  # "gpipe", "1f1b" or "interleaved_1f1b"
    microbatches: int  # per batch, where its rows divide so (else the most that do)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    names: dict[int, list[str]]  # id(tensor) -> its names in the whole model's state_dict
    shared: list[Tie]  # parameters shared with another worker's stage
    # Every stage of the pipeline on the meta device, which the tensors passed between the
    # stages are traced through; None: torch.distributed.pipelining infers them itself.
    traced: list[Stage] | None = None
    _runners: dict[tuple[int, bool], Any] = field(default_factory=dict)

    @property
    def workers(self) -> int:
        """The workers the pipeline runs on."""
        return self.count // len(self.indices)

    @property
    def first(self) -> bool:
        """Holds the first stage: feeds the inputs."""
        return 0 in self.indices

    @property
    def last(self) -> bool:
        """Holds the last stage: computes the loss and the outputs."""
        return self.count - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        """Each of this worker's parameters once."""
        return list({id(p): p for stage in self.stages for p in stage.parameters()}.values())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the gradients add up on the stages' parameters
        (`loss_fn` of each micro-batch is what is differentiated, unscaled: it says what a
        micro-batch weighs). Returns the sum of the micro-batches' `loss_fn` on the worker
        holding the last stage, None on the others. Call `tie_gradients` once the update's
        batches are all in."""
        losses: list[torch.Tensor] = []
        fed = (inputs,) if self.first else ()
        scored = {"target": targets, "losses": losses} if self.last else {}
        self._runner(inputs, training=True).step(*fed, **scored)
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def outputs(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs for `inputs` (forward only) on the worker holding the last
        stage, None on the others."""
        fed = (inputs,) if self.first else ()
        merged = self._runner(inputs, training=False).step(*fed)
        return merged if self.last else None

    def tie_gradients(self) -> None:
        """Add up each shared parameter's gradient across the workers holding it, as one
        process would have summed both uses (every holder joins, a gradient or not)."""
        for tie in self.shared:
            if tie.parameter.grad is None:
                tie.parameter.grad = torch.zeros_like(tie.parameter)
            dist.all_reduce(local_part(tie.parameter.grad), group=tie.group)

    def counted_parameters(self) -> list[nn.Parameter]:
        """This worker's parameters that no other worker counts: a shared one counts on the
        first worker holding it (a gradient norm over the pipeline adds each once)."""
        others = {id(tie.parameter) for tie in self.shared if not tie.counted_here}
        return [p for p in self.parameters() if id(p) not in others]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's parameters and buffers under their names in the whole model (a
        tied one under each of its names, as the model's own state_dict has it)."""
        return {
            name: tensor
            for stage in self.stages
            for tensor in stage_tensors(stage)
            for name in self.names.get(id(tensor), ())  # none: a buffer not saved
        }

    def _runner(self, inputs: torch.Tensor, training: bool) -> Any:
        key = (inputs.shape[0], training)
        if key not in self._runners:
            self._runners[key] = self._build_runner(inputs, training)
        return self._runners[key]

    def _build_runner(self, inputs: torch.Tensor, training: bool) -> Any:
        # Imported here: torch.distributed.pipelining takes about a second to import, which
        # a run without a pipeline never pays.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        count = microbatch_count(inputs.shape[0], self.microbatches, self.schedule, self.workers)
        between = self._between_stages(inputs[: inputs.shape[0] // count], training)
        runs: list[Any] = []
        for stage, index in zip(self.stages, self.indices, strict=True):
            sent_in, sent_out = between.get(index, (None, None))
            runs.append(
                PipelineStage(stage, index, self.count, self.device, sent_in, sent_out,
                              group=self.group)
            )  # fmt: skip
        loss_fn = self.loss_fn if training else None  # None: forward only
        if len(runs) > 1:
            return ScheduleInterleaved1F1B(runs, count, loss_fn=loss_fn, scale_grads=False)
        # 1F1B needs a micro-batch per stage at least; GPipe runs the same numbers.
        kind = Schedule1F1B if self.schedule == "1f1b" and count >= self.count else ScheduleGPipe
        return kind(runs[0], count, loss_fn=loss_fn, scale_grads=False)

    def _between_stages(
        self, microbatch: torch.Tensor, training: bool
    ) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each stage's input and output for `microbatch`, as empty tensors (what the stages
        send and receive), traced through the stages on the meta device: the schedule then
        runs no forward and backward of its own to learn them. That would gather an FSDP
        stage's parameters across its replicas, whose batches may differ by a row, and
        clear its gradients; a traced pipeline runs only the batch's own passes. In
        training, what passes between stages carries a gradient back."""
        if self.traced is None:
            return {}
        sample = torch.empty(microbatch.shape, dtype=microbatch.dtype, device="meta")
        found: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        with torch.no_grad():
            for index, stage in enumerate(self.traced):
                out = _traced(stage, index, sample)
                found[index] = (  # the stage's input_args and output_args
                    _empty_like(sample, self.device, training and index > 0),
                    _empty_like(out, self.device, training),
                )
                sample = out
        return found


def _traced(stage: Stage, index: int, sample: torch.Tensor) -> torch.Tensor:
    try:
        return cast(torch.Tensor, stage(sample))
    except (RuntimeError, NotImplementedError) as exc:
        raise RuntimeError(
            f"pipeline stage {index} does not run on the meta device, where the tensors "
            f"between stages are traced ({str(exc).splitlines()[0]}): keep .item(), .tolist() "
            "and data-dependent shapes out of the model's forward"
        ) from exc


def _empty_like(tensor: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return empty.requires_grad_(grad and empty.is_floating_point())


def microbatch_count(rows: int, wanted: int, schedule: str, workers: int) -> int:
    """The most micro-batches, up to `wanted`, that `rows` cut into equal parts (a pipeline's
    buffers have one shape) and that `schedule` runs on `workers` (interleaved 1F1B runs
    them in rounds of `workers`)."""
    for count in range(min(wanted, rows), 0, -1):
        if rows % count == 0 and (
            schedule != "interleaved_1f1b" or count % max(1, count // workers) == 0
        ):
            return count
    return 1


def build_pipeline(
    model: nn.Module,
    group: Any,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    shard: Callable[[Stage], None] | None = None,
    shapes: nn.Module | None = None,
) -> Pipeline:
    """This worker's stages of `model` in the pipeline group `group` (its ranks in order are
    the pipeline's), run by `schedule` ("gpipe", "1f1b" or "interleaved_1f1b"); each stage
    sharded in place by `shard`, where given. `shapes`: the same model on the meta device,
    which the tensors between the stages are traced through (else the schedule infers
    them, running each new batch size once more)."""
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
    shared = _shared_across_workers(pieces, ranges, workers, rank, group)
    if shard is not None:
        names, shared = _sharded(stages, shard, names, shared)
    traced = None
    if shapes is not None:
        meta = pipeline_pieces(shapes)
        traced = [Stage([meta[i] for i in pieces_of_stage]) for pieces_of_stage in ranges]
    return Pipeline(
        stages, mine, count, group, schedule, microbatches, loss_fn, device, names, shared,
        traced,
    )  # fmt: skip


def _sharded(
    stages: list[Stage],
    shard: Callable[[Stage], None],
    names: dict[int, list[str]],
    shared: list[Tie],
) -> tuple[dict[int, list[str]], list[Tie]]:
    """Shard each stage in place (`shard`, FSDP across the stage's replicas), which makes
    new parameters: the whole model's names and the shared parameters, found by their
    place in the stage, are carried over to them."""
    before = [_by_place(stage) for stage in stages]
    for stage in stages:
        shard(stage)
    renamed: dict[int, list[str]] = {}
    moved: dict[int, torch.Tensor] = {}
    for stage, places in zip(stages, before, strict=True):
        now = _by_place(stage)
        for place, tensor in places.items():
            moved[id(tensor)] = now[place]
            if id(tensor) in names:  # else a buffer the model does not save
                renamed[id(now[place])] = names[id(tensor)]
    ties = [replace(tie, parameter=cast(nn.Parameter, moved[id(tie.parameter)])) for tie in shared]
    return renamed, ties


def _by_place(stage: Stage) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers by their names in it (a shared one under each)."""
    return dict(stage.named_parameters(remove_duplicate=False)) | dict(
        stage.named_buffers(remove_duplicate=False)
    )


def _shared_across_workers(
    pieces: list[nn.Module], ranges: list[range], workers: int, rank: int, group: Any
) -> list[Tie]:
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
            # A schedule runs each stage's backward on its own: one parameter in two stages
            # of one worker would be counted as two.
            raise ValueError(
                "a parameter is shared by two pipeline stages of one worker (interleaved): "
                "use train.pipeline_schedule 1f1b, or more workers per pipeline"
            )
        if len(holding) < 2 or rank not in holding:
            continue
        members = [ranks[w] for w in sorted(holding)]
        made = dist.new_group(members, use_local_synchronization=True)
        found.append(Tie(parameter, made, rank == min(holding)))
    return found


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard, sharing its storage (what a collective over the workers holding
    the same shard sums into); a tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor
    with torch.no_grad():  # the shard itself, not a differentiable view of it
        return cast(torch.Tensor, to_local())


def stage_tensors(module: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())
