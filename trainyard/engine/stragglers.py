"""Stragglers: a rank whose steps stay slower than the other ranks' for several windows.

What is compared. The gradient all-reduce makes every rank wait for the slowest, so whole
step times are alike on every rank and cannot say which one is slow. Each rank therefore
times its own part of a step (`meter.OwnTimeClock`): from the step's start, waiting for its
batch included, to the start of the backward pass that synchronizes the gradients. A slow
rank's own part is long; a fast rank's stays short, since its waiting comes after the mark.
Under fsdp the forward pass gathers parameters from every rank, so a fast rank's part holds
some waiting too: slowdowns read smaller there, never larger, and fewer ranks are flagged.

The rule. After each window of `stragglers.window_steps` global steps every rank puts the
median of its own parts into one small all-reduce, and every rank reaches the same verdict
from the same numbers. In a pipeline a rank is compared only with the ranks holding the same
stage (`check_by_stage`). A rank is slow in a window when its median is above the median of the
*other* ranks' medians by more than max(mad_factor x 1.4826 x their MAD, min_slowdown x
their median, min_gap_ms). The rank is left out of its own reference because with two ranks
the median of both is their mean and each lies exactly one MAD from it: a rule against all
ranks could never flag either. The floor in milliseconds is there because on a busy CPU
(2 cores, load 5) two healthy ranks' 1 ms steps were measured 2-4x apart (up to ~2 ms) for
three windows in a row: scheduling noise, not a slow rank worth a warning.
`windows_in_a_row` slow windows make a straggler, until a window that is not slow; each such
stretch is one `Straggler` entry of the run.

The same all-reduce carries each rank's mean wait for a batch in the window: with the medians
they are the run's per-rank lanes (`RankLanes`), which the comparison page draws.

The all-reduce is started without waiting for it and read at the next window's end (or when
training ends), by when it is long done: waiting for it made each window's last step wait
for the other ranks a second time, 67-80 us a step of the digits MLP's ~2 ms on 2 cores.
A window's verdict is told one window later.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainyard.config import StragglersConfig, TrainyardConfig
from trainyard.dist import DistContext, all_reduce_sum_started
from trainyard.engine.hooks import Hook
from trainyard.engine.meter import NullClock, OwnTimeClock
from trainyard.engine.train_state import TrainState
from trainyard.runs.record import RankLanes, Straggler

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal noise
# Lanes keep between this many windows and twice as many: a record stays small however long
# the run, and a short run keeps every window.
MAX_LANE_WINDOWS = 128


@dataclass(frozen=True)
class WindowCheck:
    """One rank in one window: its median own step time against the other ranks'."""

    median_s: float
    others_s: float  # the median of the other ranks' medians
    slow: bool

    @property
    def slowdown(self) -> float:
        return self.median_s / self.others_s if self.others_s > 0 else 1.0


def check_window(medians: Sequence[float], rule: StragglersConfig) -> list[WindowCheck]:
    """Each rank's window median (seconds, by rank) against the other ranks' (see the rule)."""
    if len(medians) < 2:  # nobody to be slower than
        return [WindowCheck(mine, mine, False) for mine in medians]
    ordered = sorted(medians)
    checks = []
    for mine in medians:
        at = bisect.bisect_left(ordered, mine)
        reference = _median_without(ordered, at)
        floor = max(rule.min_slowdown * reference, rule.min_gap_ms / 1000)
        # Only a rank above the floor can be slow: the MAD, a pass over all the ranks, is
        # computed for those few alone (thousands of ranks stay cheap).
        slow = reference > 0 and mine > reference + floor
        if slow:
            others = ordered[:at] + ordered[at + 1 :]
            spread = MAD_TO_SIGMA * statistics.median(abs(m - reference) for m in others)
            slow = mine > reference + rule.mad_factor * spread
        checks.append(WindowCheck(mine, reference, slow))
    return checks


