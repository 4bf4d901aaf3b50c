"""Launching torchrun jobs: the command line, the environment, a hard timeout, and a failure
message that carries the failing rank's traceback.

The job runs in its own process session so that a timeout or a cancelled caller can kill
the whole tree (torchrun and every worker), not just the direct child.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import WorkerFailed
from trainyard.runtime.guardian import exit_with_parent
from trainyard.runtime.progress import RESTARTS_BEFORE_ENV

if (
    TYPE_CHECKING
):  # not at run time: `python -m trainyard.runtime.launch` starts torchrun, see below
    from trainyard.config import TrainConfig


def torchrun_command(
    train: TrainConfig, worker_args: Sequence[str], max_restarts: int = 0, rdzv_id: str = "job"
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainyard.runtime.launch",  # torchrun (torch.distributed.run), started cheaper: see torchrun()
        *rendezvous_args(train, rdzv_id),
        f"--nproc_per_node={train.workers}",
        # When a worker dies torchrun restarts the whole group, which resumes from the
        # latest committed checkpoint (jobs.train_job).
        f"--max-restarts={max_restarts}",
        "-m",
        "trainyard.engine.worker",
        *worker_args,
    ]


# torchrun's c10d rendezvous with each node's group rank its node_rank (trainyard.runtime.nodes,
# registered under this name in torchrun's process: see torchrun()).
NODE_RANKED_C10D = "trainyard-c10d"


def rendezvous_args(train: TrainConfig, rdzv_id: str) -> list[str]:
    if train.nnodes == 1 and not train.rdzv_endpoint:
        # c10d rendezvous on a free local port: jobs never collide on 29500.
        return ["--standalone"]
    # Every node runs this with its own node_rank; node 0's host serves the rendezvous store
    # at rdzv_endpoint, and the run id keeps concurrent runs apart. torchrun's c10d ignores
    # --node-rank; NODE_RANKED_C10D makes the node rank the node's group rank.
    return [
        f"--nnodes={train.nnodes}",
        f"--rdzv-backend={NODE_RANKED_C10D}",
        f"--rdzv-conf=node_rank={train.node_rank}",
        f"--rdzv-endpoint={train.rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


# glibc's malloc hands memory blocks over 128 KiB back to the kernel when they are freed, so
# a step that frees its gradients and activations faults every page of them in again the
# next step (~1000 faults per 4 MiB; with them the MLP 1024-1024 trained 0.8x as fast).
# Blocks up to 32 MiB (glibc's largest threshold) stay in the heap, and up to 1 GiB of free
# heap is kept: peaks recur every step. Set either variable yourself to choose otherwise.
KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def worker_env(
    extra: dict[str, str], threads: int, gpus: Sequence[int] | None = None
) -> dict[str, str]:
    env = KEEP_FREED_MEMORY | dict(os.environ)
    env.update(extra)
    env["OMP_NUM_THREADS"] = str(threads)
    if gpus is not None:  # local rank r then trains on the r-th of them
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# The torchrun jobs this process is running. A sweep runs one per trial thread, and an
# interruption reaches the main thread only: `stop_all_jobs` passes it on to every job.
_jobs: set[subprocess.Popen] = set()
_jobs_lock = threading.Lock()
_stopping = threading.Event()


def stop_all_jobs(now: bool = False) -> None:
    """SIGTERM every job's process group (`now`: SIGKILL, a second Ctrl-C's); from now on no
    job starts, and each job's caller raises KeyboardInterrupt (the run was interrupted, it
    did not fail)."""
    _stopping.set()
    with _jobs_lock:
        running = list(_jobs)
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL if now else signal.SIGTERM)


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


def run_job(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout_s: float,
    on_line: Callable[[str], None] = print,
) -> None:
    """Run a torchrun job to completion, streaming its output; raise WorkerFailed otherwise
    (KeyboardInterrupt once `stop_all_jobs` was called)."""
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
        if _stopping.is_set():
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
    stops until `forget_job`; KeyboardInterrupt once `stop_all_jobs` was called."""
    if _stopping.is_set():
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


ROOT_CAUSE = "Root Cause (first observed failure):"
_FAILURE = re.compile(r"\[\d+\]:")  # opens a failure in torchrun's summary: "[0]:"
_RULE = re.compile(r"-+|=+")  # ends a section of the summary (tracebacks are indented)


def root_cause(lines: list[str]) -> str:
    """The failing rank's entry in torchrun's summary: rank, exit code and traceback."""
    starts = [i for i, line in enumerate(lines) if line.rstrip() == ROOT_CAUSE]
    if not starts:
        return "\n".join(lines[-60:])
    chosen, is_torchruns = _failing_block(lines, starts[0])
    if chosen is None:
        return "\n".join(lines[starts[0] :])
    if is_torchruns:
        return "\n".join([ROOT_CAUSE, *chosen])
    return "\n".join(["Root Cause (the failure the others followed from):", *chosen])


