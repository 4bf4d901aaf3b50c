"""Model-parallel layouts against data parallelism on the same transformer, world size and
global batch: training tokens/s and each worker's peak resident memory, as ratios to DDP.

Two workers with one thread each train the char-level GPT (4 layers, width 128, context 64)
on the standard library's first sources, a global batch of 32 windows: DDP (16 per worker),
FSDP (16 per worker, parameters, gradients and optimizer state sharded), a 2-way tensor split
and two pipeline stages under 1F1B with 4 micro-batches (one replica reading all 32). Steady
state = epochs after the first. The peak is the higher of the two workers' (VmHWM: the
libraries' pages included, the same in every arm). Quick mode runs DDP and the pipeline
once, two epochs.
"""

from __future__ import annotations

import itertools
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
CONTEXT = 64
GLOBAL_BATCH = 32
MODEL = {"layers": 4, "heads": 4, "width": 128}
ARMS = {
    "ddp": [f"train.batch_size={GLOBAL_BATCH // WORKERS}"],
    "fsdp": [f"train.batch_size={GLOBAL_BATCH // WORKERS}", "train.strategy=fsdp"],
    "tensor 2": [f"train.batch_size={GLOBAL_BATCH}", "train.parallel={tensor: 2}"],
    "pipeline 2 (1f1b, 4 micro-batches)": [
        f"train.batch_size={GLOBAL_BATCH}", "train.parallel={pipeline: 2}", "train.microbatches=4",
    ],
}  # fmt: skip
QUICK_ARMS = ("ddp", "pipeline 2 (1f1b, 4 micro-batches)")


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (3, 3)
    common = _overrides(quick_corpus(project), epochs)
    dataset = prepare_run_split(project, common)  # once, before any arm is timed
    counter = itertools.count()

    def arm(overrides: list[str]) -> tuple[float, float]:
        result = run_trainyard_worker(
            project, [*common, *overrides], f"bench-layouts-{next(counter)}", dataset
        )
        steady = result["history"][1:]
        windows = sum(h["rows"] for h in steady) * result["layout"]["data"]  # rank 0's share
        tokens_per_s = windows * CONTEXT / sum(h["train_s"] for h in steady)
        return tokens_per_s, max(result["peak_rss_mb_per_rank"])

    names = QUICK_ARMS if quick else tuple(ARMS)
    measured = interleaved(reps, {name: lambda o=ARMS[name]: arm(o) for name in names})
    label = "GPT 4x128 char-level, context 64, 2 workers, global batch 32"
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    ddp_speed, ddp_peak = _split(measured["ddp"])
    for name in names:
        speed, peak = _split(measured[name])
        figures[f"{label}: {name}, tokens/s"] = summary(speed)
        figures[f"{label}: {name}, peak resident MB per worker"] = summary(peak)
        if name != "ddp":
            ratios[f"{label}: {name} / ddp, tokens/s"] = ratio(speed, ddp_speed)
            ratios[f"{label}: {name} / ddp, peak memory per worker"] = ratio(peak, ddp_peak)
    result: dict[str, Any] = {"figures": figures, "ratios": ratios}
    if quick:
        result["left_out"] = "fsdp and tensor 2 (quick mode: ddp and the pipeline only)"
    return result


def _split(pairs: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [speed for speed, _ in pairs], [peak for _, peak in pairs]


def _overrides(corpus: str, epochs: int) -> list[str]:
    options = ", ".join(f"{k}: {v}" for k, v in MODEL.items())
    return [
        "task.name=language_model",
        f"data.path={corpus}",
        f"data.context={CONTEXT}",
        "model.name=transformer",
        f"model.options={{{options}}}",
        "train.optimizer=adamw",
        "train.lr=0.003",
        f"train.lr_reference_batch_size={GLOBAL_BATCH}",
        f"train.workers={WORKERS}",
        "train.threads_per_worker=1",
        f"train.epochs={epochs}",
        f"checkpoint.every_n_epochs={epochs}",  # at the end only, outside the timed epochs
        "tracking.backend=none",
    ]
