"""The sweep's Optuna study: where it is stored, its sampler and pruner, and how a torchrun
job's rank 0 finds its own trial in it."""

from __future__ import annotations

import datetime
import errno
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, fail_stale_trials
from optuna.trial import TrialState

from trainyard.config import SearchParam, SweepConfig
from trainyard.errors import ConfigError, StoreError, WorkerFailed, first_line
from trainyard.project import ProjectPaths
from trainyard.runs.record import check_run_id
from trainyard.sweeps.heartbeats import (
    beating,
    quiet,
    replaced,
    retry_callback,
    tries_before,
)
from trainyard.sweeps.journal import JournalError, ReadOnlyJournal, SweepJournal
from trainyard.sweeps.space import grid_space, suggest

JOURNALS = "sweeps"  # under the project's .trainyard/: one folder per sweep
# Where sweeps kept their trials before each had a journal of its own; still read.
SHARED_JOURNAL = "sweeps/optuna-journal.log"
# Failures of where a trial ran, not of its parameters: a full disk, a store that is down.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
_ENVIRONMENT = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|\[Errno (?:5|28|30|122)\]"
    r"|\b(?:StoreError|JournalError)\b|sqlalchemy\.exc\.OperationalError|StatusCode\.UNAVAILABLE"
)
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")

optuna.logging.set_verbosity(optuna.logging.WARNING)  # trials log through trainyard


def served_journal(paths: ProjectPaths) -> Path:
    """The journal `trainyard sweep serve-storage` serves when sweep.storage names none."""
    return paths.state / JOURNALS / "served" / "journal.log"


def journal_path(paths: ProjectPaths, sweep_id: str) -> Path:
    """A sweep's own journal: damage to one (a torn write) never reaches another sweep."""
    return paths.state / JOURNALS / check_run_id(sweep_id) / "journal.log"


def storage_url(sweep: SweepConfig, paths: ProjectPaths, sweep_id: str) -> str:
    """What `optuna ... --storage` and optuna-dashboard accept for this sweep's study."""
    if not sweep.storage:
        return str(journal_path(paths, sweep_id))
    if "://" not in sweep.storage:  # a journal file the user placed, relative to the project
        path = (paths.root / sweep.storage).resolve()
        if path.is_dir() or sweep.storage.endswith(("/", os.sep)):
            raise ConfigError(
                f"sweep.storage {sweep.storage!r} is a folder; name a journal file in it "
                f"(e.g. {sweep.storage.rstrip('/' + os.sep)}/journal.log), or leave it empty "
                "for one journal per sweep under .trainyard/sweeps/"
            )
        return str(path)
    return sweep.storage


def open_storage(
    url: str, create_tables: bool = True, heartbeat_s: int | None = None
) -> BaseStorage:
    """A journal file (safe for concurrent trials, unlike SQLite), an RDB URL, or Optuna's
    gRPC proxy (`grpc://host:port`), which lets trials on several machines share a study.
    `create_tables=False`: a reader, which never creates a file, a database or its tables,
    and never writes. `heartbeat_s`: on a database server, Optuna's heartbeats (see
    `SweepStudy.heartbeat`), a trial stale after twice as long retried as a new one."""
    try:
        if url.startswith("grpc://"):
            from optuna.storages import GrpcStorageProxy

            host, _, port = url.removeprefix("grpc://").rpartition(":")
            return GrpcStorageProxy(host=host, port=int(port))
        if "://" in url:
            if not create_tables:
                _check_database_exists(url)
            return _rdb_storage(url, create_tables, heartbeat_s)
        return JournalStorage(SweepJournal(url) if create_tables else ReadOnlyJournal(url))
    except (ValueError, ImportError, ModuleNotFoundError) as exc:
        raise ConfigError(
            f"sweep.storage {shown_url(url)!r} cannot be opened ({str(exc).splitlines()[0]}); "
            "use a journal file path, postgresql://user@host/db, mysql://user@host/db or "
            "grpc://host:port"
        ) from None


def _rdb_storage(url: str, create_tables: bool, heartbeat_s: int | None) -> RDBStorage:
    # SQLite is one machine's file: a crashed sweep's trials are resumed by their run
    # leases (flows.sweep.trials_to_resume), with no other process to take them over.
    if url.startswith("sqlite"):
        heartbeat_s = None
    try:
        with quiet():
            return RDBStorage(
                url,
                heartbeat_interval=heartbeat_s,  # a trial stale after 2 x this: Optuna's grace
                heartbeat_stale_trial_callback=None if heartbeat_s is None else retry_callback(),
                skip_table_creation=not create_tables,
            )
    except sqlalchemy.exc.OperationalError as exc:
        raise _unreachable(url, exc) from None


