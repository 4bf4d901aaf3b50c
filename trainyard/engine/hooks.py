"""What attaches to the training loop: tracking, progress (the hang watchdog and restart
accounting) and checkpoints. Every rank calls every hook, in order, so a hook may take part
in a collective (the checkpoint gathers every rank's RNG); side effects belong to the
objects a hook holds (rank 0's checkpoint writer, each rank's tracker). A hook that wants
training to end sets `state.stop` at an epoch's end: the loop stops there, cleanly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainyard.checkpoint.resume import capture_rng
from trainyard.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from trainyard.config import CheckpointConfig
from trainyard.dist import DistContext, all_gather_objects, gather_objects, rank0_decides
from trainyard.engine.interrupt_checkpoint import StopRequest, StopTraining
from trainyard.engine.system_metrics import SystemSampler
from trainyard.engine.tracking import Tracker
from trainyard.engine.train_state import TrainState
from trainyard.sync.communication import Communication, tensor_bytes

if TYPE_CHECKING:  # FSDP jobs only: importing it imports DCP (most of a second)
    from trainyard.checkpoint.sharded import ShardStager

log = logging.getLogger(__name__)


class Hook:
    def on_step(self, state: TrainState) -> None:
        """After each update (state.steps counts it)."""

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        """After validation; `row` is the epoch's history row, state.epoch the next one."""


class TrackingHook(Hook):
    """One point per logging window (its means, the system's load, and what other hooks
    added since the last point), and each epoch's row with its last partial window, at most
    one row per `min_interval_s`: the run record keeps every epoch, and epochs shorter than
    that (a digits epoch is ~40 ms) would pay Comet for 50 points a second. A row not due
    waits for `finish`, which logs the last epoch's. One tracker call per window: each is
    0.4-0.9 ms of CPU between the call and Comet's writer thread, which sub-millisecond
    steps feel twice if two hooks log apart."""

    def __init__(
        self, tracker: Tracker, system: SystemSampler | None = None, min_interval_s: float = 0.0
    ):
        self.tracker, self.system, self.min_interval_s = tracker, system, min_interval_s
        self._added: dict[str, float] = {}
        self._row_logged_at: float | None = None
        self._held: tuple[int, dict[str, float], dict[str, float]] | None = None

    def add_worst(self, metrics: dict[str, float]) -> None:
        """Metrics for the next point (a hook called before this one: the same step's),
        each the highest value added since the last point."""
        for name, value in metrics.items():
            self._added[name] = max(value, self._added.get(name, value))

    def on_step(self, state: TrainState) -> None:
        if state.meter.window_full:
            self._log_window(state.steps, self._window(state))

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        window = self._window(state)  # read now: the next epoch opens a new one
        last = self._row_logged_at
        if last is not None and time.monotonic() - last < self.min_interval_s:
            self._held = (state.steps, window, row)  # the latest row not logged, for finish
            return
        self._log_epoch(state.steps, window, row)

    def finish(self) -> None:
        """After the last epoch: its row, if it came too soon after the last one logged."""
        if self._held is not None:
            self._log_epoch(*self._held)

    def _window(self, state: TrainState) -> dict[str, float]:
        metrics = state.meter.window()
        lr = float(state.scheduler.get_last_lr()[0])  # a float already (LambdaLR's)
        return {**metrics, "lr": lr} if metrics else {}

    def _log_window(self, step: int, window: dict[str, float]) -> None:
        if window:
            system = self.system.sample() if self.system else {}
            added, self._added = self._added, {}
            self.tracker.log_metrics({**window, **system, **added}, step=step)

    def _log_epoch(self, step: int, window: dict[str, float], row: dict[str, float]) -> None:
        self._log_window(step, window)  # the epoch's last partial window
        self.tracker.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=step)
        self._row_logged_at, self._held = time.monotonic(), None


class ProgressHook(Hook):
    """Tells `on_progress` the global step after every update and every validation."""

    def __init__(self, on_progress: Callable[[int], None]):
        self.on_progress = on_progress

    def on_step(self, state: TrainState) -> None:
        self.on_progress(state.steps)

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        self.on_progress(state.steps)  # validation was progress too (for the hang watchdog)


