"""Persistent workers: a torchrun job whose workers stay up and run one job after another.

A cold job pays Python, torch and the process group three times over (the launcher's
torchrun agent, then each worker) before its first step: about 4 s of every sweep trial
here. Inside a `persistent_workers()` block, `trainyard.runtime.launch.run_worker` runs single-node
`train` and `evaluate` jobs on persistent workers instead: a torchrun job of the same shape
(workers, threads, device, restarts, store) that is idle, or one started for it. A flow can
start one early (`prestart`) so its start overlaps the flow's own data steps.

The launcher and the workers talk through an inbox folder: the launcher writes
`request-<n>.json` (the worker's arguments and the job's own environment, such as the run's
lease token), every rank runs it, rank 0 writes `done-<n>.json`, and `stop` ends the
workers. Each job is exactly what a cold launch would run, in the same processes; a worker
that dies takes the job down as before: torchrun restarts the group, whose new workers take
the unfinished request again and resume it from its last committed checkpoint. A job that
saw a restart retires its workers, so every job starts on a group with no restarts behind
it (the worker counts its run's restarts from torchrun's count).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from trainyard.errors import WorkerFailed
from trainyard.runtime.job_output import Tail, job_failed
from trainyard.runtime.processes import forget_job, kill_tree, reap_orphans, start_job, stopping
from trainyard.runtime.torchrun import FreedMemory, freed_memory, torchrun_command, worker_env
from trainyard.util.attempts import torchrun_restarts
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:
    from trainyard.config import TrainConfig

log = logging.getLogger(__name__)
POLL_S = 0.02  # a job waits at most this long to be seen: nothing next to a job's start
STOP_GRACE_S = 2.0  # then killed: an idle worker has nothing to lose


class JobRequest(BaseModel):
    number: int
    args: list[str]  # trainyard.engine.worker's, as a cold launch passes them
    env: dict[str, str]  # this job's own environment on top of the workers'

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        before = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class JobDone(BaseModel):
    number: int
    restarts: int  # torchrun's restart count of the group that finished it


class Inbox:
    """The folder a persistent job's requests come in: the workers' side."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def request_path(self, number: int) -> Path:
        return self.folder / f"request-{number:06d}.json"

    def done_path(self, number: int) -> Path:
        return self.folder / f"done-{number:06d}.json"

    @property
    def stop_path(self) -> Path:
        return self.folder / "stop"

    def requests(self) -> Iterator[JobRequest]:
        """Each request in turn, from the first one not done (after a restart: the one that
        was running), until `stop`."""
        number = next(n for n in itertools.count(1) if not self.done_path(n).exists())
        while True:
            path = self.request_path(number)
            while not path.exists():
                if self.stop_path.exists():
                    return
                time.sleep(POLL_S)
            yield JobRequest.model_validate_json(path.read_text())
            number += 1

    def finished(self, request: JobRequest, is_main: bool) -> None:
        if is_main:
            done = JobDone(number=request.number, restarts=torchrun_restarts())
            write_text_atomic(self.done_path(request.number), done.model_dump_json())


# The train settings a persistent job's workers are started with (besides the project and store).
SHAPE_KEYS = (
    "workers",
    "threads_per_worker",
    "device",
    "gpus",
    "hang_timeout_s",
    "max_restarts",
)


@dataclass(frozen=True)
class WorkerShape:
    """What a persistent job's workers were started with; a job runs only on workers of its own."""

    root: Path
    workers: int
    threads_per_worker: int
    device: str
    gpus: tuple[int, ...] | None  # CUDA_VISIBLE_DEVICES: a sweep's trial slot's own GPUs
    hang_timeout_s: float
    max_restarts: int
    freed_memory: FreedMemory  # by the layout (trainyard.runtime.torchrun.freed_memory)
    store_env: tuple[tuple[str, str], ...] = field(repr=False)  # credentials: never logged

    @classmethod
    def of(
        cls, root: Path, train: TrainConfig, store_env: dict[str, str], max_restarts: int
    ) -> WorkerShape:
        return cls(
            root=Path(root).resolve(),
            workers=train.workers,
            threads_per_worker=train.threads_per_worker,
            device=train.device,
            gpus=tuple(train.gpus) if train.gpus is not None else None,
            hang_timeout_s=train.hang_timeout_s,
            max_restarts=max_restarts,
            freed_memory=freed_memory(train),
            store_env=tuple(sorted(store_env.items())),
        )


