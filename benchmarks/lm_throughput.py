"""7. Language-model throughput on CPU: the trainyard worker vs a hand-written torchrun DDP
loop (`raw_lm_ddp.py`), steady-state training tokens/s, reported as their ratio.

Same char-level GPT (2 layers, 4 heads, width 64, context 64; the raw script imports the
model class so the network is identical), same data (the bundled standard-library corpus,
tokenized once into the split's memory-mapped tokens.bin, read in non-overlapping windows),
same batch (32 windows per worker), 2 workers with one thread each, same recipe (AdamW,
warm-up + cosine, gradient clipping at 1.0). Steady state = epochs after the first. trainyard
runs as the pipeline runs it (its own cached split, `trainyard.engine.worker train` under torchrun),
with its defaults (Comet offline, a checkpoint every epoch the store keeps up with: checkpoint.max_overhead) and with the checkpoint at the
end only, the like-for-like figure. Quick mode trains on the corpus's first 300 kB, since a
full epoch of the 2 MB corpus takes 15-30 s on two cores.
"""

from __future__ import annotations

import itertools

from benchmarks.common import (
    BenchProject,
    interleaved,
    prepare_run_split,
    ratio,
    run_raw_script,
    run_trainyard_worker,
    split_folder,
    summary,
)

WORKERS = 2
CONTEXT = 64
BATCH = 32  # windows per worker
MODEL = {"layers": 2, "heads": 4, "width": 64}
LR, WEIGHT_DECAY, GRAD_CLIP = 3e-3, 0.01, 1.0  # lr for the global batch of 64 windows
QUICK_CORPUS = "data/raw/stdlib-quick.txt"
QUICK_CORPUS_BYTES = 40_000

DEFAULTS = "defaults (Comet, epoch checkpoints within checkpoint.max_overhead)"


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (3, 3)
    corpus = quick_corpus(project) if quick else "data/raw/stdlib.txt"
    common = _trainyard_overrides(corpus, epochs)
    dataset = prepare_run_split(project, common)  # once, before any contender is timed
    folder = split_folder(project, dataset)
    counter = itertools.count()

    def trainyard(overrides: list[str]) -> float:
        run_id = f"bench-lm-throughput-{next(counter)}"
        result = run_trainyard_worker(project, [*common, *overrides], run_id, dataset)
        steady = result["history"][1:]
        windows = sum(h["rows"] for h in steady) * WORKERS  # rank 0's share x workers
        return windows * CONTEXT / sum(h["train_s"] for h in steady)

    def raw() -> float:
        result = run_raw_script(
            project, WORKERS, _raw_args(epochs, project), script="raw_lm_ddp.py", data=folder
        )
        return result["tokens_per_epoch"] * (epochs - 1) / sum(result["epoch_s"][1:])

    arms = {
        "raw": raw,
        "end_checkpoint": lambda: trainyard([f"checkpoint.every_n_epochs={epochs}"]),
    }
    if not quick:  # each arm is a torchrun launch: a quick run's time is its launches
        arms["defaults"] = lambda: trainyard([])
    measured = interleaved(reps, arms)
    label = "GPT 2x64 char-level, context 64"
    figures = {
        f"{label}: raw torchrun DDP loop, tokens/s": summary(measured["raw"]),
        f"{label}: trainyard, checkpoint at the end only, tokens/s": summary(
            measured["end_checkpoint"]
        ),
    }
    ratios = {
        f"{label}: trainyard, checkpoint at the end / raw, tokens/s": ratio(
            measured["end_checkpoint"], measured["raw"]
        ),
    }
    if quick:
        left_out = f"trainyard with its {DEFAULTS} (quick mode: only the like-for-like arm)"
        return {"figures": figures, "ratios": ratios, "left_out": left_out}
    figures[f"{label}: trainyard, {DEFAULTS}, tokens/s"] = summary(measured["defaults"])
    ratios[f"{label}: trainyard defaults / raw, tokens/s"] = ratio(
        measured["defaults"], measured["raw"]
    )
    return {"figures": figures, "ratios": ratios}


def _trainyard_overrides(corpus: str, epochs: int) -> list[str]:
    options = ", ".join(f"{k}: {v}" for k, v in MODEL.items())
    return [
        "task.name=language_model",
        f"data.path={corpus}",
        f"data.context={CONTEXT}",
        "model.name=transformer",
        f"model.options={{{options}}}",
        "train.optimizer=adamw",
        f"train.lr={LR}",
        f"train.lr_reference_batch_size={BATCH * WORKERS}",  # so the lr is LR, unscaled
        f"train.weight_decay={WEIGHT_DECAY}",
        f"train.grad_clip_norm={GRAD_CLIP}",
        f"train.batch_size={BATCH}",
        f"train.workers={WORKERS}",
        "train.threads_per_worker=1",
        f"train.epochs={epochs}",
    ]


def _raw_args(epochs: int, project: BenchProject) -> list[str]:
    # The raw loop saves once at the end too: outside the timed epochs, like trainyard's.
    return [
        "--epochs", str(epochs), "--batch-size", str(BATCH), "--lr", str(LR),
        "--weight-decay", str(WEIGHT_DECAY), "--grad-clip", str(GRAD_CLIP),
        "--layers", str(MODEL["layers"]), "--heads", str(MODEL["heads"]),
        "--width", str(MODEL["width"]), "--checkpoint", str(project.root / "raw-lm.pt"),
    ]  # fmt: skip


def quick_corpus(project: BenchProject) -> str:
    """The same kind of text, smaller: the standard library's first sources, so that two
    epochs of each contender fit in the quick mode's minute."""
    from trainyard.datasets.tokens import build_stdlib_corpus

    path = project.root / QUICK_CORPUS
    if not path.is_file():
        build_stdlib_corpus(path, QUICK_CORPUS_BYTES)
    return QUICK_CORPUS