def _failing_block(lines: list[str], root_at: int) -> tuple[list[str] | None, bool]:
    """(the failing rank's block, whether torchrun chose it too).

    torchrun names the failure with the earliest whole-second timestamp, the lowest rank on
    a tie. When one rank dies, the others' collectives fail on the lost connection within
    the same second, so its pick is often a rank that only lost its peer: prefer one that
    failed on its own, then one that lost a peer over one that torchrun stopped."""
    opened = [i for i, line in enumerate(lines[:root_at]) if line.rstrip() == "Failures:"]
    root = _failure_blocks(lines[root_at + 1 :])[:1]
    others = _failure_blocks(lines[opened[-1] + 1 : root_at]) if opened else []
    if not root:
        return None, False
    chosen = min([*root, *others], key=lambda block: (_stopped(block), _lost_a_peer(block)))
    return chosen, chosen is root[0]


# trainyard.runtime.failures.repeated_line, as torchrun's agent prints it when it stops restarting.
REPEATED = re.compile(r"trainyard: (ranks? .* with the same error: .*; not restarting)")
_RANK = re.compile(r"\s*rank\s*: (\d+)")
_ERROR_FILE = re.compile(r"\s*error_file: (\S+)")
_ATTEMPT = re.compile(r"/attempt_(\d+)/")
_TRACEBACK_LABEL = re.compile(r"^traceback\s*:\s*")  # a one-line "traceback": a signal's


class Tail:
    """A job's last lines of output, and the restarts its torchrun agent said it made."""

    def __init__(self, size: int = 400):
        self.lines: deque[str] = deque(maxlen=size)
        self.restarts = 0

    def append(self, line: str) -> None:
        self.lines.append(line)
        if (found := RESTARTING.search(line)) is not None:
            self.restarts = int(found[1])

    def clear(self) -> None:
        self.lines.clear()
        self.restarts = 0


# trainyard.runtime.failures.restart_line, as torchrun's agent prints it before each restart.
RESTARTING = re.compile(r"trainyard: torchrun restarts the workers \(restart (\d+) of \d+\)")


class AgentLost(WorkerFailed):
    """torchrun's agent itself died (a signal: SIGKILL, the OOM killer, a lost node), not
    one of its workers: `run_worker` launches it again while restarts are left."""

    def __init__(self, message: str, restarts: int = 0):
        super().__init__(message, summary=message, restarts=restarts)

    def __reduce__(self):
        return type(self), (str(self), self.restarts)


