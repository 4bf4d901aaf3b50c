"""A torchrun job's processes: started in a process session of their own, so that a timeout
or a cancelled caller can kill the whole tree (torchrun and every worker), not just the
direct child; stopped all together on an interruption; a lost agent's orphans reaped."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from trainyard.errors import WorkerFailed
from trainyard.runtime.job_output import Tail, job_failed

# The torchrun jobs this process is running. A sweep runs one per trial thread, and an
# interruption reaches the main thread only: `stop_all_jobs` passes it on to every job.
_jobs: set[subprocess.Popen] = set()
_jobs_lock = threading.Lock()
_stopping = threading.Event()
_scope = threading.local()  # the thread's job_scope, if it is inside one


def stop_all_jobs(now: bool = False) -> None:
    """SIGTERM every job's process group (`now`: SIGKILL, a second Ctrl-C's); from now on no
    job starts, and each job's caller raises KeyboardInterrupt (the run was interrupted, it
    did not fail)."""
    _stopping.set()
    with _jobs_lock:
        running = list(_jobs)
    _signal_groups(running, signal.SIGKILL if now else signal.SIGTERM)


def _signal_groups(jobs: list[subprocess.Popen], sig: int) -> None:
    """Send `sig` to each job's process group (a job already gone is skipped)."""
    for proc in jobs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(proc.pid), sig)


# How long a SIGTERMed job may take to end by itself before it is SIGKILLed: its workers
# commit a checkpoint where they stop (checkpoint.interrupt_grace_s, trainyard.cli.interrupts).
_stop_grace_s = 0.0


def allow_stop_grace(grace_s: float) -> None:
    global _stop_grace_s
    _stop_grace_s = grace_s


def _wait_after(sig: int, grace_s: float) -> float:
    return max(grace_s, _stop_grace_s) if sig == signal.SIGTERM else grace_s


def stopping() -> bool:
    return _stopping.is_set()


class ScopedJobs:
    """The torchrun jobs one thread starts inside a `job_scope`, for another thread to stop
    or to make restart their workers."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def _jobs(self) -> list[subprocess.Popen]:
        with _jobs_lock:
            return [proc for proc in _jobs if getattr(proc, "scope", None) is self.stopped]

    def stop(self) -> None:
        """SIGTERM the jobs, and start none here any more (their callers raise
        KeyboardInterrupt), as `stop_all_jobs` stops every job."""
        self.stopped.set()
        _signal_groups(self._jobs(), signal.SIGTERM)

    def restart_workers_started_before(self, boot_s: float) -> int:
        """SIGKILL the jobs' workers (torchrun's agents excepted) that started before
        `boot_s`, seconds since boot (CLOCK_BOOTTIME, as /proc counts): each agent sees its
        worker group fail and restarts it, meeting the rendezvous anew. How many."""
        killed = 0
        for proc in self._jobs():
            for pid in job_processes(proc):
                if _started_at(pid) < boot_s:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
        return killed


def _started_at(pid: int) -> float:
    """When process `pid` started, in seconds since boot (inf if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.inf
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks


@contextlib.contextmanager
def job_scope() -> Iterator[ScopedJobs]:
    """The jobs this thread starts inside the block, for another thread to stop or restart:
    one multi-node run's own, where a sweep trains several runs at once in one process."""
    scoped = ScopedJobs()
    outer = getattr(_scope, "stopped", None)
    _scope.stopped = scoped.stopped
    try:
        yield scoped
    finally:
        _scope.stopped = outer


def _stopped(proc: subprocess.Popen | None = None) -> bool:
    scope = getattr(proc, "scope", None) if proc else getattr(_scope, "stopped", None)
    return _stopping.is_set() or (scope is not None and scope.is_set())


def run_job(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout_s: float,
    on_line: Callable[[str], None] = print,
) -> None:
    """Run a torchrun job to completion, streaming its output; raise WorkerFailed otherwise
    (KeyboardInterrupt once `stop_all_jobs`, or its `job_scope`'s stop, was called)."""
    tail = Tail()
    proc = start_job(cmd, env, cwd)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
        if proc.returncode:
            reap_orphans(proc)  # before they can commit
        if _stopped(proc):
            kill_tree(proc)
            raise KeyboardInterrupt
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise WorkerFailed(
            f"torchrun job exceeded train.timeout_s={timeout_s:g}s and was killed"
        ) from None
    except BaseException:
        kill_tree(proc)  # cancelled or interrupted: no worker may outlive its run
        raise
    finally:
        forget_job(proc)
        reader.join(timeout=10)
    if proc.returncode != 0:
        raise job_failed(proc, tail)


def start_job(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """A torchrun job in a session of its own (its output on a pipe), which `stop_all_jobs`
    stops until `forget_job`; KeyboardInterrupt once `stop_all_jobs` (or the
    thread's `job_scope` stop) was called."""
    if _stopped():
        raise KeyboardInterrupt
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env | {JOB_TAG_ENV: tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    proc.job_tag = tag  # type: ignore[attr-defined]
    proc.scope = getattr(_scope, "stopped", None)  # type: ignore[attr-defined]
    with _jobs_lock:
        _jobs.add(proc)
    return proc


def forget_job(proc: subprocess.Popen) -> None:
    with _jobs_lock:
        _jobs.discard(proc)


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the job's process group, then SIGKILL whatever is left (after the stop
    grace, if longer), then the job's processes outside it (`reap_orphans`)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:  # torchrun is gone already; its workers may not be
        reap_orphans(proc)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _group_ends(proc, pgid, _wait_after(sig, grace_s)):
            break
    reap_orphans(proc)


# Every process of a job has this in its environment (torchrun passes its own on to the
# workers): torchrun starts each worker in a session of its own, out of reach of the job's
# process group, and a worker outlives a SIGKILLed agent until it notices (exit_with_parent).
JOB_TAG_ENV = "TRAINYARD_JOB_TAG"


def job_processes(proc: subprocess.Popen) -> list[int]:
    """The live processes of the job `proc` started, torchrun excepted: /proc's environ of
    each process of this account."""
    marker = f"{JOB_TAG_ENV}={getattr(proc, 'job_tag', '')}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == proc.pid:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                tagged = marker in handle.read().split(b"\0")
            with open(f"/proc/{entry.name}/stat") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):  # gone, or another account's
            continue
        if tagged and not zombie:
            found.append(int(entry.name))
    return found


def reap_orphans(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGKILL what is left of the job once its torchrun is gone, and wait until it is gone
    too: a worker of a dead agent must not hold the rendezvous or commit a checkpoint after
    a relaunched one has resumed. Returns how many there were."""
    if proc.poll() is None or not getattr(proc, "job_tag", None):
        return 0
    orphans = job_processes(proc)
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while orphans and job_processes(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(orphans)


def _group_ends(proc: subprocess.Popen, pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
