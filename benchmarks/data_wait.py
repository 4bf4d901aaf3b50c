"""6. Data wait: the fraction of step time spent waiting for the next batch, and training
samples/s, with the next batch read ahead on a background thread (`train.prefetch`, the
default) and without, in the same run (interleaved). One worker with one intra-op thread, so
the reader has a core of its own (with none free trainyard does not start it). On digits
(its memory-mapped split files; a worker would hold a table this small in memory, where
there is nothing to read ahead), on a generated table too big to hold, split into files as
`trainyard split` splits a Parquet file and read from them as a worker reads it, and on
the token dataset of `lm_throughput` (its char-level GPT over the bundled standard-library
text, one epoch), where compute dominates: the ratios show what reading ahead buys and
what it costs.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import BenchProject, prepare_run_split, ratio, split_folder, summary
from benchmarks.lm_throughput import _trainyard_overrides, quick_corpus
from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import SplitConfig, TrainyardConfig, load_config
from trainyard.data.split import SplitSchema
from trainyard.data.table_writer import split_table_to_arrays
from trainyard.data.tensors import HOST_RESIDENT_BYTES, load_split, open_split
from trainyard.datasets.table_arrays import TableArrays
from trainyard.dist import DistContext
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.engine.training import Split
from trainyard.objectives import Classification, Objective, TargetStats, objective_for


@dataclass
class Workload:
    label: str
    config: TrainyardConfig  # train.prefetch is set per contender
    train_split: Split
    val_split: Split
    objective: Objective


def _measure(work: Workload, prefetch: bool) -> tuple[float, float]:
    """(data wait / step time, samples/s) over the run's epochs, as the meter counts them."""
    config = work.config.model_copy(
        update={"train": work.config.train.model_copy(update={"prefetch": prefetch})}
    )
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    outcome = train(
        ctx,
        config,
        work.train_split,
        work.val_split,
        work.objective,
        NullTracker(0),
        NullCheckpointWriter(),
        {},
    )
    train_s = sum(h["train_s"] for h in outcome.history)
    waited = sum(h["data_wait_s"] for h in outcome.history)
    return waited / train_s, sum(h["rows"] for h in outcome.history) / train_s


def _compare(work: Workload, reps: int) -> tuple[dict, dict]:
    """On, off, off, on, ...: interleaved as `common.interleaved` does (which keeps one number
    a repetition; this keeps two), and each first every other time, so warm-up favours none."""
    measured: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for rep in range(reps):
        for prefetch in (True, False) if rep % 2 == 0 else (False, True):
            measured[prefetch].append(_measure(work, prefetch))
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for column, metric in enumerate(("data wait / step time", "samples/s")):
        on, off = ([m[column] for m in measured[p]] for p in (True, False))
        figures[f"{work.label}, prefetch on: {metric}"] = summary(on)
        figures[f"{work.label}, prefetch off: {metric}"] = summary(off)
        ratios[f"{work.label}: {metric}, prefetch on / off"] = ratio(on, off)
    return figures, ratios


def _tables(project: BenchProject, rows: int) -> list[Workload]:
    schema = SplitSchema.read(project.processed)
    config = TrainyardConfig.model_validate(
        {"train": {"workers": 1, "epochs": 3, "batch_size": 256}}
    )
    train_split, val_split, classes = _generated_table(project.root / "generated", rows)
    return [
        Workload(
            "digits (1,257 rows)",
            config,
            load_split(project.processed, "train", schema),
            load_split(project.processed, "val", schema),
            Classification(TargetStats(len(schema.classes))),
        ),
        Workload(
            f"generated {rows:,} rows x 64 features, split files",
            config.model_copy(update={"train": config.train.model_copy(update={"epochs": 1})}),
            train_split,
            val_split,
            Classification(TargetStats(classes)),
        ),
    ]


def _generated_table(folder: Path, rows: int) -> tuple[TableArrays, TableArrays, int]:
    """A table too big to hold whole, split as `trainyard split` splits a Parquet file and
    read as a worker reads it (TableArrays: rows read from the split files by pread)."""
    import pandas as pd

    folder.mkdir(exist_ok=True)
    generator = np.random.default_rng(0)
    frame = pd.DataFrame(
        generator.standard_normal((rows, 64), dtype=np.float32),
        columns=[f"f{i}" for i in range(64)],
    )
    frame["label"] = generator.integers(0, 10, rows)
    frame.to_parquet(folder / "table.parquet")
    table = split_table_to_arrays(
        folder / "table.parquet", "label", "class", SplitConfig(), folder / "split"
    )
    train_split, val_split = (
        TableArrays(
            folder / "split",
            name,
            table.feature_mean,
            table.feature_std,
            num_classes=len(table.classes),
        )
        for name in ("train", "val")
    )
    if train_split.nbytes <= HOST_RESIDENT_BYTES:
        raise ValueError(f"{rows:,} rows: a worker would hold this table in memory; use more")
    return train_split, val_split, len(table.classes)


def _tokens(project: BenchProject, quick: bool) -> Workload:
    """lm_throughput's split and model, trained in this process by one worker."""
    corpus = quick_corpus(project) if quick else "data/raw/stdlib.txt"
    overrides = [*_trainyard_overrides(corpus, 1), "train.workers=1"]
    folder = split_folder(project, prepare_run_split(project, overrides))
    config = load_config(project.root / "params.yaml", overrides)
    schema = SplitSchema.read(folder)
    return Workload(
        "char-level GPT 2x64, context 64, 32 windows",
        config,
        open_split(folder, "train", schema, project.root),
        open_split(folder, "val", schema, project.root),
        objective_for(config.task, schema),
    )


def run(project: BenchProject, quick: bool) -> dict:
    rows = 150_000 if quick else 1_000_000
    reps = 1 if quick else 3  # quick: prefetch on and off once each
    torch.set_num_threads(1)
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:  # gloo's FileStore deletes its file itself
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
        try:
            for work in [*_tables(project, rows), _tokens(project, quick)]:
                more_figures, more_ratios = _compare(work, reps)
                figures |= more_figures
                ratios |= more_ratios
        finally:
            dist.destroy_process_group()
    return {"figures": figures, "ratios": ratios}
