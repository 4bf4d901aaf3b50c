"""A live progress bar for commands run in a terminal (rich, which Prefect already uses).

Only when stdout is a terminal: piped to a file, a command's output stays plain log lines
with the rank. While the bar is up, log lines print above it: rich redirects stdout and
stderr, and the logging handlers that wrote to the terminal write through the bar's console
for as long."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainyard.runs.live_files import LiveStatus, read_live

POLL_S = 0.25
_NO_PROGRESS_ENV = "TRAINYARD_NO_PROGRESS"


def wants_progress() -> bool:
    return sys.stdout.isatty() and not os.environ.get(_NO_PROGRESS_ENV)


@contextlib.contextmanager
def run_progress(status_file: Path, title: str) -> Iterator[None]:
    """A bar that follows a training job's status file (trainyard.runs.live_files) until the block ends."""
    with contextlib.suppress(FileNotFoundError):
        status_file.unlink()  # an earlier attempt's: the bar starts from this one's
    with progress_bar(title, lambda: _run_fields(read_live(status_file))):
        yield


@contextlib.contextmanager
def sweep_progress(storage_url: str, study_name: str, n_trials: int | None) -> Iterator[None]:
    """Trials finished of the budget, and how many run, were pruned or failed, read from
    the study's storage (the same the trials write to) once a second."""
    storage: list[Any] = []  # opened by the first poll: only when a bar is drawn
    study: list[Any] = []

    def poll() -> dict | None:
        if not storage:
            storage.append(_reading_storage(storage_url))
        if not study:
            study.extend(_load_study(storage[0], study_name))  # none until the flow makes it
        return _sweep_fields(study_name, study[0], n_trials) if study else None

    with progress_bar(study_name, poll, every_s=1.0):
        yield


def _reading_storage(storage_url: str):
    """One storage for the bar's reads. A database's tables are the flow's to create: the
    bar's storage never creates or migrates them."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.sweeps.study import open_storage

    return open_storage(storage_url, create_tables=False)


def _load_study(storage, study_name: str) -> list:
    import optuna

    try:
        return [optuna.load_study(study_name=study_name, storage=storage)]
    except KeyError:
        return []


def _sweep_fields(study_name: str, study, n_trials: int | None) -> dict:
    counts = Counter(trial.state.name for trial in study.get_trials(deepcopy=False))
    finished = counts["COMPLETE"] + counts["PRUNED"] + counts["FAIL"]
    detail = f"{counts['RUNNING']} running  {counts['PRUNED']} pruned  {counts['FAIL']} failed"
    if counts["COMPLETE"]:
        detail += f"  best {study.best_value:.4f}"
    return {
        "completed": finished,
        "total": n_trials,
        "description": f"sweep {study_name.removeprefix('trainyard-')} trials",
        "detail": detail,
    }


@contextlib.contextmanager
def prediction_progress(poll_committed: Callable[[], int], shards: int, title: str):
    """Shards committed of the job's, polled from the store once a second."""

    def poll() -> dict:
        return {"completed": poll_committed(), "total": shards, "detail": "shards committed"}

    with progress_bar(title, poll, every_s=1.0):
        yield


@contextlib.contextmanager
def progress_bar(
    title: str, poll: Callable[[], dict | None], every_s: float = POLL_S
) -> Iterator[None]:
    """Calls `poll` every `every_s` on a thread: None (nothing yet) or the fields to show,
    `completed`, `total`, `description` and `detail`. No terminal, no bar."""
    if not wants_progress():
        yield
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        refresh_per_second=4,
        # The log lines printed above the bar are text, not rich markup: with markup,
        # "[rank 0/2]" read as a style tag and vanished. The columns parse their own.
        console=Console(markup=False),
    )
    stop = threading.Event()
    with progress, _logging_through(progress.console):
        task = progress.add_task(title, total=None, detail="starting")

        def follow() -> None:
            while not stop.wait(every_s):
                fields = _safely(poll)
                if fields:
                    progress.update(task, **fields)

        follower = threading.Thread(target=follow, name="progress-bar", daemon=True)
        follower.start()
        try:
            yield
        finally:
            stop.set()
            follower.join(timeout=2)
        # Finished (not interrupted): the bar shows where it ended.
        fields = None if follower.is_alive() else _safely(poll)
        if fields:
            progress.update(task, **fields)


def _safely(poll: Callable[[], dict | None]) -> dict | None:
    try:
        return poll()
    except Exception:  # a bar must never break the command it shows
        return None


def _run_fields(status: LiveStatus | None) -> dict | None:
    if status is None:
        return None
    detail = f"{status.samples_per_s:,.0f} samples/s"
    if status.loss is not None:
        detail += f"  loss {status.loss:.4f}"
    if status.monitor_value is not None:
        detail += f"  {status.monitor} {status.monitor_value:.4f}"
    return {
        "completed": status.step,
        "total": status.total_steps,
        "description": f"{status.run_id} epoch {status.epoch}/{status.epochs}",
        "detail": detail,
    }


@contextlib.contextmanager
def _logging_through(console) -> Iterator[None]:
    """Point the logging handlers that write to the terminal at the bar's console, so each
    line prints above the bar: a stream handler at rich's redirected stream, a handler
    with a rich Console of its own (Prefect's) at the bar's console (a Console writes past
    rich's redirection, to the real file, by design)."""
    real = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
    moved: list[tuple[Any, str, Any]] = []  # (a stream handler or rich's, field, old value)
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            stream = getattr(handler, "stream", None)
            if not isinstance(handler, logging.StreamHandler) or id(stream) not in real:
                continue
            if hasattr(handler, "console"):
                moved.append((handler, "console", handler.console))
                handler.console = console
            else:
                moved.append((handler, "stream", stream))
                handler.setStream(real[id(stream)])
    try:
        yield
    finally:
        for handler, field, value in moved:
            if field == "console":
                handler.console = value
            else:
                handler.setStream(value)