def check_by_stage(
    medians: Sequence[float], rule: StragglersConfig, pipeline: int = 1, tensor: int = 1
) -> list[WindowCheck]:
    """`check_window` among the ranks holding the same pipeline stage: stages do different
    work (the last one scores the loss), so a rank is compared with its peers only, the
    workers of its tensor group and the same stage's workers in the other replicas. Without
    a pipeline every rank is a peer; a pipeline of one replica and no tensor split has none,
    and so no stragglers (a slow stage there is a slow pipeline)."""
    stage_of = [(rank // tensor) % pipeline for rank in range(len(medians))]
    checks: dict[int, WindowCheck] = {}
    for stage in sorted(set(stage_of)):
        peers = [rank for rank, held in enumerate(stage_of) if held == stage]
        verdicts = check_window([medians[rank] for rank in peers], rule)
        checks.update(zip(peers, verdicts, strict=True))
    return [checks[rank] for rank in range(len(medians))]


def _median_without(ordered: Sequence[float], at: int) -> float:
    """The median of sorted values without the one at index `at`."""
    count = len(ordered) - 1

    def nth(i: int) -> float:
        return ordered[i if i < at else i + 1]

    middle = count // 2
    return nth(middle) if count % 2 else (nth(middle - 1) + nth(middle)) / 2


@dataclass
class _Stretch:
    """Consecutive slow windows of one rank."""

    rank: int
    first_step: int
    last_step: int = 0
    windows: int = 0
    median_sum_s: float = 0.0
    others_sum_s: float = 0.0

    def add(self, last_step: int, check: WindowCheck) -> None:
        self.last_step, self.windows = last_step, self.windows + 1
        self.median_sum_s += check.median_s
        self.others_sum_s += check.others_s

    def entry(self) -> Straggler:
        median_ms = 1000 * self.median_sum_s / self.windows
        others_ms = 1000 * self.others_sum_s / self.windows
        return Straggler(
            rank=self.rank,
            first_step=self.first_step,
            last_step=self.last_step,
            windows=self.windows,
            median_step_ms=round(median_ms, 3),
            ranks_median_step_ms=round(others_ms, 3),
            slowdown=round(median_ms / others_ms, 3),  # a slow window's others_s is > 0
        )


class StragglerWatch:
    """Stretches of slow windows per rank: `windows_in_a_row` of them make a straggler, which
    the rank stays until a window where it is not slow."""

    def __init__(self, windows_in_a_row: int):
        self.windows_in_a_row = windows_in_a_row
        self._stretches: dict[int, _Stretch] = {}  # ranks slow in the last window
        self._found: list[_Stretch] = []  # stretches long enough, in the order found

    def observe(
        self, first_step: int, last_step: int, checks: Sequence[WindowCheck]
    ) -> tuple[list[Straggler], list[Straggler]]:
        """One window's checks (by rank) over steps first_step..last_step; returns the
        stragglers it made and those it ended."""
        began, ended = [], []
        for rank, check in enumerate(checks):
            if not check.slow:
                stretch = self._stretches.pop(rank, None)
                if stretch is not None and stretch.windows >= self.windows_in_a_row:
                    ended.append(stretch.entry())
                continue
            stretch = self._stretches.setdefault(rank, _Stretch(rank, first_step))
            stretch.add(last_step, check)
            if stretch.windows == self.windows_in_a_row:
                self._found.append(stretch)
                began.append(stretch.entry())
        return began, ended

    def flagged(self, rank: int) -> bool:
        stretch = self._stretches.get(rank)
        return stretch is not None and stretch.windows >= self.windows_in_a_row

    def stragglers(self) -> list[Straggler]:
        return [stretch.entry() for stretch in self._found]


class LaneRecorder:
    """Every window's per-rank times; when there are too many, neighbours are merged two by
    two and later windows are kept as means of as many."""

    def __init__(self, window_steps: int):
        self.lanes = RankLanes(window_steps=window_steps)
        self._per_kept = 1  # the hook's windows in one kept window
        self._pending: list[tuple[int, Sequence[float], Sequence[float]]] = []

    def add(self, last_step: int, own_s: Sequence[float], wait_s: Sequence[float]) -> None:
        self._pending.append((last_step, own_s, wait_s))
        if len(self._pending) < self._per_kept:
            return
        self._keep_pending()
        if len(self.lanes.steps) == 2 * MAX_LANE_WINDOWS:
            self._per_kept *= 2
            self.lanes = self.lanes.halved()

    def finish(self) -> RankLanes:
        """The lanes, with the windows not yet kept as a last, shorter one."""
        if self._pending:
            self._keep_pending()
        return self.lanes

    def _keep_pending(self) -> None:
        lanes = self.lanes
        lanes.steps.append(self._pending[-1][0])
        lanes.own_step_ms.append(_mean_ms([own for _, own, _ in self._pending]))
        lanes.data_wait_ms.append(_mean_ms([wait for _, _, wait in self._pending]))
        self._pending = []


def _mean_ms(windows: list[Sequence[float]]) -> list[float]:
    return [round(1000 * sum(ranks) / len(ranks), 3) for ranks in zip(*windows, strict=True)]


@dataclass
class _Gathering:
    """One window's all-reduce, started: `values` holds the sums once `wait` returns."""

    first_step: int
    last_step: int
    values: torch.Tensor
    wait: Callable[[], object]


class StragglerHook(Hook):
    """Every window: one all-reduce of the ranks' median own step times, started, and read at
    the next window's end or the epoch's end, whichever comes first: the same verdict on every
    rank, a warning when a rank becomes a straggler, and each rank's own verdict for its
    tracker (`straggler` 0/1, `slowdown_vs_ranks`, `own_step_time_s`), handed to `track`:
    the tracking hook's next point, which keeps the worst since its last. Off at one worker."""

    def __init__(
        self,
        config: TrainyardConfig,
        ctx: DistContext,
        track: Callable[[dict[str, float]], None],
    ):
        self.rule = config.stragglers
        self.active = self.rule.enabled and ctx.world_size > 1
        self.clock = OwnTimeClock(ctx.device) if self.active else NullClock()
        self.window = self.rule.window_steps or config.tracking.log_every_n_steps
        self.watch = StragglerWatch(self.rule.windows_in_a_row)
        self.recorder = LaneRecorder(self.window)
        self.ctx, self.track = ctx, track  # into the tracking hook's next point
        parallel = config.train.parallel
        self.layout = (parallel.pipeline, parallel.tensor)  # who is compared with whom
        self._opened: int | None = None  # the first step of the window being timed
        self._waited_s = 0.0  # the meter's wait for batches when the last window closed
        self._gathering: _Gathering | None = None  # the last window's all-reduce

    def on_step(self, state: TrainState) -> None:
        if not self.active:
            return
        if self._opened is None:
            self._opened = state.steps
        # Global steps: every rank closes its windows at the same steps, or the all-reduce hangs.
        if state.steps % self.window == 0:
            waited_s, self._waited_s = state.meter.waited_s - self._waited_s, state.meter.waited_s
            self._judge_gathered()
            self._gathering = self._start_gather(self._opened, state.steps, waited_s)
            self._opened = None

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        # Before the tracking hook's epoch-end point, which then carries the epoch's last verdict.
        self._judge_gathered()

    def found(self) -> list[Straggler]:
        self._judge_gathered()
        return self.watch.stragglers()

    def lanes(self) -> RankLanes | None:
        self._judge_gathered()
        lanes = self.recorder.finish() if self.active else None
        return lanes if lanes and lanes.steps else None

    def _start_gather(self, first_step: int, last_step: int, waited_s: float) -> _Gathering:
        """Every rank's median own step time and mean wait for a batch in this window (s, by
        rank) into one all-reduce, started."""
        world, rank = self.ctx.world_size, self.ctx.rank
        values = torch.zeros(2 * world, dtype=torch.float64, device=self.ctx.device)
        values[rank] = statistics.median(self.clock.take())
        values[world + rank] = waited_s / (last_step - first_step + 1)
        return _Gathering(first_step, last_step, values, all_reduce_sum_started(values))

    def _judge_gathered(self) -> None:
        gathering, self._gathering = self._gathering, None
        if gathering is None:
            return
        gathering.wait()
        values, world = gathering.values.tolist(), self.ctx.world_size
        self._judge(gathering.first_step, gathering.last_step, values[:world], values[world:])

    def _judge(
        self, first_step: int, last_step: int, medians: list[float], waits: list[float]
    ) -> None:
        self.recorder.add(last_step, medians, waits)
        checks = check_by_stage(medians, self.rule, *self.layout)
        began, ended = self.watch.observe(first_step, last_step, checks)
        self._report(began, ended)
        rank = self.ctx.rank
        mine = {
            "straggler": float(self.watch.flagged(rank)),
            "slowdown_vs_ranks": checks[rank].slowdown,
            "own_step_time_s": checks[rank].median_s,
        }
        self.track(mine)

    def _report(self, began: list[Straggler], ended: list[Straggler]) -> None:
        # Said by rank 0, whose log a multi-node run's user reads, and by the straggler, on
        # whose node the cause is.
        for entry in began:
            if self.ctx.rank in (0, entry.rank):
                log.warning(
                    "rank %d is a straggler since step %d: its own part of a step takes %.1f ms "
                    "against the other ranks' median of %.1f ms (%.2fx as long), %d windows of "
                    "%d steps in a row",
                    entry.rank,
                    entry.first_step,
                    entry.median_step_ms,
                    entry.ranks_median_step_ms,
                    entry.slowdown,
                    entry.windows,
                    self.window,
                )
        for entry in ended:
            if self.ctx.rank in (0, entry.rank):
                log.info(
                    "rank %d is no longer a straggler after step %d (%.2fx over %d windows)",
                    entry.rank,
                    entry.last_step,
                    entry.slowdown,
                    entry.windows,
                )
