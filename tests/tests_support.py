"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from torch import nn

from trainyard.util.daemons import free_port


def write_params(folder: Path, text: str) -> Path:
    path = folder / "params.yaml"
    path.write_text(text)
    return path


def loopback_endpoint() -> str:
    """host:port on loopback for a rendezvous (torchrun binds it seconds later)."""
    return f"127.0.0.1:{free_port('127.0.0.1')}"


def tiny_model(in_features: int, num_classes: int, width: int = 4) -> nn.Module:
    """A user-supplied factory, referenced as tests_support:tiny_model."""
    return nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))


class _Exploding(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        import os

        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1 exploded")
        return self.linear(x)


def exploding_model(in_features: int, num_classes: int) -> nn.Module:
    """Fails inside rank 1's forward pass, as a user's bug would."""
    return _Exploding(in_features, num_classes)


class _ExplodesIf(nn.Module):
    def __init__(self, in_features: int, num_classes: int, explode: bool):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.explode = explode

    def forward(self, x):
        if self.explode and self.training:
            raise RuntimeError("this trial exploded on purpose")
        return self.linear(x)


def explodes_if(in_features: int, num_classes: int, explode: bool = False) -> nn.Module:
    """tests_support:explodes_if: builds either way; with explode=True, training raises."""
    return _ExplodesIf(in_features, num_classes, explode)


class _Slow(nn.Module):
    """Sleeps in every training forward (or, `in_training` False, every other forward), so a
    short run or a scoring job lasts long enough to interfere with."""

    def __init__(self, inner: nn.Module, seconds: float, in_training: bool = True):
        super().__init__()
        self.inner = inner
        self.seconds = seconds
        self.in_training = in_training

    def forward(self, x):
        if self.training == self.in_training:
            time.sleep(self.seconds)
        return self.inner(x)


def slow_mlp(in_features: int, num_classes: int, seconds: float = 0.03) -> nn.Module:
    """tests_support:slow_mlp: a small MLP whose training steps take at least `seconds`."""
    inner = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))
    return _Slow(inner, seconds)


def straggler_mlp(
    in_features: int, num_classes: int, slow_rank: int | None = 1, extra_s: float = 0.03
) -> nn.Module:
    """tests_support:straggler_mlp: a small MLP whose training steps on `slow_rank` (by the
    worker's RANK) sleep `extra_s` more than on the other ranks, as on a slower machine."""
    import os

    slow = slow_rank is not None and int(os.environ.get("RANK", "0")) == slow_rank
    inner = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))
    return _Slow(inner, extra_s if slow else 0.0)


class _Hangs(nn.Module):
    def __init__(self, inner: nn.Module, after_steps: int):
        super().__init__()
        self.inner = inner
        self.after_steps = after_steps
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps > self.after_steps:
                time.sleep(3600)  # stuck, as in a dead data source or a deadlock
        return self.inner(x)


# The file whose existence holds a held_mlp's training (one per test host, in its environment).
HOLD_ENV = "TRAINYARD_TEST_HOLD"


class _Held(nn.Module):
    def __init__(self, inner: nn.Module, after_steps: int):
        super().__init__()
        self.inner = inner
        self.after_steps = after_steps
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            hold = os.environ.get(HOLD_ENV)
            while self.steps > self.after_steps and hold and Path(hold).exists():
                time.sleep(0.05)
        return self.inner(x)


def held_mlp(in_features: int, num_classes: int, after_steps: int = 10) -> nn.Module:
    """tests_support:held_mlp: trains `after_steps` steps, then waits before every further
    step for as long as the file named by $TRAINYARD_TEST_HOLD exists: a test holds one
    host's trials mid-training, and lets them go, whatever the machine's speed."""
    inner = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))
    return _Held(inner, after_steps)


def hanging_mlp(in_features: int, num_classes: int, after_steps: int = 5) -> nn.Module:
    """tests_support:hanging_mlp: trains `after_steps` steps, then hangs on every rank."""
    inner = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))
    return _Hangs(inner, after_steps)


def spec_mlp(spec, width: int = 16) -> nn.Module:
    """tests_support:spec_mlp: a user factory that reads the typed data description."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(spec.num_features, width),
        nn.ReLU(),
        nn.Linear(width, spec.num_outputs),
    )


def points(path):
    """tests_support:points: a user dataset. Each line of a JSON-lines file is a point,
    {"x": [...], "label": k}; `labels` (class ids) lets the split stratify by them."""
    import json

    import torch

    from trainyard.data_spec import DataSpec
    from trainyard.datasets import MapDataset

    class Points(MapDataset):
        def __init__(self) -> None:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            self.x = torch.tensor([row["x"] for row in rows], dtype=torch.float32)
            self.labels = [int(row["label"]) for row in rows]
            self.y = torch.tensor(self.labels)

        def __len__(self) -> int:
            return len(self.y)

        def take(self, indices):
            return self.x[indices], self.y[indices]

        @property
        def spec(self):
            return DataSpec("table", (self.x.shape[1],), int(self.y.max()) + 1)

    return Points()


def smoothed_classification(stats):
    """tests_support:smoothed_classification: a user task, cross-entropy with label
    smoothing, scored by the classification task's exact metrics."""
    import torch.nn.functional as F

    from trainyard.objectives import Classification

    class Smoothed(Classification):
        name = "smoothed_classification"

        def loss_sum(self, outputs, targets):
            return F.cross_entropy(outputs, targets, reduction="sum", label_smoothing=0.1)

    return Smoothed(stats)


