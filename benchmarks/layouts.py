"""Model-parallel layouts against data parallelism on the same transformer, world size and
global batch: training tokens/s, and each worker's peak resident memory, as ratios to DDP.

Two workers with one thread each, four layouts: DDP, FSDP (parameters, gradients and
optimizer state sharded), a 2-way tensor split and two pipeline stages under 1F1B with 4
micro-batches (a split model's one replica reads the whole global batch, DDP's and FSDP's
two replicas half each).

- Speed: the char-level GPT (4 layers, width 128, context 64) on the standard library's
  first sources, a global batch of 32 windows, steady state = epochs after the first.
- Memory: a GPT of 38M parameters (12 layers, width 512, context 16), whose weights,
  gradients and AdamW state (16 bytes a parameter, 578 MB) are most of what a worker holds,
  one epoch of a global batch of 8 on a 1.2 kB text. The peak is the higher of the two
  workers' (VmHWM: the libraries' pages included, about 470 MB in every arm).

Quick mode runs DDP and the pipeline once, for speed only.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    BenchProject,
    interleaved,
    prepare_run_split,
    ratio,
    run_trainyard_worker,
    summary,
)
from benchmarks.lm_throughput import quick_corpus

WORKERS = 2
PIPELINE = "pipeline 2 (1f1b, 4 micro-batches)"
NAMES = ("ddp", "fsdp", "tensor 2", PIPELINE)


def _arms(global_batch: int) -> dict[str, list[str]]:
    per_replica = f"train.batch_size={global_batch // WORKERS}"
    whole = f"train.batch_size={global_batch}"
    return {
        "ddp": [per_replica],
        "fsdp": [per_replica, "train.strategy=fsdp"],
        "tensor 2": [whole, "train.parallel={tensor: 2}"],
        PIPELINE: [whole, "train.parallel={pipeline: 2}", "train.microbatches=4"],
    }


SPEED = {"context": 64, "global_batch": 32, "model": {"layers": 4, "heads": 4, "width": 128}}
MEMORY = {"context": 16, "global_batch": 8, "model": {"layers": 12, "heads": 8, "width": 512}}
MEMORY_CORPUS = "data/raw/stdlib-1k.txt"


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (3, 3)
    names = ("ddp", PIPELINE) if quick else NAMES
    speed = _speed(project, names, epochs, reps)
    label = "GPT 4x128 char-level, context 64, 2 workers, global batch 32"
    figures = {f"{label}: {name}, tokens/s": summary(speed[name]) for name in names}
    ratios = {
        f"{label}: {name} / ddp, tokens/s": ratio(speed[name], speed["ddp"])
        for name in names
        if name != "ddp"
    }
    if quick:
        left_out = "fsdp and tensor 2, and every arm's memory (quick mode: speed, ddp and pipeline)"
        return {"figures": figures, "ratios": ratios, "left_out": left_out}
    peaks = _memory(project, names)
    label = "GPT 12x512 (38M parameters), 2 workers, global batch 8"
    for name in names:
        figures[f"{label}: {name}, peak resident MB per worker"] = summary(peaks[name])
        if name != "ddp":
            ratios[f"{label}: {name} / ddp, peak memory per worker"] = ratio(
                peaks[name], peaks["ddp"]
            )
    return {"figures": figures, "ratios": ratios}


def _speed(
    project: BenchProject, names: tuple[str, ...], epochs: int, reps: int
) -> dict[str, list[float]]:
    def tokens_per_s(result: dict[str, Any]) -> float:
        steady = result["history"][1:]
        windows = sum(h["rows"] for h in steady) * result["layout"]["data"]  # rank 0's share
        return windows * SPEED["context"] / sum(h["train_s"] for h in steady)

    common = _overrides(quick_corpus(project), epochs, SPEED)
    return _measured(project, common, names, reps, SPEED, "speed", tokens_per_s)


def _memory(project: BenchProject, names: tuple[str, ...]) -> dict[str, list[float]]:
    from trainyard.datasets.tokens import build_stdlib_corpus

    path = project.root / MEMORY_CORPUS
    if not path.is_file():
        build_stdlib_corpus(path, 1_200)
    common = _overrides(MEMORY_CORPUS, 1, MEMORY)
    return _measured(
        project, common, names, 1, MEMORY, "memory", lambda r: max(r["peak_rss_mb_per_rank"])
    )


def _measured(
    project: BenchProject,
    common: list[str],
    names: tuple[str, ...],
    reps: int,
    shape: dict[str, Any],
    what: str,
    read: Callable[[dict[str, Any]], float],
) -> dict[str, list[float]]:
    arms = _arms(shape["global_batch"])
    dataset = prepare_run_split(project, [*common, *arms["ddp"]])  # once, before any arm runs
    counter = itertools.count()

    def arm(name: str) -> float:
        run_id = f"bench-layouts-{what}-{next(counter)}"
        return read(run_trainyard_worker(project, [*common, *arms[name]], run_id, dataset))

    return interleaved(reps, {name: functools.partial(arm, name) for name in names})


def _overrides(corpus: str, epochs: int, shape: dict[str, Any]) -> list[str]:
    options = ", ".join(f"{k}: {v}" for k, v in shape["model"].items())
    return [
        "task.name=language_model",
        f"data.path={corpus}",
        f"data.context={shape['context']}",
        "model.name=transformer",
        f"model.options={{{options}}}",
        "train.optimizer=adamw",
        "train.lr=0.003",
        f"train.lr_reference_batch_size={shape['global_batch']}",
        f"train.workers={WORKERS}",
        "train.threads_per_worker=1",
        f"train.epochs={epochs}",
        f"checkpoint.every_n_epochs={epochs}",  # at the end only, outside the timed epochs
        "tracking.backend=none",
    ]
