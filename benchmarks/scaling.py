"""3. Scaling: throughput with 1 and 2 workers (one thread each) on a compute-bound model and
on one large enough that gradient all-reduce matters, for the trainyard worker and for the
raw torchrun DDP script; trainyard's efficiency is compared with the raw script's own, which
is what the machine allows."""

from __future__ import annotations

import itertools
from typing import Any

from benchmarks.common import (
    BenchProject,
    interleaved,
    ratio,
    run_raw_script,
    run_trainyard_worker,
    summary,
)

MODELS = {
    "compute-bound MLP 1024-1024 (1.1M params)": [1024, 1024],
    "sync-heavy MLP 2048x3 (8.5M params, 34 MB of gradients)": [2048, 2048, 2048],
}


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (6, 3)
    counter = itertools.count()
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    models = dict(list(MODELS.items())[:1]) if quick else MODELS  # quick: only that it runs
    for label, hidden in models.items():

        def trainyard(workers: int, hidden: list[int] = hidden) -> float:
            overrides = [
                f"train.workers={workers}", f"train.epochs={epochs}", "train.batch_size=64",
                f"model.options.hidden_sizes={hidden}", "model.options.dropout=0",
                "tracking.backend=none", "checkpoint.every_n_epochs=1000",
            ]  # fmt: skip
            result = run_trainyard_worker(project, overrides, f"bench-scaling-{next(counter)}")
            steady = result["history"][1:]
            return sum(h["rows"] for h in steady) * workers / sum(h["train_s"] for h in steady)

        def raw(workers: int, hidden: list[int] = hidden) -> float:
            widths = ",".join(map(str, hidden))
            args = ["--epochs", str(epochs), "--batch-size", "64", "--hidden", widths]
            result = run_raw_script(project, workers, args)
            return result["rows_per_epoch"] * (epochs - 1) / sum(result["epoch_s"][1:])

        # Quick mode runs one arm, as a smoke test: each arm is a torchrun launch, and the
        # raw script runs in `throughput` too.
        arms = {
            "1": lambda: trainyard(1),
            "2": lambda: trainyard(2),
            "raw 1": lambda: raw(1),
            "raw 2": lambda: raw(2),
        }
        measured = interleaved(reps, {"2": arms["2"]} if quick else arms)
        for name, who in (
            ("1", "trainyard"),
            ("2", "trainyard"),
            ("raw 1", "raw"),
            ("raw 2", "raw"),
        ):
            if name in measured:
                workers = name[-1]
                figures[f"{label}, {who}, {workers} worker(s), samples/s"] = summary(measured[name])
        if quick:
            continue
        trainyard_efficiency = ratio(measured["2"], measured["1"]) / 2
        raw_efficiency = ratio(measured["raw 2"], measured["raw 1"]) / 2
        ratios |= {
            f"{label}: trainyard scaling efficiency 1 -> 2 workers": trainyard_efficiency,
            f"{label}: raw script's scaling efficiency 1 -> 2 workers": raw_efficiency,
            f"{label}: trainyard's efficiency / the raw script's (target >= 0.97)": (
                trainyard_efficiency / raw_efficiency
            ),
        }
    if quick:
        left_out = "every arm but trainyard with 2 workers, and so the ratios (quick mode)"
        return {"figures": figures, "ratios": ratios, "left_out": left_out}
    return {"figures": figures, "ratios": ratios}
