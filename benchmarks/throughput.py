"""1. Steady-state training throughput: the trainyard worker vs the raw torchrun DDP script.

Same data (digits split), model, batch (32 per worker), 2 workers and recipe (SGD Nesterov,
warm-up + cosine). Steady state = epochs after the first. trainyard runs with its defaults:
Comet offline (a point every `tracking.log_every_n_steps`), a checkpoint uploaded to the
store at every epoch end it keeps up with (`checkpoint.max_overhead`); then with a
checkpoint at every epoch end whatever it costs (what the defaults were before
max_overhead), and at the end only, which isolates what the uploads cost. Two models: the default digits MLP (sub-millisecond steps, so fixed per-step
work shows) and a 1024x1024 MLP (steps of several ms, like most real models).
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
# (hidden sizes, epochs): digits epochs take ~50 ms, so 16 of them measured under a second of
# steady state, where one background upload or scheduler hiccup moved a median by 10-20%.
MODELS = {"digits MLP 128-64": ("128,64", 60), "MLP 1024-1024": ("1024,1024", 16)}

DEFAULTS = "defaults (Comet, epoch checkpoints within checkpoint.max_overhead)"


def run(project: BenchProject, quick: bool) -> dict:
    reps = 1 if quick else 3
    counter = itertools.count()
    figures, ratios = {}, {}
    models = dict(list(MODELS.items())[:1]) if quick else MODELS  # quick: only that it runs
    for label, (hidden, full_epochs) in models.items():
        epochs = 2 if quick else full_epochs
        common = [
            f"train.epochs={epochs}",
            f"train.workers={WORKERS}",
            f"model.options.hidden_sizes=[{hidden}]",
            "model.options.dropout=0",
        ]

        def trainyard(overrides: list[str], common: list[str] = common) -> float:
            run_id = f"bench-throughput-{next(counter)}"
            result = run_trainyard_worker(project, [*common, *overrides], run_id)
            steady = result["history"][1:]
            rows = sum(h["rows"] for h in steady) * WORKERS  # rank 0's share x workers
            return rows / sum(h["train_s"] for h in steady)

        def raw(hidden: str = hidden, epochs: int = epochs) -> float:
            args = ["--epochs", str(epochs), "--batch-size", "32", "--hidden", hidden]
            result = run_raw_script(project, WORKERS, args)
            return result["rows_per_epoch"] * (epochs - 1) / sum(result["epoch_s"][1:])

        measured = interleaved(
            reps,
            {
                "raw": raw,
                "defaults": lambda: trainyard([]),
                "every_epoch": lambda: trainyard(["checkpoint.max_overhead=null"]),
                "end_checkpoint": lambda end=f"checkpoint.every_n_epochs={epochs}": trainyard(
                    [end]
                ),
            },
        )
        figures |= {
            f"{label}: raw torchrun DDP script, samples/s": summary(measured["raw"]),
            f"{label}: trainyard, {DEFAULTS}, samples/s": summary(measured["defaults"]),
            f"{label}: trainyard, checkpoint every epoch (max_overhead null), samples/s": summary(
                measured["every_epoch"]
            ),
            f"{label}: trainyard, checkpoint at the end only, samples/s": summary(
                measured["end_checkpoint"]
            ),
        }
        ratios |= {
            f"{label}: trainyard defaults / raw (target >= 0.97)": ratio(
                measured["defaults"], measured["raw"]
            ),
            f"{label}: trainyard, checkpoint every epoch / raw": ratio(
                measured["every_epoch"], measured["raw"]
            ),
            f"{label}: trainyard, checkpoint at the end / raw": ratio(
                measured["end_checkpoint"], measured["raw"]
            ),
        }
    return {"figures": figures, "ratios": ratios}
