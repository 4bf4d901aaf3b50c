"""A worker forked by torchrun's agent behaves as a process started on its own.

Every job's workers are forked from their agent (torchrun's `--run-path` with
`--start-method=fork`: trainyard.runtime.torchrun), which has imported torch and the
worker's modules once (trainyard.runtime.launch.torchrun): a worker is up in milliseconds
where a new interpreter took ~5 s of CPU to import them, on every start and restart.

A forked child inherits what its agent set up for itself, and multiprocessing ends it its
own way; here it is given what `python -m trainyard.engine.worker` under torchrun had:
- a session of its own, as torchrun starts every worker: a signal to the agent's process
  group must not reach it (the agent passes it on, and a second one ends a worker at once,
  before it commits);
- default signal handlers (the agent traps SIGTERM, SIGINT, SIGHUP and SIGQUIT), and no
  parent-death signal (torch sets SIGINT; the worker watches its parent itself:
  trainyard.runtime.guardian.exit_with_parent);
- Python's end: its other threads joined and its own exit handlers run (not the agent's);
- its exit code: a failure's traceback on stderr and 1, `sys.exit(n)`'s n, death by SIGINT
  for an uncaught KeyboardInterrupt.
Its command line is its agent's; its name (/proc/PID/comm, `ps -o comm`) says it is a
worker, and of which rank (`worker_rank`).
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

# A worker's name (/proc/PID/comm: 15 bytes at most, so ranks up to 9999 in full).
WORKER_NAME = "trainyard-r{rank}"
_WORKER_NAME = re.compile(r"trainyard-r(\d+)")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_AGENT_TRAPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run_as_process(main: Callable[[], object]) -> None:
    """Run a worker's `main`: as it is where this process was started on its own, else as
    if it had been (see the module's docstring)."""
    if multiprocessing.parent_process() is None:  # `python -m ...`: nothing to put back
        main()
        return
    _start_afresh()
    code = _exit_code(main)
    # As the interpreter ends: threads first, then the exit handlers. multiprocessing would
    # end this child with neither (os._exit), or join the threads after the handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code:
        os._exit(code)
    # 0: back to torch's wrapper, which hands the agent the return value and exits 0.


def _start_afresh() -> None:
    os.setsid()
    atexit._clear()  # the agent's, which would otherwise run at this worker's end
    for signum in _AGENT_TRAPS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    name = WORKER_NAME.format(rank=os.environ.get("RANK", ""))
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def worker_rank(pid: int) -> int | None:
    """The rank of process `pid` where it is a forked worker (by its name), else None."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # gone
        return None
    match = _WORKER_NAME.fullmatch(name)
    return int(match[1]) if match else None


def _exit_code(main: Callable[[], object]) -> int:
    """What Python would exit with, had `main` run as the process's main module."""
    try:
        main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as failure:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT if isinstance(failure, KeyboardInterrupt) else 1
    return 0
