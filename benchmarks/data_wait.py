"""6. Data wait: the fraction of step time spent getting the next batch, for the default
loader on digits and on a generated dataset large enough that loading matters."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from benchmarks.common import BenchProject, summary
from trainyard.checkpoint import NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data.split import SplitSchema
from trainyard.data.tensors import TensorSplit, load_split
from trainyard.dist import DistContext
from trainyard.objectives import Classification, TargetStats
from trainyard.tracking import NullTracker
from trainyard.training import train


def _fraction(split: TensorSplit, val: TensorSplit, classes: int, epochs: int) -> float:
    config = TrainyardConfig.model_validate(
        {"train": {"workers": 1, "epochs": epochs, "batch_size": 256}}
    )
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    outcome = train(
        ctx,
        config,
        split,
        val,
        Classification(TargetStats(classes)),
        NullTracker(0),
        NullCheckpointWriter(),
        {},
    )
    return sum(h["data_wait_s"] for h in outcome.history) / sum(
        h["train_s"] for h in outcome.history
    )


def run(project: BenchProject, quick: bool) -> dict:
    rows = 100_000 if quick else 1_000_000
    reps = 2 if quick else 3
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:  # gloo's FileStore deletes its file itself
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
        try:
            schema = SplitSchema.read(project.processed)
            digits = load_split(project.processed, "train", schema)
            digits_val = load_split(project.processed, "val", schema)
            generator = torch.Generator().manual_seed(0)
            big = TensorSplit(
                torch.randn(rows, 64, generator=generator),
                torch.randint(0, 10, (rows,), generator=generator),
            )
            small_val = TensorSplit(big.features[:1000], big.labels[:1000])
            default = [_fraction(digits, digits_val, len(schema.classes), 3) for _ in range(reps)]
            large = [_fraction(big, small_val, 10, 1) for _ in range(reps)]
        finally:
            dist.destroy_process_group()
    return {
        "figures": {
            "digits (1,257 rows), data wait / step time": summary(default),
            f"generated {rows:,} rows x 64 features, data wait / step time": summary(large),
        },
        "ratios": {},
    }
