"""A running job's live files, beside its staged checkpoints: rank 0 keeps a small status
file (`<staging>/<run_id>/live.json`, replaced atomically about once a second) that the
CLI's progress bar reads, and the learning curves so far (`live-history.json`) that
`trainyard ui` draws before the record has its history. Their names, their format and
their readers live here, below the engine that writes them (trainyard.engine.live) and the
report and CLI that read them. Files, not a socket: the reader may be on another machine or
not be there at all, and the job must never wait for it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.util.files import write_text_atomic

LIVE_FILE = "live.json"
HISTORY_FILE = "live-history.json"


@dataclass(frozen=True)
class LiveStatus:
    run_id: str
    epoch: int  # 1-based: the epoch being trained, or the one just validated
    epochs: int
    step: int  # global optimizer steps done
    total_steps: int
    samples_per_s: float  # all ranks together, mean over this attempt's training time
    loss: float | None  # rank 0's mean train loss over the epoch so far
    monitor: str  # the monitored validation metric, e.g. val_accuracy
    monitor_value: float | None  # at the last validation
    written_at: float  # time.time()


def live_path(staging: Path, run_id: str) -> Path:
    return staging / run_id / LIVE_FILE


def write_live(path: Path, status: LiveStatus) -> None:
    write_text_atomic(path, json.dumps(asdict(status)))


def history_path(staging: Path, run_id: str) -> Path:
    return staging / run_id / HISTORY_FILE


def curve_rows(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each epoch's row with what a learning curve draws: its number and the train_* and
    val_* metrics, not the timings and row counts."""
    return [
        {
            key: value
            for key, value in row.items()
            if key == "epoch" or (key.startswith(("train_", "val_")) and not key.endswith("_s"))
        }
        for row in history
    ]


def write_curves(path: Path, history: list[dict[str, float]]) -> None:
    write_text_atomic(path, json.dumps(curve_rows(history)))


def read_live_history(path: Path) -> list[dict[str, float]] | None:
    """The curves a running run wrote last, or None (none yet, or not a list of rows of
    numbers: the page never draws what it cannot read)."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(rows, list) and all(
        isinstance(row, dict)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row.values())
        for row in rows
    )
    return rows if valid else None


def read_live(path: Path) -> LiveStatus | None:
    """The last status written, or None (not yet written, or from another trainyard)."""
    try:
        return LiveStatus(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
