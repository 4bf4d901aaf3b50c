"""Nothing a trainyard command starts outlives it, even when the command is SIGKILLed: the
process-tree tools and the command's side of its guardian.

The command starts its guardian, `python -m trainyard.cli.guardian` (the watcher), in a
session of its own and holds the write end of its stdin pipe. While the command lives, the
watcher notes every process descended from it (torchrun, the workers, dvc). The kernel
closes the pipe however the command ends; a clean end says "exit" first. EOF without it
means the command died: the watcher marks the Prefect flow runs announced here crashed (the
API server still answers), then stops every noted process still alive (`stop_all`). The
embedded S3 store and the project's Prefect server, which a command may have started, are
spared: they outlive commands on purpose.
A deployment run's process, which a Prefect worker starts, has no trainyard command above
it and starts a guardian for itself when its first flow announces itself.

A parent-death signal would not do: it fires when the parent *thread* exits, and torchrun
runs in a session of its own. Processes are identified by (pid, start time), so a
recycled pid is never signalled.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainyard.project import ProjectPaths
from trainyard.util.files import write_text_atomic

GUARD_FILE_ENV = "TRAINYARD_GUARD_FILE"
# Set by a Prefect worker (or `serve`'s runner) in the process it starts for a flow run.
FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"
# The watcher's module, started by name as torchrun starts the engine's worker: a process
# boundary, not an import (it reads the Prefect server's home the CLI's way).
WATCHER_MODULE = "trainyard.cli.guardian"
EXIT_WORD = b"exit"
GRACE_S = 5.0
_announce_lock = threading.Lock()


class Guardian:
    """The command's side: start the watcher, tell it what to clean up, release it."""

    def __init__(self, state_file: Path, paths: ProjectPaths):
        self.state_file = state_file
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.unlink(missing_ok=True)
        os.environ[GUARD_FILE_ENV] = str(state_file)  # the flow announces its run here
        args = [sys.executable, "-m", WATCHER_MODULE, str(os.getpid()), str(state_file)]
        self._proc = subprocess.Popen(
            [*args, str(paths.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal's group must not reach it
            close_fds=True,
        )

    @classmethod
    def for_this_process(cls, paths: ProjectPaths) -> Guardian:
        """A guardian for this process, released when it exits normally."""
        guardian = cls(paths.state / "guard" / f"{os.getpid()}.json", paths)
        atexit.register(guardian.release)
        return guardian

    def release(self) -> None:
        """A clean end: the watcher leaves everything alone and exits."""
        if self._proc.stdin is None or self._proc.stdin.closed:
            return
        try:
            self._proc.stdin.write(EXIT_WORD)
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self.state_file.unlink(missing_ok=True)


def announce_flow_run(api_url: str | None, flow_run_id: str | None) -> None:
    """Called inside each flow (a pipeline and its subflows): the Prefect flow runs to mark
    crashed if the command dies. A deployment run's process, started by a Prefect worker,
    has no trainyard command above it: it starts a guardian of its own."""
    if not api_url or not flow_run_id:
        return
    with _announce_lock:  # a sweep's trials announce their subflows from several threads
        if GUARD_FILE_ENV not in os.environ and os.environ.get(FLOW_RUN_ENV):
            _guard_deployment_run(api_url, os.environ[FLOW_RUN_ENV])
        path = os.environ.get(GUARD_FILE_ENV)
        if path:
            _note_flow_run(Path(path), api_url, flow_run_id)


def _guard_deployment_run(api_url: str, flow_run_id: str) -> None:
    """Prefect's worker marks a deployment run crashed when its process dies, but not the
    subflows, which would stay Running for good, and it kills the process's group only:
    torchrun, in a session of its own, would train on."""
    guardian = Guardian.for_this_process(ProjectPaths.here())  # the worker starts runs there
    _note_flow_run(guardian.state_file, api_url, flow_run_id)


def _note_flow_run(path: Path, api_url: str, flow_run_id: str) -> None:
    try:
        runs = json.loads(path.read_text())["flow_run_ids"]
    except (OSError, ValueError, KeyError):
        runs = []
    if flow_run_id in runs:
        return
    write_text_atomic(path, json.dumps({"api_url": api_url, "flow_run_ids": [*runs, flow_run_id]}))


def _stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the name (which may hold spaces and ')'); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] == "Z" else fields


def process_start_time(pid: int) -> str | None:
    """When a live process started (clock ticks since boot): with the pid, its identity."""
    fields = _stat(pid)
    return fields[19] if fields else None


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live process."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo += children.get(pid, [])
    return found


def _alive(pid: int, started: str, table: dict[int, tuple[int, str]]) -> bool:
    return pid in table and table[pid][1] == started


def _spared(spare_files: list[Path], table: dict[int, tuple[int, str]]) -> set[int]:
    """The servers' pids (from their state files, as written once they answered) and their
    children."""
    spared = set()
    for path in spare_files:
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        spared |= {pid, *descendants(pid, table)}
    return spared


def stop_all(noted: dict[int, str], spare_files: list[Path]) -> None:
    """SIGTERM every noted process still alive but the spared servers', then SIGKILL what
    is left after GRACE_S."""
    table = process_table()
    spared = _spared(spare_files, table)
    targets = {p: s for p, s in noted.items() if p not in spared}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in targets.items():
            if _alive(pid, started, table):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            table = process_table()
            if not any(_alive(p, s, table) for p, s in targets.items()):
                return
            time.sleep(0.1)


def exit_with_parent(interval_s: float = 1.0, signum: int | None = None) -> None:
    """End this process once its parent is gone (it is reparented): a torchrun worker once
    its torchrun is, torchrun once the flow or command that launched it is. A SIGKILLed
    parent forwards no signal, and torchrun runs in a session of its own, out of reach of a
    process-group kill (Prefect's, after its cancellation grace period). `signum`: send
    this signal to itself instead of exiting at once, so that its handler runs first
    (torchrun's stops the workers)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        if signum is None:
            os._exit(70)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
