"""A user dataset that counts its reads (data.dataset `counted_reads:counted_points`), and
the per-epoch multiset of training rows a run's processes read.

Each process appends one JSON line per read (the rows asked for) to its own file in
$READS_DIR, when that is set. Within one process the reads come in order: an epoch's
training rows, then the validation rows (other rows of the same file) that close it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

READS_DIR = "READS_DIR"


def write_points(path: Path, rows: int) -> None:
    """Three separable clusters of 2-d points, one JSON line each."""
    import numpy as np

    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for label in rng.integers(0, 3, rows):
            point = centers[label] + rng.normal(0, 0.8, 2)
            out.write(json.dumps({"x": point.tolist(), "label": int(label)}) + "\n")


def counted_points(path):
    """counted_reads:counted_points: the points of `path`, each read logged."""
    import torch

    from trainyard.data_spec import DataSpec
    from trainyard.datasets import MapDataset

    class CountedPoints(MapDataset):
        def __init__(self) -> None:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
            self.x = torch.tensor([row["x"] for row in rows], dtype=torch.float32)
            self.labels = [int(row["label"]) for row in rows]
            self.y = torch.tensor(self.labels)
            folder = os.environ.get(READS_DIR)
            self.log = Path(folder) / f"reads-{os.getpid()}.jsonl" if folder else None

        def __len__(self) -> int:
            return len(self.y)

        def take(self, indices):
            if self.log is not None:
                with open(self.log, "a") as out:
                    out.write(json.dumps(indices.tolist()) + "\n")
            return self.x[indices], self.y[indices]

        @property
        def spec(self):
            return DataSpec("table", (self.x.shape[1],), int(self.y.max()) + 1)

    return CountedPoints()


def reads_per_epoch(folder: Path, train_rows: set[int], first_epoch: int) -> dict[int, Counter]:
    """{epoch: how often each training row was read} over the processes that logged in
    `folder`, all of which started in `first_epoch` (a resume's checkpoint epoch)."""
    per_epoch: dict[int, Counter] = {}
    for log in sorted(folder.glob("reads-*.jsonl")):
        epoch, evaluating = first_epoch, False
        for line in log.read_text().splitlines():
            rows = json.loads(line)
            if not set(rows) <= train_rows:  # validation or test rows: the epoch is over
                evaluating = True
                continue
            if evaluating:
                epoch, evaluating = epoch + 1, False
            per_epoch.setdefault(epoch, Counter()).update(rows)
    return per_epoch
