"""Images: decoding a folder of JPEGs once, at split time, against decoding them per step.

A generated folder of 64 x 64 JPEGs (10 classes; 2,000 images, 200 in quick mode) in a
temporary folder. Measured:

- the split (`prepare_image_split`: headers, decode, resize, the split's uint8 arrays and
  the training statistics): images/s of wall time and of the process's CPU time;
- the cnn trained one epoch in this process by one worker (one intra-op thread, batch 64,
  the next batches read ahead as by default): data wait per step (ms) and training
  samples/s, reading the decoded split (a memory-mapped gather per batch), the same with
  `data.augment: flip_crop`, and an ImageFolder that decodes each batch's files with Pillow
  in `take` (what a worker would do had the split not decoded them). Ratios: decoding per
  step / decoded at split time.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import ratio, summary
from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import DataConfig, SplitConfig, TrainyardConfig
from trainyard.data.prepared import open_image_split, prepare_image_split
from trainyard.data.split import SplitSchema
from trainyard.datasets.base import Subset
from trainyard.datasets.images import ChannelStats, ImageFolder
from trainyard.dist import DistContext
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.objectives import Classification, TargetStats

SIDE = 64
CLASSES = 10
BATCH = 64


def write_jpegs(folder: Path, count: int) -> None:
    """`count` 64 x 64 RGB JPEGs (quality 90), class k a colour of its own plus noise."""
    from PIL import Image

    generator = np.random.default_rng(0)
    for i in range(count):
        label = i % CLASSES
        pixels = generator.integers(0, 80, (SIDE, SIDE, 3), dtype=np.uint8)
        pixels += np.array([label * 17, 170 - label * 13, 40 + label * 9], dtype=np.uint8)
        place = folder / f"c{label}"
        place.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(place / f"{i:05d}.jpg", quality=90)


def _split_rate(source: Path, out: Path, count: int) -> tuple[float, float]:
    """Images/s of the split: per second of wall time, and per CPU second of this process
    (which a busy machine's neighbours do not move)."""
    out.mkdir()
    started, cpu = time.perf_counter(), time.process_time()
    prepare_image_split(source, SplitConfig(), out, DataConfig(path="data/images"))
    rates = count / (time.perf_counter() - started), count / (time.process_time() - cpu)
    for file in out.iterdir():
        file.unlink()
    out.rmdir()
    return rates


def _train_once(
    config: TrainyardConfig, train_split, val_split, classes: int
) -> tuple[float, float]:
    """(data wait per step in ms, samples/s) over one epoch, as the meter counts them."""
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    outcome = train(
        ctx, config, train_split, val_split, Classification(TargetStats(classes)),
        NullTracker(0), NullCheckpointWriter(), {},
    )  # fmt: skip
    rows = sum(h["rows"] for h in outcome.history)
    steps = sum(math.ceil(h["rows"] / BATCH) for h in outcome.history)
    waited = sum(h["data_wait_s"] for h in outcome.history)
    return 1000 * waited / steps, rows / sum(h["train_s"] for h in outcome.history)


def run(project, quick: bool) -> dict:
    count, reps = (200, 1) if quick else (2000, 3)
    torch.set_num_threads(1)
    figures, ratios = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        source, split = Path(tmp) / "images", Path(tmp) / "split"
        write_jpegs(source, count)
        import sklearn.model_selection  # noqa: F401  the split's one-off import, not timed

        rates = [_split_rate(source, Path(tmp) / f"rate{rep}", count) for rep in range(reps)]
        figure = f"split of {count:,} {SIDE}x{SIDE} JPEGs: images/s"
        figures[figure] = summary([wall for wall, _ in rates])
        figures[f"{figure} of CPU time"] = summary([cpu for _, cpu in rates])
        split.mkdir()
        fields = prepare_image_split(source, SplitConfig(), split, DataConfig(path="data/images"))
        schema = SplitSchema(label_column="label", **fields)
        decoded = open_image_split(split, "train", schema)
        stats = ChannelStats(tuple(schema.feature_mean), tuple(schema.feature_std))
        folder = ImageFolder(source, stats=stats)  # decodes each batch's files in take()
        train_rows = _train_rows(folder.labels, split)
        contenders = {
            "decoded at split time": (decoded, "none"),
            "decoded at split time, flip_crop": (decoded, "flip_crop"),
            "decoding per step (Pillow in take)": (Subset(folder, train_rows), "none"),
        }
        val = open_image_split(split, "val", schema)
        measured: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        with tempfile.TemporaryDirectory() as init:
            dist.init_process_group("gloo", init_method=f"file://{init}/f", rank=0, world_size=1)
            try:
                for _ in range(reps):
                    for name, (data, augment) in contenders.items():
                        config = _config(augment)
                        measured[name].append(_train_once(config, data, val, CLASSES))
            finally:
                dist.destroy_process_group()
    for name, values in measured.items():
        figures[f"cnn, {name}: data wait per step (ms)"] = summary([v[0] for v in values])
        figures[f"cnn, {name}: samples/s"] = summary([v[1] for v in values])
    per_step, at_split = (
        measured["decoding per step (Pillow in take)"],
        measured["decoded at split time"],
    )
    ratios["data wait per step: decoding per step / decoded at split time"] = ratio(
        [v[0] for v in per_step], [v[0] for v in at_split]
    )
    ratios["samples/s: decoding per step / decoded at split time"] = ratio(
        [v[1] for v in per_step], [v[1] for v in at_split]
    )
    return {"figures": figures, "ratios": ratios}


def _config(augment: str) -> TrainyardConfig:
    return TrainyardConfig.model_validate({
        "data": {"path": "data/images", "augment": augment},
        "model": {"name": "cnn", "options": {}},
        "train": {"workers": 1, "epochs": 1, "batch_size": BATCH, "optimizer": "adamw", "lr": 0.003},
    })  # fmt: skip


def _train_rows(labels: np.ndarray, split: Path) -> np.ndarray:
    """The folder's rows in the split's training part (the split's own row choice)."""
    from trainyard.data.prepared import stratified_rows

    return stratified_rows(labels, SplitConfig(), split)["train"]
