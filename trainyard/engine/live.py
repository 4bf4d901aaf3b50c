"""What a running job shows while it trains: rank 0's hook that keeps the run's live files
(trainyard.runs.live_files: the status the CLI's progress bar reads, about once a second, and
the learning curves so far that `trainyard ui` draws before the record has its history). The
job never waits for a reader."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainyard.engine.hooks import Hook
from trainyard.engine.train_state import TrainState
from trainyard.runs.live_files import HISTORY_FILE, LiveStatus, write_curves, write_live

log = logging.getLogger(__name__)

WRITE_EVERY_S = 1.0
# The curves file grows with the epochs: it is written again only after this many times the
# last write's duration, so a long run's writes stay under 2% of its time.
HISTORY_WRITE_SHARE = 50


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
            write_curves(self.path, history)
        except OSError as exc:
            log.warning(
                "live curves %s not written (%s); the page shows them at the end", self.path, exc
            )
            self._failed = True
            return
        spent = time.monotonic() - started
        self._next_at = started + max(WRITE_EVERY_S, HISTORY_WRITE_SHARE * spent)