def check_reachable(url: str) -> None:
    """A database server's URL (PostgreSQL, MySQL) connected to once, before any trial; a
    server that cannot be reached or refuses is one line (JournalError)."""
    if "://" not in url or url.startswith(("grpc://", "sqlite:")):
        return
    try:
        engine = sqlalchemy.create_engine(url)
    except (ValueError, ImportError, sqlalchemy.exc.ArgumentError) as exc:
        raise ConfigError(
            f"sweep.storage {shown_url(url)!r} cannot be opened ({first_line(exc)})"
        ) from None
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.OperationalError as exc:
        raise _unreachable(url, exc) from None
    finally:
        engine.dispose()


def _unreachable(url: str, exc: sqlalchemy.exc.OperationalError) -> JournalError:
    """No such host or database, a wrong PGPASSWORD: one line, the URL without its user."""
    reason = re.sub(r"^\([\w.]+\)\s*", "", str(exc.orig or exc).strip().splitlines()[0])
    return JournalError(
        f"sweep.storage {shown_url(url)!r} cannot be reached ({reason}); check its host, "
        "port and database, and that PGPASSWORD (or the driver's config file) is right"
    )


def _check_database_exists(url: str) -> None:
    """SQLite creates a missing database file on connecting; a reader must not."""
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///").partition("?")[0]
        if path and not Path(path).is_file():
            raise JournalError(f"database {path} is gone")


def shown_url(url: str) -> str:
    """A storage URL without its user and password, for messages."""
    return _USERINFO.sub("***@", url)


@dataclass(frozen=True)
class ReadableStorages:
    """The study storages a reader (`sweep list/show/best`, the report, the ui) opens. A
    sweep record is a document anyone who can write to the store could plant; the storage it
    names is opened only if it is one of these, and then read-only."""

    journal_dirs: tuple[Path, ...] = ()  # local journal files under these folders
    urls: tuple[str, ...] = ()  # exactly these URLs (or journal files)

    @classmethod
    def of_project(cls, sweep: SweepConfig, paths: ProjectPaths) -> ReadableStorages:
        """The project's own journal folder and what params.yaml's sweep.storage names."""
        configured = storage_url(sweep, paths, "any") if sweep.storage else None
        return cls((paths.state.resolve() / JOURNALS,), (configured,) if configured else ())

    def allows(self, url: str) -> bool:
        if url in self.urls:
            return True
        if "://" in url or not url:
            return False
        path = Path(url).resolve()  # a link out of the folder is out of it
        return str(path) in self.urls or any(path.is_relative_to(d) for d in self.journal_dirs)


# Local journal files only, wherever they are, and no URL: never connects anywhere.
LOCAL_JOURNALS = ReadableStorages(journal_dirs=(Path("/"),))


def read_study(
    sweep_id: str, study_name: str, url: str, storages: ReadableStorages
) -> optuna.Study:
    """A sweep's study, opened read-only; JournalError (one line) if its storage is not one
    `storages` allows, is gone, or cannot be read. A torn last record is skipped."""
    if not storages.allows(url):
        raise JournalError(
            f"sweep {sweep_id}: its record names storage {shown_url(url)!r}, which this "
            "project does not configure (params.yaml sweep.storage, or .trainyard/sweeps/); "
            "not opened. If it is yours, set sweep.storage to it (or pass -S sweep.storage=...)"
        )
    try:
        return optuna.load_study(study_name=study_name, storage=open_storage(url, False))
    except KeyError:
        raise JournalError(
            f"sweep {sweep_id}: {shown_url(url)} holds no study {study_name}"
        ) from None
    except JournalError as exc:
        raise JournalError(f"sweep {sweep_id}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a broken record, a database that is down
        raise JournalError(
            f"sweep {sweep_id}: {shown_url(url)} cannot be read ({first_line(exc)})"
        ) from None


def environment_failure(exc: BaseException) -> bool:
    """Whether a trial failed because of where it ran (a full disk, the store or the study
    storage down) rather than because of its parameters (a diverging model, a bad value):
    the first stops the sweep, the second is one failed trial."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (StoreError, JournalError)):
            return True
        if isinstance(seen, OSError) and seen.errno in _ENVIRONMENT_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return environment_text(failure_line(exc))


def environment_text(error: str | None) -> bool:
    """`environment_failure` for a failure already written down (a run record's error)."""
    return bool(error and _ENVIRONMENT.search(error))


def make_sampler(sweep: SweepConfig) -> optuna.samplers.BaseSampler:
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=sweep.seed)
    if sweep.sampler == "grid":
        return _GridSampler(grid_space(sweep.space), seed=sweep.seed)
    if sweep.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=sweep.seed, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=sweep.seed)


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler, minus its `study.stop()` once the grid is covered: that works
    only inside `study.optimize`, and raised in `tell` (before the trial's state was saved).
    The sweep stops asking instead (`SweepStudy.ask` caps the budget at the grid's size)."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def grid_size(sweep: SweepConfig) -> int | None:
    """How many distinct trials the grid sampler has; None for the other samplers."""
    if sweep.sampler != "grid":
        return None
    return math.prod(len(values) for values in grid_space(sweep.space).values())


def make_pruner(sweep: SweepConfig, epochs: int) -> optuna.pruners.BasePruner:
    """Each trial reports its monitored validation metric once per epoch (step = epoch)."""
    if sweep.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=sweep.min_epochs)
    if sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=sweep.min_epochs)
    if sweep.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=sweep.min_epochs, max_resource=max(epochs, sweep.min_epochs)
        )
    return optuna.pruners.NopPruner()


