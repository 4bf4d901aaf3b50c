"""Memory stays flat as data grows: with a table 4x larger on disk, neither the process that
runs the CLI and the flow (checks, split, record) nor a worker grows its peak resident memory
by more than 20%. Each process reports its own high-water mark (VmHWM) into the run record."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import trainyard_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROWS_1X = 40_000  # about 6 MB of CSV; the whole table as pandas would hold ~5x that


def write_table(path, rows: int) -> None:
    """Digits-like rows (64 small-integer features and a label), written in blocks."""
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ",".join([f"f{i}" for i in range(64)] + ["label"])
    with open(path, "w") as out:
        out.write(header + "\n")
        for start in range(0, rows, 25_000):
            n = min(25_000, rows - start)
            block = np.column_stack([rng.integers(0, 17, (n, 64)), rng.integers(0, 10, n)])
            np.savetxt(out, block, fmt="%d", delimiter=",")


def peaks(project, store, run_id: str, table: str) -> dict:
    done = trainyard_cli(
        "run", "--run-id", run_id, "-S", f"data.path=data/raw/{table}",
        "-S", "tracking.backend=none", "-S", "train.epochs=1", "-S", "train.batch_size=1024",
        "-S", "model.options={hidden_sizes: [32]}",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return load_record(store, run_id).peak_rss_mb


def test_peak_memory_does_not_grow_with_the_table(project, use_store):
    write_table(project / "data/raw/small.csv", ROWS_1X)
    write_table(project / "data/raw/large.csv", 4 * ROWS_1X)
    size = (project / "data/raw/large.csv").stat().st_size
    assert size > 3.9 * (project / "data/raw/small.csv").stat().st_size
    store = Store(use_store)
    small, large = (
        peaks(project, store, "mem-1x", "small.csv"),
        peaks(project, store, "mem-4x", "large.csv"),
    )
    print(f"peak RSS MB, 1x vs 4x ({size / 1e6:.0f} MB CSV): {small} vs {large}")
    assert large["flow"] <= 1.2 * small["flow"], (small, large)
    assert len(large["workers"]) == 2
    for before, after in zip(small["workers"], large["workers"], strict=True):
        assert after <= 1.2 * before, (small, large)
