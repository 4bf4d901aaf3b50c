"""What `trainyard sweep show/list/best` and the sweep's Prefect artifact say: the study's
trials, joined with their run records."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from trainyard.sweeps.journal import JournalError
from trainyard.sweeps.record import SweepRecord
from trainyard.sweeps.study import LOCAL_JOURNALS, ReadableStorages, read_study


def load_study(record: SweepRecord, storages: ReadableStorages = LOCAL_JOURNALS) -> optuna.Study:
    """The sweep's study, read-only, if `storages` allows what its record names (by default
    only local journal files: nothing is created and nothing contacted)."""
    return read_study(record.sweep_id, record.study_name, record.storage, storages)


def summary(record: SweepRecord, study: optuna.Study | None = None) -> dict[str, Any]:
    """The `sweep show --json` document (its keys are an interface: only ever add)."""
    study = study or load_study(record)
    trials = study.get_trials(deepcopy=False)
    return {
        "sweep_id": record.sweep_id,
        "study_name": record.study_name,
        "storage": record.storage,
        "direction": record.direction,
        "objective": record.objective,
        "created_at": record.created_at,
        "dataset": {"path": record.dataset_path, "dvc_md5": record.dataset_md5},
        "code": record.code,
        "counts": {state.name: sum(t.state == state for t in trials) for state in TrialState},
        "best": best_trial(study),
        "trials": [trial_row(t) for t in trials],
        "importances": importances(study),
    }


def trial_row(trial: FrozenTrial) -> dict[str, Any]:
    duration = (
        (trial.datetime_complete - trial.datetime_start).total_seconds()
        if trial.datetime_complete and trial.datetime_start
        else None
    )
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": trial.value,
        "params": trial.params,
        "run_id": trial.user_attrs.get("run_id"),
        "last_epoch": max(trial.intermediate_values, default=None),
        "duration_s": round(duration, 1) if duration is not None else None,
        "error": trial.user_attrs.get("error"),
    }


def best_trial(study: optuna.Study) -> dict[str, Any] | None:
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not completed:
        return None
    best = study.best_trial
    return {
        "trial": best.number,
        "value": best.value,
        "run_id": best.user_attrs.get("run_id"),
        "params": best.params,
    }


def importances(study: optuna.Study) -> dict[str, float]:
    """fANOVA importances of the parameters, once at least two trials completed with
    different values; {} before that."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(completed) < 2:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError):  # too few distinct values to tell
        return {}
    return {name: round(value, 4) for name, value in found.items()}


def list_rows(
    records: list[SweepRecord], storages: ReadableStorages, warn: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One row per sweep for `sweep list`; a sweep whose study cannot be opened is left
    out with one warning, the others listed."""
    rows = []
    for record in records:
        try:
            study = load_study(record, storages)
        except JournalError as exc:
            warn(str(exc))
            continue
        rows.append(
            {
                "sweep_id": record.sweep_id,
                "created_at": record.created_at,
                "objective": record.objective,
                "direction": record.direction,
                "trials": len(study.trials),
                "best": best_trial(study),
            }
        )
    return rows
