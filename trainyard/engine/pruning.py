"""Pruning inside a trial's training job, decided once for every rank.

Rank 0 reports the monitored validation metric to the trial at each epoch's end and asks
the pruner; every rank then takes part in one all-reduce that carries the answer, so no
rank is left waiting alone in a collective (optuna#3484). A pruned trial stops cleanly at
that epoch: the epoch's checkpoint (taken by the hook before this one) stays.
"""

from __future__ import annotations

import logging

import optuna

from trainyard.dist import DistContext, rank0_decides
from trainyard.engine.hooks import Hook
from trainyard.engine.train_state import TrainState

log = logging.getLogger(__name__)


class PruningHook(Hook):
    def __init__(
        self,
        ctx: DistContext,
        trial: optuna.Trial | None,
        metric: str,
        reported: set[int],
        epochs: int,
    ):
        """`trial`: rank 0's handle on the study (None on the other ranks); `metric`: the
        history row's key reported, e.g. val_accuracy; `reported`: the epochs the trial
        reported before (a resumed trial trains its last epochs again); `epochs`: the last
        one, after which the trial completes instead of asking."""
        self.rank, self.device, self.epochs = ctx.rank, ctx.device, epochs
        self.trial, self.metric, self.reported = trial, metric, set(reported)
        self.pruned_at_epoch: int | None = None

    def on_epoch_end(self, state: TrainState, row: dict[str, float]) -> None:
        if self.trial is not None:
            self._report(state.epoch, row[self.metric])
        if state.epoch >= self.epochs:  # trained to the end: complete, whatever the pruner says
            return
        prune = self.trial.should_prune() if self.trial is not None else False
        if rank0_decides(prune, self.rank, self.device):
            state.stop, self.pruned_at_epoch = True, state.epoch
            log.info(
                "trial pruned after epoch %d (%s %.4f)", state.epoch, self.metric, row[self.metric]
            )

    def _report(self, epoch: int, value: float) -> None:
        assert self.trial is not None
        if epoch not in self.reported:
            self.trial.report(value, epoch)
            self.reported.add(epoch)