def load_trial(
    url: str, study_name: str, number: int, sweep: SweepConfig, epochs: int
) -> tuple[optuna.Trial, set[int]]:
    """Trial `number` of the study, to report to and ask whether to prune (rank 0 of its
    job), and the epochs it reported already."""
    storage = open_storage(url)
    study = optuna.load_study(
        study_name=study_name, storage=storage, pruner=make_pruner(sweep, epochs)
    )
    study_id = storage.get_study_id_from_name(study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    reported = set(storage.get_trial(trial_id).intermediate_values)
    return optuna.Trial(study, trial_id), reported


# The first key of the PostgreSQL advisory locks sweeps take (the second: the study's id).
_LOCK_SPACE = 0x7377  # "sw"


@contextmanager
def study_lock(storage: BaseStorage, study_id: int) -> Iterator[None]:
    """Held by one process at a time per study, on a PostgreSQL storage: a session-level
    advisory lock on a connection of its own, so the trials counted and the one created
    under it are seen by the next holder (each is committed before the lock goes). A holder
    that dies loses its connection, and the lock with it. Other storages: no lock."""
    engine = getattr(storage, "engine", None)  # an RDBStorage, not its cache or a proxy
    if engine is None or engine.dialect.name != "postgresql":
        yield
        return
    keys = {"space": _LOCK_SPACE, "study": study_id}
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:space, :study)"), keys)
        connection.commit()
        try:
            yield
        finally:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:space, :study)"), keys)
            connection.commit()


FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass(frozen=True)
class PendingTrial:
    """A trial to run: its number, its parameters and the run id that trains it; for the
    retry of a trial whose host died, the run that trial trained (its checkpoints)."""

    number: int
    params: dict[str, Any]
    run_id: str | None
    retry_of: int | None = None  # the trial whose host died
    resume_from: str | None = None  # the run that trial trained