class CheckpointHook(Hook):
    """Every `every_n_steps` inside an epoch, every `every_n_minutes`, every `every_n_epochs`
    that the store keeps up with (`max_overhead`), and at the last one: the configured last,
    or the one a hook called before this one stopped training at. Interrupted (`stop`, see
    trainyard.engine.interrupt_checkpoint), at the step every rank stops at, then StopTraining."""

    CLOCK_CHECK_EVERY = 16  # steps between the ranks' agreement on the clock

    def __init__(
        self,
        config: CheckpointConfig,
        epochs: int,
        writer: CheckpointWriter | NullCheckpointWriter,
        meta: dict[str, Any],
        shard_stager: ShardStager | None = None,
        ctx: DistContext | None = None,
        stop: StopRequest | None = None,
    ):
        self.config, self.epochs, self.writer = config, epochs, writer
        self.stop = stop
        self._stop_at_epoch_end = False  # agreed at an epoch's last step: its end saves
        self.meta, self.shard_stager = meta, shard_stager
        self.rank, self.device = (ctx.rank, ctx.device) if ctx else (0, torch.device("cpu"))
        self.last_saved = time.monotonic()
        self.saved_steps: list[int] = []  # on every rank: each rank takes part in each save
        self.gathers = Communication()  # the saves' gathers: checkpoint_bytes, _wait_s
        self.skipped_epochs: list[int] = []  # every_n_epochs ones the store could not take
        self._epochs_ended = 0

    def on_step(self, state: TrainState) -> None:
        every = self.config.every_n_steps
        stop = self.stop is not None and self.stop.agreed()
        if state.step_in_epoch >= state.batches.steps_per_epoch:
            self._stop_at_epoch_end = stop
            return  # the epoch's end decides, with the validation metrics
        if (
            stop
            or (every and state.steps % every == 0)
            or (state.steps % self.CLOCK_CHECK_EVERY == 0 and self._minutes_due(state))
        ):
            self.save(state, {})
        if stop:
            raise StopTraining(state.steps)

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        every = self.config.every_n_steps
        self._epochs_ended += 1
        if (
            state.epoch == self.epochs
            or state.stop  # a hook before this one ended training here: the run's last epoch
            or self._stop_at_epoch_end
            or (every and state.steps % every == 0)
            or self._minutes_due(state)
            or (state.epoch % self.config.every_n_epochs == 0 and self._store_keeps_up(state))
        ):
            self.save(state, {k: v for k, v in row.items() if k.startswith("val_")})
        if self._stop_at_epoch_end:
            raise StopTraining(state.steps)

    def log_cadence(self) -> None:
        """Rank 0, after training: how often `max_overhead` let epochs checkpoint, as the
        policy it is (spacing checkpoints out is what it is for), not as a fault."""
        if self.rank != 0 or not self.skipped_epochs:
            return
        taken = self._epochs_ended - len(self.skipped_epochs)
        interrupt = (
            "an interrupt still commits a checkpoint where it stops"
            if self.stop is not None
            else "an interrupt keeps the last of them (checkpoint.on_interrupt is off)"
        )
        log.info(
            "checkpointed %d of %d epochs, about one every %.0f, to keep the store under "
            "checkpoint.max_overhead=%g of the time; %s",
            taken,
            self._epochs_ended,
            self._epochs_ended / max(taken, 1),
            self.config.max_overhead,
            interrupt,
        )

    def _store_keeps_up(self, state: TrainState) -> bool:
        """Epochs shorter than a checkpoint's trip to the store would keep the uploader
        (and the CPU the workers train on) busy all the time: such epochs skip theirs."""
        share = self.config.max_overhead
        if share is None:
            return True
        since_last_s = time.monotonic() - self.last_saved
        keeps_up = rank0_decides(self.writer.keeps_up(since_last_s, share), self.rank, self.device)
        if not keeps_up:
            self.skipped_epochs.append(state.epoch)
        return keeps_up

    def _minutes_due(self, state: TrainState) -> bool:
        minutes = self.config.every_n_minutes
        if minutes is None:
            return False
        due = time.monotonic() - self.last_saved >= minutes * 60
        return rank0_decides(due, self.rank, self.device)

    def save(self, state: TrainState, metrics: dict[str, float]) -> None:
        # Every rank takes part (its RNG state is gathered); only rank 0's writer stores it.
        self.last_saved = time.monotonic()
        self.saved_steps.append(state.steps)
        rng = self._gathered(all_gather_objects, capture_rng())
        payload = {**state.state_dict(sharded=self.shard_stager is not None), "rng": rng}
        if state.sync is not None:  # each worker's own weights and optimizer (local_sgd, diloco)
            # rank 0 writes them
            payload["replicas"] = self._gathered(gather_objects, state.replica_state())
        position = {"epoch": state.epoch, "step_in_epoch": state.step_in_epoch}
        meta = {**self.meta, **position, "metrics": metrics}
        if self.shard_stager is None:
            self.writer.save(state.steps, payload, meta)
            return
        # fsdp: one file per rank, written by every rank
        shards, uploaded = self.shard_stager.stage(state.steps, state.wrapped, state.optimizer)
        self.writer.save(state.steps, payload, meta, shards=shards, uploaded=uploaded)

    def _gathered(self, gather: Callable[[Any], Any], own: Any) -> Any:
        """`gather(own)`, its tensors' bytes and its seconds counted: a local_sgd worker's
        own state crosses the link at every checkpoint, as much as a sync does."""
        started = time.perf_counter()
        gathered = gather(own)
        self.gathers.checkpoint_wait_s += time.perf_counter() - started
        self.gathers.checkpoint_bytes += tensor_bytes(own)
        return gathered
