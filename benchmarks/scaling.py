"""3. Scaling: throughput of the trainyard worker with 1 and 2 workers (one thread each) on a
compute-bound model and on one large enough that gradient all-reduce matters."""

from __future__ import annotations

import itertools

from benchmarks.common import BenchProject, interleaved, ratio, run_trainyard_worker, summary

MODELS = {
    "compute-bound MLP 1024-1024 (1.1M params)": "[1024, 1024]",
    "sync-heavy MLP 2048x3 (8.5M params, 34 MB of gradients)": "[2048, 2048, 2048]",
}


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (6, 3)
    counter = itertools.count()
    figures, ratios = {}, {}
    for label, hidden in MODELS.items():

        def measure(workers: int, hidden: str = hidden) -> float:
            overrides = [
                f"train.workers={workers}", f"train.epochs={epochs}", "train.batch_size=64",
                f"model.options.hidden_sizes={hidden}", "model.options.dropout=0",
                "tracking.backend=none", "checkpoint.every_n_epochs=1000",
            ]  # fmt: skip
            result = run_trainyard_worker(project, overrides, f"bench-scaling-{next(counter)}")
            steady = result["history"][1:]
            return sum(h["rows"] for h in steady) * workers / sum(h["train_s"] for h in steady)

        measured = interleaved(reps, {"1": lambda: measure(1), "2": lambda: measure(2)})
        figures[f"{label}, 1 worker, samples/s"] = summary(measured["1"])
        figures[f"{label}, 2 workers, samples/s"] = summary(measured["2"])
        ratios[f"{label}: scaling efficiency 2 workers (throughput2 / 2 x throughput1)"] = (
            ratio(measured["2"], measured["1"]) / 2
        )
    return {"figures": figures, "ratios": ratios}