class SweepStudy:
    """The study as the sweep's process uses it: one object (one sampler) shared by the
    threads that run trials, as Optuna's own `optimize(n_jobs=...)` does."""

    def __init__(self, url: str, study_name: str, sweep: SweepConfig, epochs: int):
        self.url, self.storage = url, open_storage(url, heartbeat_s=sweep.heartbeat_s)
        # With heartbeats (a database server), a trial whose host died is retried by another
        # sweep process; without, only a restarted sweep resumes it (trials_to_resume).
        self._beating: RDBStorage | None = None
        if isinstance(self.storage, RDBStorage) and self.storage.get_heartbeat_interval():
            self._beating = self.storage
        self.study = optuna.load_study(
            study_name=study_name,
            storage=self.storage,
            sampler=make_sampler(sweep),
            pruner=make_pruner(sweep, epochs),
        )
        self._study_id = self.storage.get_study_id_from_name(study_name)
        self._asking = threading.Lock()
        self._grid_size = grid_size(sweep)

    def ask(
        self, space: dict[str, SearchParam], run_id: str, budget: int | None
    ) -> PendingTrial | None:
        """A new trial, or None once the study holds `budget` trials. Exact within this
        process, and across processes on a PostgreSQL storage (the count and the new trial
        under one lock in the database); on other shared storages each further process may
        start one trial more, as with Optuna's own MaxTrialsCallback. A retry of a trial
        whose host died comes first, in that trial's place in the budget."""
        if self._grid_size is not None:  # each grid point once
            budget = min(budget or self._grid_size, self._grid_size)
        # A sampler is not thread-safe while it draws; the study's lock spans processes.
        with self._asking, study_lock(self.storage, self._study_id):
            self.fail_stale()
            trials = self.study.get_trials(deepcopy=False)
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if not waiting and budget is not None and len(trials) - len(replaced(trials)) >= budget:
                return None
            with quiet():  # Optuna's: a waiting retry first, with its parameters
                trial = self.study.ask()
            params = suggest(trial, space)
            trial_id = self._trial_id(trial.number)
            if self._beating is not None:  # watched from its start: none is left unseen
                self._beating.record_heartbeat(trial_id)
        frozen = self.storage.get_trial(trial_id)
        trial.set_user_attr("run_id", run_id)
        tries = tries_before(frozen)
        # A retry's attributes are a copy of its last try's: that run's are the latest
        # checkpoints of the trial.
        last = frozen.user_attrs.get("run_id") if tries else None
        return PendingTrial(trial.number, params, run_id, tries[-1] if tries else None, last)

    def count(self, *states: TrialState) -> int:
        """Trials in these states, less those a retry replaced."""
        trials = self.study.get_trials(deepcopy=False)
        gone = replaced(trials)
        return sum(t.state in states and t.number not in gone for t in trials)

    def fail_stale(self) -> None:
        """Optuna's own: fails the trials whose heartbeat stopped (their host died, or lost
        the network), each retried as a new waiting trial by the storage's callback."""
        if self._beating is not None:
            with quiet():
                fail_stale_trials(self.study)

    def await_others(self) -> int | None:
        """For a process that runs none of the study's trials: how many retries wait to be
        run (their hosts died), after one heartbeat's wait if trials run elsewhere and none
        waits; None once no trial is unfinished, or without heartbeats (a trial elsewhere
        cannot be told dead from alive; a restarted sweep resumes it)."""
        if self._beating is None:
            return None
        self.fail_stale()
        if not self.count(TrialState.WAITING) and self.count(TrialState.RUNNING):
            time.sleep(self._beating.get_heartbeat_interval() or 1)
            self.fail_stale()
        waiting, running = self.count(TrialState.WAITING), self.count(TrialState.RUNNING)
        return waiting if waiting or running else None

    @contextmanager
    def heartbeat(self, number: int) -> Iterator[None]:
        """While trial `number` runs here: its heartbeat, on a storage with heartbeats."""
        if self._beating is None:
            yield
            return
        with beating(self._beating, self._trial_id(number)):
            yield

    def unfinished(self) -> list[tuple[PendingTrial, float]]:
        """Trials RUNNING in the study, with the seconds since they started: left so by a
        sweep that died (resumed with the same parameters), or run by a live one."""
        now = datetime.datetime.now()  # Optuna stores naive local times
        return [
            (
                PendingTrial(t.number, t.params, t.user_attrs.get("run_id")),
                (now - t.datetime_start).total_seconds() if t.datetime_start else 0.0,
            )
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        ]

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self._study_id, number)

    def handle(self, number: int) -> optuna.Trial:
        return optuna.Trial(self.study, self._trial_id(number))

    def complete(self, number: int, value: float) -> None:
        self.study.tell(number, value, skip_if_finished=True)

    def pruned(self, number: int) -> None:
        self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)

    def failed(self, number: int, error: str) -> None:
        try:
            self.handle(number).set_user_attr("error", error)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # another sweep process told it first
        self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def create_study(
    url: str, study_name: str, direction: Literal["maximize", "minimize"], attrs: dict[str, Any]
) -> None:
    study = optuna.create_study(
        study_name=study_name, storage=open_storage(url), direction=direction
    )
    for key, value in attrs.items():
        study.set_user_attr(key, value)


def failure_line(exc: BaseException) -> str:
    """The failing rank and its error, as a run's record has it (`rank 1: Type: message`);
    else the last exception line of the message."""
    if isinstance(exc, WorkerFailed) and exc.summary is not None:
        return exc.line()[:500]
    text = str(exc)
    rank = re.search(r"rank\s*:\s*(\d+)", text)
    raised = re.findall(r"^\s*((?:[\w.]+)(?:Error|Exception|Interrupt|Exit)\b.*)$", text, re.M)
    last = raised[-1].strip() if raised else (text.strip().splitlines() or [""])[0]
    where = f"rank {rank.group(1)}: " if rank else ""
    return f"{where}{last or type(exc).__name__}"[:500]
