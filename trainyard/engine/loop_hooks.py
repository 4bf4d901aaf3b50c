"""The hooks the training loop calls, built before it starts and handed to `train()` in one
typed bundle: the straggler check, tracking and checkpoints, which the loop also reads from
after its last epoch, and the ones between them (progress, a sweep's pruner, live status)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainyard.config import TrainyardConfig
from trainyard.dist import DistContext
from trainyard.engine.hooks import CheckpointHook, Hook, TrackingHook
from trainyard.engine.stragglers import StragglerHook
from trainyard.engine.system_metrics import SystemSampler
from trainyard.engine.tracking import Tracker


@dataclass(frozen=True)
class LoopHooks:
    """Every rank calls them in the order of `in_order`; `between` may hold rank-local
    hooks, which take part in no collective."""

    stragglers: StragglerHook
    tracking: TrackingHook
    checkpoints: CheckpointHook
    between: tuple[Hook, ...] = ()

    @classmethod
    def build(
        cls,
        ctx: DistContext,
        config: TrainyardConfig,
        tracker: Tracker,
        checkpoints: CheckpointHook,
        between: Sequence[Hook] = (),
    ) -> LoopHooks:
        """The straggler hook hands its verdicts to the tracking hook's next point, and is
        called before it, so that a window both close at is one point."""
        tracking = TrackingHook(tracker, SystemSampler(ctx.device), config.tracking.min_interval_s)
        stragglers = StragglerHook(config, ctx, tracking.add_worst)
        return cls(stragglers, tracking, checkpoints, tuple(between))

    def in_order(self) -> list[Hook]:
        # `between` comes before the checkpoint hook: a hook that ends training (a pruner)
        # makes that epoch the run's last, whose checkpoint is always taken (and scored in
        # the job).
        return [self.stragglers, self.tracking, *self.between, self.checkpoints]