def manifest_fields(**overrides) -> dict:
    """A checkpoint's run fields and position (what CheckpointWriter.save takes as `meta`),
    for tests that write checkpoints directly."""
    return {
        "run_id": "test",
        "model": {"name": "mlp", "options": {}},
        "dataset_md5": None,
        "world_size": 1,
        "global_batch_size": 32,
        "strategy": "ddp",
        "schema": {},
        "params_hash": "0" * 16,
        "epoch": 0,
        "step_in_epoch": 0,
        **overrides,
    }


def slow_to_score_mlp(in_features: int, num_classes: int, seconds: float = 0.05) -> nn.Module:
    """tests_support:slow_to_score_mlp: every evaluation or prediction batch takes `seconds`."""
    inner = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))
    return _Slow(inner, seconds, in_training=False)


def read_comet_archive(path: str) -> tuple[list[str], dict, dict[str, list[float]]]:
    """An offline Comet archive's tags, logged others and metric values (in logged order)."""
    import json
    import zipfile

    with zipfile.ZipFile(path) as archive:
        tags = json.loads(archive.read("experiment.json"))["tags"]
        messages = [json.loads(line) for line in archive.read("messages.json").splitlines()]
    others: dict[str, Any] = {}
    metrics: dict[str, list[Any]] = {}
    for message in messages:
        payload = message["payload"]
        if message["type"] == "log_other":
            others[payload["key"]] = payload["value"]
        elif message["type"] == "metric_msg":
            metric = payload["metric"]
            metrics.setdefault(metric["metricName"], []).append(metric["metricValue"])
    return tags, others, metrics


class _FailsAt(nn.Module):
    def __init__(self, inner: nn.Module, step: int, rank: int):
        super().__init__()
        self.inner = inner
        self.step, self.rank = step, rank
        self.steps = 0

    def forward(self, x):
        import os

        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.steps += 1
            if self.steps == self.step:
                # The pid differs on every attempt: the same error, not the same text.
                raise RuntimeError(
                    "cannot reshape tensor of 0 elements into shape [0, 64, 4, -1] "
                    f"(pid {os.getpid()})"
                )
        return self.inner(x)


def fails_at_step(in_features: int, num_classes: int, step: int = 5, rank: int = 1) -> nn.Module:
    """tests_support:fails_at_step: a small MLP whose `step`-th training step on `rank` (by
    the worker's RANK) raises, after every start alike: a deterministic bug."""
    inner = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))
    return _FailsAt(inner, step, rank)


PICTURE_SIZES = ((12, 12), (16, 10), (20, 20))  # (height, width): three per folder, all used
# Modes a folder of photos, scans and icons mixes; JPEG stores only L and RGB.
PICTURE_MODES = {"png": ("RGB", "L", "RGBA", "P", "RGB", "I;16", "LA", "RGB")}


def write_pictures(root: Path, suffix: str, per_class: int = 12, classes: int = 3, seed: int = 0):
    """`classes` folders of `per_class` images each, written by Pillow as `suffix` files,
    in PICTURE_SIZES and mixed modes: class k's pixels are bright in channel k (and so each
    class has its own grey level too), with noise. Returns the files, by class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    modes = PICTURE_MODES.get(suffix, ("RGB", "RGB", "L"))
    written = []
    for label in range(classes):
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = PICTURE_SIZES[i % len(PICTURE_SIZES)]
            pixels = rng.integers(0, 50, (height, width, 3)).astype(np.uint8)
            pixels[..., label % 3] += 160 + 30 * (label // 3)
            image, mode = Image.fromarray(pixels, "RGB"), modes[i % len(modes)]
            if mode == "I;16":  # 16-bit grey, as scanners write it
                image = Image.fromarray(np.asarray(image.convert("L")).astype(np.uint16) * 257)
            elif mode != "RGB":
                image = image.convert(mode)
            image.save(folder / f"{i:03d}.{suffix}")
            written.append(folder / f"{i:03d}.{suffix}")
    return written


def alone_slow_mlp(
    in_features: int, num_classes: int, seconds: float = 0.05, alone_seconds: float = 0.5
) -> nn.Module:
    """tests_support:alone_slow_mlp: slow_mlp whose training forwards take `alone_seconds`
    in a world of one worker (WORLD_SIZE), `seconds` in a larger one: an elastic run that
    lost its other nodes trains on slowly, for as long as they may take to return."""
    import os

    alone = os.environ.get("WORLD_SIZE") == "1"
    inner = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))
    return _Slow(inner, alone_seconds if alone else seconds)