def job_failed(proc: subprocess.Popen, tail: Tail) -> WorkerFailed:
    """Why the job `proc` ran ended non-zero: a torchrun agent that ended by a signal was
    lost (AgentLost; torchrun handles SIGTERM, SIGINT and SIGHUP itself and stops its
    workers first). One that exited leaving processes behind is not taken for lost: a
    worker's own children (data loaders) may outlive it by a moment after any failure."""
    if proc.returncode >= 0:
        return worker_failed(proc.returncode, list(tail.lines))
    return AgentLost(
        f"torchrun's agent was killed by {_signal_name(-proc.returncode)}", tail.restarts
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def worker_failed(returncode: int, lines: list[str]) -> WorkerFailed:
    """WorkerFailed for a torchrun job that exited with `returncode`, its last output
    `lines`: the message as ever, and the failing rank's error read from its error file."""
    message = f"torchrun exited with code {returncode}\n{root_cause(lines)}"
    starts = [i for i, line in enumerate(lines) if line.rstrip() == ROOT_CAUSE]
    block = _failing_block(lines, starts[0])[0] if starts else None
    if block is None:
        return WorkerFailed(message)
    rank = next((int(m[1]) for m in map(_RANK.match, block) if m), None)
    path = next((m[1] for m in map(_ERROR_FILE.match, block) if m), "")
    attempts = [int(m[1]) for line in lines for m in _ATTEMPT.finditer(line)]  # torchrun's
    info = _error_file(path)
    summary = info.get("summary") or _TRACEBACK_LABEL.sub("", _error(block).strip())
    trace = info.get("py_callstack") or "\n".join(block)
    repeated = next((m[1] for m in map(REPEATED.search, reversed(lines)) if m), None)
    restarts = max(attempts) if attempts else None
    return WorkerFailed(message, rank, summary, trace, restarts, repeated)


def _error_file(path: str) -> dict:
    """A worker's torchrun error file's extraInfo (py_callstack, and summary where
    trainyard.runtime.failures wrote it); {} if it cannot be read here (another node's)."""
    try:
        message = json.loads(Path(path).read_text()).get("message")
    except (OSError, ValueError):
        return {}
    info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    return info if isinstance(info, dict) else {}


def _failure_blocks(lines: list[str]) -> list[list[str]]:
    blocks: list[list[str]] = []
    for line in lines:
        if _RULE.fullmatch(line.rstrip()):
            break
        if _FAILURE.fullmatch(line.rstrip()):
            blocks.append([])
        if blocks:
            blocks[-1].append(line)
    return blocks


def _lost_a_peer(block: list[str]) -> bool:
    """Its error (the last line: the exception, or the signal) is a collective's connection
    to another rank's process closing or being reset: that rank went away first."""
    error = _error(block)
    return "closed by peer" in error or "reset by peer" in error


def _stopped(block: list[str]) -> bool:
    """It had no error of its own when torchrun stopped it (torchrun SIGTERMs the remaining
    workers once one has failed). One that wrote its traceback before the signal keeps it."""
    return "(SIGTERM) received by PID" in _error(block)


def _error(block: list[str]) -> str:
    return next((line for line in reversed(block) if line.strip()), "")


def run_worker(
    root: Path,
    train: TrainConfig,
    store_env: dict[str, str],
    worker_args: Sequence[str],
    on_line: Callable[[str], None] = print,
    max_restarts: int = 0,
    rdzv_id: str = "job",
    job_env: dict[str, str] | None = None,
) -> None:
    """Launch `trainyard.engine.worker` under torchrun for this project and wait for it; inside a
    `trainyard.runtime.persistent.persistent_workers` block, a single node's job runs on persistent
    workers. `job_env`: the job's own environment (the run's lease token), on top of
    `store_env`. torchrun restarts failed workers; when its agent itself is lost, this
    launches it again, and the new workers resume from the last committed checkpoint. Both
    kinds of restart share `max_restarts`."""
    used = 0  # restarts so far, the agents' of their workers and the relaunches
    while True:
        env = (job_env or {}) | {RESTARTS_BEFORE_ENV: str(used)}
        try:
            _launch(root, train, store_env, worker_args, on_line, max_restarts - used, rdzv_id, env)
            return
        except AgentLost as lost:
            used += lost.restarts + 1
            if used > max_restarts:
                line = f"{lost} with all train.max_restarts={max_restarts} restarts used"
                raise WorkerFailed(line, summary=line, restarts=used - 1) from None
            on_line(
                f"trainyard: {lost}; launching it again to resume from the last committed "
                f"checkpoint (restart {used} of {max_restarts})"
            )
        except WorkerFailed as failed:
            if failed.restarts is not None:  # counted within the last launch
                failed.restarts += used
            raise


def _launch(
    root: Path,
    train: TrainConfig,
    store_env: dict[str, str],
    worker_args: Sequence[str],
    on_line: Callable[[str], None],
    max_restarts: int,
    rdzv_id: str,
    job_env: dict[str, str],
) -> None:
    from trainyard.runtime.persistent import (  # imported here: it imports this module
        active_pool,
        serves,
    )

    args = [*worker_args, "--project-dir", str(root)]
    pool = active_pool()
    if pool is not None and serves(train):
        pool.run(root, train, store_env, max_restarts, args, job_env, on_line)
        return
    cmd = torchrun_command(train, args, max_restarts, rdzv_id)
    env = worker_env(store_env | job_env, train.threads_per_worker, train.gpus)
    run_job(cmd, env, root, train.timeout_s, on_line)


def torchrun() -> None:
    """`python -m torch.distributed.run`, the same main with the same arguments, minus two
    pauses every job waited for: collections during its imports (torch), and the final one
    over their objects at exit, which took ~0.5 s after the workers had finished. Its agent
    stops restarting a worker group that failed the same way twice (trainyard.runtime.failures)."""
    gc.disable()
    try:
        from torch.distributed.launcher import api
        from torch.distributed.run import main

        from trainyard.engine.interrupt_checkpoint import agent_waits_for_commits
        from trainyard.runtime import nodes
        from trainyard.runtime.failures import StopsOnRepeat
    finally:
        gc.enable()
    agent_waits_for_commits()  # told to stop, it lets its workers commit first
    nodes.register(NODE_RANKED_C10D)  # rendezvous_args' rendezvous for more than one node
    # The agent torchrun's launcher builds: one that does not restart a failure that repeats.
    api.LocalElasticAgent = StopsOnRepeat
    gc.freeze()
    atexit.register(gc.freeze)  # at exit, after every handler registered later
    # Its launcher killed outright (SIGKILL, the OOM killer) runs no clean-up: without this
    # the job trains on, orphaned, for as long as it would have run.
    exit_with_parent(signum=signal.SIGTERM)
    main()


if __name__ == "__main__":
    torchrun()
