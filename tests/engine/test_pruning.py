"""The pruning hook against a real Optuna study, in one process (no process group: rank 0's
answer is the answer). Under torchrun the same hook is covered by tests/sweeps/test_sweep.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import optuna
import torch

from trainyard.config import SweepConfig
from trainyard.dist import DistContext
from trainyard.engine.pruning import PruningHook
from trainyard.sweeps.study import make_pruner

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def trial_behind_two_good_ones(pruner: str) -> optuna.Trial:
    """A new trial of a study where two trials reported through the hook and completed."""
    study = optuna.create_study(
        direction="maximize", pruner=make_pruner(SweepConfig(pruner=pruner, min_epochs=1), 3)
    )
    for _ in range(2):
        good = study.ask()
        epochs(PruningHook(CTX, good, "val_accuracy", set(), epochs=3), [0.9, 0.95, 0.97])
        study.tell(good, 0.97)
    return study.ask()


def epochs(hook: PruningHook, values: list[float]) -> SimpleNamespace:
    state: Any = SimpleNamespace(epoch=0, stop=False)  # the fields the hook reads
    for value in values:
        state.epoch += 1
        hook.on_epoch_end(state, {"val_accuracy": value})
        if state.stop:
            break
    return state


def test_a_trial_behind_the_others_is_pruned_at_its_first_epoch():
    for pruner in ("median", "asha"):
        trial = trial_behind_two_good_ones(pruner)
        hook = PruningHook(CTX, trial, "val_accuracy", set(), epochs=3)
        state = epochs(hook, [0.5, 0.6, 0.7])
        assert state.stop and hook.pruned_at_epoch == 1 == state.epoch, pruner
        assert trial.study.trials[-1].intermediate_values == {1: 0.5}


def test_a_trial_that_trained_its_last_epoch_completes_whatever_the_pruner_says():
    trial = trial_behind_two_good_ones("median")
    hook = PruningHook(CTX, trial, "val_accuracy", set(), epochs=1)
    state = epochs(hook, [0.5])
    assert not state.stop and hook.pruned_at_epoch is None
    assert trial.study.trials[-1].intermediate_values == {1: 0.5}  # reported all the same


def test_no_pruner_never_prunes_and_a_resumed_trial_reports_each_epoch_once():
    trial = trial_behind_two_good_ones("none")
    trial.report(0.4, 1)  # reported before the trial was interrupted and resumed
    hook = PruningHook(CTX, trial, "val_accuracy", {1}, epochs=3)
    state = epochs(hook, [0.41, 0.5, 0.6])
    assert not state.stop and state.epoch == 3
    assert trial.study.trials[-1].intermediate_values == {1: 0.4, 2: 0.5, 3: 0.6}
