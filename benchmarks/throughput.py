"""1. Steady-state training throughput: the trainyard worker vs the raw torchrun DDP script.

Same data (digits split), model (MLP 128-64, no dropout), batch (32 per worker), 2 workers.
Steady state = epochs after the first. trainyard is measured twice: the step loop alone
(per-step Comet logging included) and whole epochs (plus validation and checkpoint upload).
"""

from __future__ import annotations

import itertools

from benchmarks.common import (
    BenchProject,
    interleaved,
    ratio,
    run_raw_script,
    run_trainyard_worker,
    summary,
)

WORKERS = 2


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (4, 2) if quick else (20, 5)
    overrides = [f"train.epochs={epochs}", f"train.workers={WORKERS}", "model.options.dropout=0"]
    counter = itertools.count()
    loop, whole = [], []

    def trainyard() -> float:
        result = run_trainyard_worker(project, overrides, f"bench-throughput-{next(counter)}")
        steady = result["history"][1:]
        rows = sum(h["rows"] for h in steady) * WORKERS  # rank 0's share x workers
        loop.append(rows / sum(h["train_s"] for h in steady))
        whole.append(rows / sum(h["epoch_s"] for h in steady))
        return loop[-1]

    def raw() -> float:
        result = run_raw_script(project, WORKERS, ["--epochs", str(epochs), "--batch-size", "32"])
        return result["rows_per_epoch"] * (epochs - 1) / sum(result["epoch_s"][1:])

    measured = interleaved(reps, {"trainyard": trainyard, "raw": raw})
    return {
        "figures": {
            "raw torchrun DDP script, samples/s": summary(measured["raw"]),
            "trainyard worker, step loop, samples/s": summary(loop),
            "trainyard worker, whole epochs (validation + checkpoint upload), samples/s": summary(
                whole
            ),
        },
        "ratios": {
            "trainyard loop / raw (target >= 0.99)": ratio(loop, measured["raw"]),
            "trainyard whole epochs / raw": ratio(whole, measured["raw"]),
        },
    }
