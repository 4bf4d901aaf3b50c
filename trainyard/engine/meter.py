"""Per-step bookkeeping that costs the training loop nothing it does not need.

The loss is summed on the device and read once per logging window, so a step never waits
for a device sync (or pays a tracker call) just to be counted; tracking gets one point per
`tracking.log_every_n_steps` steps, at most one per `tracking.min_interval_s`, with the
window's means.
"""

from __future__ import annotations

import time

import torch


class StepMeter:
    def __init__(self, device: torch.device, log_every_n_steps: int, min_interval_s: float = 0.0):
        self.log_every_n_steps, self.min_interval_s = log_every_n_steps, min_interval_s
        self.device = device
        self.busy_s = 0.0  # over everything this process ran, for its mean throughput
        self.waited_s = 0.0  # of which waiting for batches
        self.seen = 0
        self.start_epoch()

    def start_epoch(self, loss_sum: float = 0.0, rows: int = 0) -> None:
        """A new epoch, or the rest of one a checkpoint had started (its loss and rows so far)."""
        self._epoch_loss = torch.tensor(loss_sum, dtype=torch.float64, device=self.device)
        self._step_losses: list[torch.Tensor] = []  # not yet added to _epoch_loss
        self.epoch_rows = rows
        self.epoch_wait_s = 0.0
        self.epoch_started = time.perf_counter()
        self._open_window(loss_sum)

    def _open_window(self, loss_sum: float) -> None:
        self._window_opened = time.perf_counter()
        self._window_loss_start = loss_sum
        self._window_rows = self._window_steps = 0
        self._window_busy_s = self._window_wait_s = 0.0

    def record(self, loss_sum: torch.Tensor, rows: int, step_s: float, wait_s: float) -> None:
        """Count one step (`loss_sum` detached). Whether a logging window is full is the
        tracking hook's question (`window_full`), asked once a step."""
        # An append, not an add: at sub-millisecond steps even one op per step shows.
        self._step_losses.append(loss_sum)
        self.epoch_rows += rows
        self.epoch_wait_s += wait_s
        self.busy_s += step_s
        self.waited_s += wait_s
        self.seen += rows
        self._window_rows += rows
        self._window_steps += 1
        self._window_busy_s += step_s
        self._window_wait_s += wait_s

    @property
    def window_full(self) -> bool:
        return (
            self._window_steps >= self.log_every_n_steps
            and time.perf_counter() - self._window_opened >= self.min_interval_s
        )

    @property
    def epoch_loss_sum(self) -> float:
        if self._step_losses:  # summed in float64, as exact as adding them one by one
            self._epoch_loss += torch.stack(self._step_losses).double().sum()
            self._step_losses = []
        return self._epoch_loss.item()

    def window(self) -> dict[str, float]:
        """This window's means (loss per row, samples/s, step and data-wait time), then a new one."""
        if not self._window_steps:
            return {}
        total = self.epoch_loss_sum
        steps = self._window_steps
        metrics = {
            "loss": (total - self._window_loss_start) / max(self._window_rows, 1),
            "samples_per_s": self._window_rows / self._window_busy_s,
            "step_time_s": self._window_busy_s / steps,
            "data_wait_s": self._window_wait_s / steps,
        }
        self._open_window(total)
        return metrics

    @property
    def samples_per_s(self) -> float:
        return self.seen / self.busy_s if self.busy_s else 0.0


class OwnTimeClock:
    """Times each step's own part on this rank: from the step's start (waiting for its batch
    included) to the start of the backward pass that synchronizes the gradients. What comes
    after waits for the slowest rank, so only this part tells a slow rank from a waiting one.

    On a GPU the marks are CUDA events on the current stream, so the time is the device's
    (kernels, and gaps where it waited for this thread), not how fast the thread queued work;
    they are read together by `take`, which waits for the device once."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._opened: float | torch.cuda.Event | None = None
        self._spans: list[tuple] = []

    def start(self) -> None:
        self._opened = self._mark()

    def stop(self) -> None:
        if self._opened is not None:
            self._spans.append((self._opened, self._mark()))
            self._opened = None

    def take(self) -> list[float]:
        """Seconds of each step timed since the last take."""
        spans, self._spans = self._spans, []
        if self._cuda and spans:
            spans[-1][1].synchronize()
            return [begun.elapsed_time(ended) / 1000 for begun, ended in spans]
        return [ended - begun for begun, ended in spans]

    def _mark(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class NullClock:
    """What the loop marks when nothing reads the marks (one worker, detection off)."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def take(self) -> list[float]:
        return []
