"""What a running job shows while it trains: rank 0 keeps a small status file
(`<staging>/<run_id>/live.json`, replaced atomically about once a second) that the CLI's
progress bar reads, and the learning curves so far (`live-history.json`, replaced at most
about once a second, after an epoch ended) that `trainyard ui` draws before the record has
its history. Files, not a socket: the reader may be on another machine or not be there at
all, and the job must never wait for it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.engine.hooks import Hook
from trainyard.engine.train_state import TrainState
from trainyard.util.files import write_text_atomic

log = logging.getLogger(__name__)

LIVE_FILE = "live.json"
HISTORY_FILE = "live-history.json"
WRITE_EVERY_S = 1.0
# The curves file grows with the epochs: it is written again only after this many times the
# last write's duration, so a long run's writes stay under 2% of its time.
HISTORY_WRITE_SHARE = 50


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


class LiveHook(Hook):
    """Rank 0 only: no collective; a small file write at most once a second, and one at the
    last epoch's end (the loss it reads syncs the device, so not every step). Epochs of a
    few ms would otherwise write every epoch: digits epochs of ~40 ms made 25 writes a
    second, each 0.3 ms and now and then ~100 ms on ext4, while the other ranks waited.
    A write that fails (a full disk) ends the status, never the run."""

    def __init__(self, path: Path, run_id: str, epochs: int, world_size: int, monitor: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.run_id, self.epochs = path, run_id, epochs
        self.world_size, self.monitor = world_size, f"val_{monitor}"
        self.monitor_value: float | None = None
        self._written = 0.0
        self._failed = False
        self.curves = LiveCurves(path.parent / HISTORY_FILE)

    def on_step(self, state: TrainState) -> None:
        if self._due():
            self._write(state, state.epoch + 1)

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        self.monitor_value = row.get(self.monitor, self.monitor_value)
        last = state.epoch >= self.epochs or state.stop  # a hook before this one may stop it
        if self._due() or (last and not self._failed):
            self._write(state, state.epoch)  # state.epoch is the next epoch already
        self.curves.update(state.history, force=last)

    def _due(self) -> bool:
        return not self._failed and time.monotonic() - self._written >= WRITE_EVERY_S

    def _write(self, state: TrainState, epoch: int) -> None:
        meter = state.meter
        status = LiveStatus(
            run_id=self.run_id,
            epoch=max(1, min(epoch, self.epochs)),
            epochs=self.epochs,
            step=state.steps,
            total_steps=self.epochs * state.batches.steps_per_epoch,
            samples_per_s=meter.samples_per_s * self.world_size,
            loss=meter.epoch_loss_sum / meter.epoch_rows if meter.epoch_rows else None,
            monitor=self.monitor,
            monitor_value=self.monitor_value,
            written_at=time.time(),
        )
        self._written = time.monotonic()
        try:
            write_live(self.path, status)
        except OSError as exc:
            log.warning(
                "live status %s not written (%s); the progress bar stops here", self.path, exc
            )
            self._failed = True


class LiveCurves:
    """The history so far, as `trainyard ui` draws it: the whole of it each time (a resumed
    run's history is its checkpoint's, epochs redone included once), replaced atomically,
    at most about once a second and always after the last epoch."""

    def __init__(self, path: Path):
        self.path = path
        self._next_at = 0.0
        self._failed = False

    def update(self, history: list[dict[str, float]], force: bool = False) -> None:
        started = time.monotonic()
        if self._failed or (started < self._next_at and not force):
            return
        try:
            write_text_atomic(self.path, json.dumps(curve_rows(history)))
        except OSError as exc:
            log.warning(
                "live curves %s not written (%s); the page shows them at the end", self.path, exc
            )
            self._failed = True
            return
        spent = time.monotonic() - started
        self._next_at = started + max(WRITE_EVERY_S, HISTORY_WRITE_SHARE * spent)
