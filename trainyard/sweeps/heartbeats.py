"""Optuna's heartbeats, for a study on a database server shared by sweep processes on
several machines: each running trial's heartbeat, and the retry of a trial whose heartbeat
stopped (its host died) as a new trial in its place, from its last checkpoint."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy.exc
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial

# A trial whose host died is retried at most this often: one that kills its host each time
# (say, by running it out of memory) ends failed instead of being retried for ever.
MAX_RETRIES = 3


@contextmanager
def quiet() -> Iterator[None]:
    """Optuna marks heartbeats and stale-trial retries experimental (since 2.8 and 2.9),
    and warns that its heartbeats are meant for `Study.optimize`: the sweep asks and tells
    itself and runs each trial's heartbeat (`beating`) knowingly, and its log need not say
    so at every trial."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with")
        yield


def retry_callback() -> RetryHeartbeatStaleTrialCallback:
    """What a storage with heartbeats does with a trial it fails as stale: a waiting copy
    (parameters, attributes and reported values: the pruner sees the whole curve)."""
    with quiet():
        return RetryHeartbeatStaleTrialCallback(MAX_RETRIES, inherit_intermediate_values=True)


def tries_before(trial: FrozenTrial) -> list[int]:
    """The numbers of the trials a retry retries, the first try first; [] for a new one."""
    with quiet():
        return RetryHeartbeatStaleTrialCallback.retry_history(trial)


def replaced(trials: list[FrozenTrial]) -> set[int]:
    """The trials failed for a lost heartbeat and retried as another: the retry takes their
    place in the budget (and in the failures counted)."""
    return {number for trial in trials for number in tries_before(trial)}


@contextmanager
def beating(storage: RDBStorage, trial_id: int) -> Iterator[None]:
    """The trial's heartbeat in the database now and every heartbeat interval until the
    block ends, from a thread of its own, so that the other sweep processes can tell it
    from a trial whose host died."""
    interval, stop = storage.get_heartbeat_interval() or 1, threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                storage.record_heartbeat(trial_id)
            except sqlalchemy.exc.SQLAlchemyError:
                continue  # the database away for a moment: one beat missed, not the trial

    storage.record_heartbeat(trial_id)
    thread = threading.Thread(target=beat, name=f"trial-{trial_id}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