def serves(train: TrainConfig) -> bool:
    """Persistent workers are one machine's: a multi-node job launches its torchrun as ever."""
    return train.max_nodes == 1 and not train.rdzv_endpoint


class PersistentJob:
    """One torchrun job of `trainyard.engine.worker serve`: the launcher's side."""

    def __init__(self, shape: WorkerShape, train: TrainConfig, folder: Path):
        self.shape, self.inbox = shape, Inbox(folder)
        folder.mkdir(parents=True)
        self.retired = False
        self._next = 1
        self._sink: Callable[[str], None] | None = None
        self._idle_lines: deque[str] = deque(maxlen=200)  # start-up lines, for the first job
        self._tail = Tail()
        self._lock = threading.Lock()
        serve = ["serve", "--inbox", str(folder), "--device", shape.device]
        serve += ["--hang-timeout-s", str(shape.hang_timeout_s), "--project-dir", str(shape.root)]
        cmd = torchrun_command(train, serve, shape.max_restarts, rdzv_id=folder.name)
        env = worker_env(
            dict(shape.store_env), shape.threads_per_worker, shape.gpus, shape.freed_memory
        )
        self.proc = start_job(cmd, env, shape.root)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return not self.retired and self.proc.poll() is None

    def run(
        self, args: list[str], env: dict[str, str], on_line: Callable[[str], None], timeout_s: float
    ) -> None:
        """Run one job on these workers and wait for it, as `processes.run_job` waits for a
        cold one: its lines to `on_line`, WorkerFailed with the failing rank's traceback."""
        number, self._next = self._next, self._next + 1
        with self._lock:
            self._tail.clear()
            for line in self._idle_lines:
                on_line(line)
            self._idle_lines.clear()
            self._sink = on_line
        request = JobRequest(number=number, args=args, env=env)
        try:
            write_text_atomic(self.inbox.request_path(number), request.model_dump_json(), True)
            self._wait(number, time.monotonic() + timeout_s, timeout_s)
        except BaseException:
            self.close(grace_s=0)  # failed, timed out, cancelled: no worker outlives its job
            raise
        finally:
            with self._lock:
                self._sink = None
        done = JobDone.model_validate_json(self.inbox.done_path(number).read_text())
        self.retired = done.restarts > 0

    def _wait(self, number: int, deadline: float, timeout_s: float) -> None:
        done = self.inbox.done_path(number)
        while not done.exists():
            if stopping():
                raise KeyboardInterrupt
            if self.proc.poll() is not None:
                reap_orphans(self.proc)  # before they can commit
                self._reader.join(timeout=10)  # its last lines: the failure summary
                raise job_failed(self.proc, self._tail)
            if time.monotonic() > deadline:
                raise WorkerFailed(
                    f"torchrun job exceeded train.timeout_s={timeout_s:g}s and was killed"
                )
            time.sleep(POLL_S)

    def ask_to_stop(self) -> None:
        """The workers leave once idle (`stop`); `close` waits for them."""
        self.retired = True
        with contextlib.suppress(OSError):
            self.inbox.stop_path.touch()

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Let the workers finish and leave (`stop`), killing what is left after `grace_s`."""
        self.ask_to_stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        kill_tree(self.proc)
        forget_job(self.proc)
        self._reader.join(timeout=10)
        shutil.rmtree(self.inbox.folder, ignore_errors=True)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self._tail.append(line)
                if self._sink is None:
                    self._idle_lines.append(line)
                    sink = None
                else:
                    sink = self._sink
            if sink is not None:
                sink(line)


class WorkerPool:
    """The persistent jobs of one process, shared by its threads (a sweep's trial slots)."""

    def __init__(self) -> None:
        self._capacity = 0  # idle jobs kept: the open blocks' max_idle, added up
        self._idle: list[PersistentJob] = []
        self._lock = threading.Lock()
        self._names = itertools.count()

    @property
    def active(self) -> bool:
        return self._capacity > 0

    def prestart(
        self,
        root: Path,
        train: TrainConfig,
        store_env: dict[str, str],
        max_restarts: int,
        count: int = 1,
    ) -> int:
        """Start workers now for jobs of this shape to take later, so that `count` groups of
        it stand idle (ones started earlier, by the command that runs the flow, count);
        returns how many groups it started."""
        shape = WorkerShape.of(root, train, store_env, max_restarts)
        with self._lock:
            idle = sum(job.shape == shape and job.alive() for job in self._idle)
        for _ in range(count - idle):
            self._give_back(self._start(shape, train))
        return max(0, count - idle)

    def run(
        self,
        root: Path,
        train: TrainConfig,
        store_env: dict[str, str],
        max_restarts: int,
        args: list[str],
        job_env: dict[str, str],
        on_line: Callable[[str], None],
    ) -> None:
        shape = WorkerShape.of(root, train, store_env, max_restarts)
        job = self._take(shape) or self._start(shape, train)
        try:
            job.run(args, job_env, on_line, train.timeout_s)
        finally:
            self._give_back(job)

    def _take(self, shape: WorkerShape) -> PersistentJob | None:
        with self._lock:
            for job in self._idle:
                if job.shape == shape and job.alive():
                    self._idle.remove(job)
                    return job
        return None

    def _start(self, shape: WorkerShape, train: TrainConfig) -> PersistentJob:
        # Imported here for start-up cost: the workers import this module for Inbox, and
        # ProjectPaths brings in yaml, which they never need.
        from trainyard.project import ProjectPaths

        inboxes = ProjectPaths(shape.root).staging / "workers"
        _remove_orphans(inboxes)
        return PersistentJob(shape, train, inboxes / f"job-{os.getpid()}-{next(self._names)}")

    def _give_back(self, job: PersistentJob | None = None) -> None:
        """Idle again, for the next job of its shape; stopped if it cannot take one (dead,
        retired, or no block is open), and so are the oldest idle ones beyond capacity."""
        with self._lock:
            if job is not None:
                self._idle.append(job)
            closing = [j for j in self._idle if not j.alive()]
            live = [j for j in self._idle if j.alive()]
            surplus = max(0, len(live) - self._capacity)
            closing += live[:surplus]
            self._idle = live[surplus:]
        for stale in closing:  # all asked first: they leave side by side
            stale.ask_to_stop()
        for stale in closing:
            stale.close()

    def open_block(self, max_idle: int) -> None:
        with self._lock:
            self._capacity += max_idle

    def close_block(self, max_idle: int) -> None:
        with self._lock:
            self._capacity -= max_idle
        self._give_back()


def _remove_orphans(inboxes: Path) -> None:
    """The inboxes of launchers that died without closing them (a SIGKILLed sweep: its
    guardian stopped the workers, nobody removed their folder)."""
    for folder in inboxes.glob("job-*-*"):
        try:
            os.kill(int(folder.name.split("-")[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours to judge
            pass


_pool = WorkerPool()


@contextlib.contextmanager
def persistent_workers(max_idle: int = 1) -> Iterator[WorkerPool]:
    """Run this block's single-node jobs on persistent workers (see the module's doc),
    keeping up to `max_idle` groups idle between jobs; they stop when the last open block
    ends. Nested and concurrent blocks (flows in threads) share the process's pool."""
    if max_idle < 1:
        raise ValueError(f"max_idle={max_idle}: a block keeps at least one group of workers")
    _pool.open_block(max_idle)
    try:
        yield _pool
    finally:
        _pool.close_block(max_idle)


def active_pool() -> WorkerPool | None:
    """The process's pool while a `persistent_workers` block is open, else None."""
    return _pool if _pool.active else None


def prestart_slots(
    root: Path,
    train: TrainConfig,
    store_env: dict[str, str],
    slot_gpus: Sequence[Sequence[int] | None],
) -> int:
    """`prestart_training` for a sweep's trial slots, one group each, on its own GPUs (None:
    the slots share a shape, the CPU's); returns how many groups it started."""
    started = 0
    for gpus, groups in Counter(None if g is None else tuple(g) for g in slot_gpus).items():
        on_slot = train if gpus is None else train.model_copy(update={"gpus": list(gpus)})
        started += prestart_training(root, on_slot, store_env, groups)
    return started


def prestart_training(
    root: Path, train: TrainConfig, store_env: dict[str, str], groups: int = 1
) -> int:
    """Inside a `persistent_workers` block: start the workers a training job of `train` will
    run on (`groups` groups of `train.workers`), so that they come up while the caller
    does other work; returns how many groups it started (none outside a block)."""
    pool = active_pool()
    if pool is None or not serves(train):
        return 0
    return pool.prestart(root, train, store_env, train.max_restarts, groups)
