"""A worker forked by torchrun's agent behaves as one started on its own
(trainyard.runtime.forked), and the agent reports every worker that failed
(trainyard.runtime.failures.ReportsEveryFailure). Real forked processes, no torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, MultiprocessContext

from trainyard.runtime.failures import ReportsEveryFailure
from trainyard.runtime.forked import worker_rank

# What torchrun's agent does, in a fresh interpreter (the test's own process runs Prefect's
# services, whose exit hooks a forked child would inherit): trap SIGTERM, fork a child that
# runs `main` (chosen by name) under run_as_process with RANK set, print its exit code.
AGENT = """
import atexit, multiprocessing, os, signal, sys, threading, time
from pathlib import Path
from trainyard.runtime.forked import run_as_process, worker_rank

out = Path(sys.argv[2])

def describe():
    handler = signal.getsignal(signal.SIGTERM)
    name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    same_session = os.getsid(0) == os.getsid(os.getppid())
    out.write_text(f"{name} {worker_rank(os.getpid())} {handler == signal.SIG_DFL} {same_session}")

def late():
    time.sleep(0.5)
    with out.open("a") as f:
        f.write("thread ")

def leaves_a_thread_and_a_handler():
    threading.Thread(target=late).start()  # not a daemon: the end waits for it
    atexit.register(lambda: out.open("a").write("handler"))
    sys.exit(4)

def raises():
    raise ValueError("broke on purpose")

MAINS = {
    "describe": describe,
    "leaves": leaves_a_thread_and_a_handler,
    "raises": raises,
    "exit-0": lambda: sys.exit(0),
    "exit-2": lambda: sys.exit(2),
    "exit-text": lambda: sys.exit("one line"),
}

def child():
    os.environ["RANK"] = "3"
    run_as_process(MAINS[sys.argv[1]])

signal.signal(signal.SIGTERM, lambda *_: None)
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(timeout=60)
print(process.exitcode)
"""


def _forked(main: str, out: Path) -> tuple[int | None, str]:
    """The exit code of a worker forked to run AGENT's `main`, and what it wrote on stderr."""
    done = subprocess.run(
        [sys.executable, "-c", AGENT, main, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code = done.stdout.split()[-1]
    return (None if code == "None" else int(code)), done.stderr


def test_a_forked_worker_has_its_rank_for_a_name_a_session_of_its_own_and_default_handlers(
    tmp_path,
):
    out = tmp_path / "out"
    assert _forked("describe", out)[0] == 0
    assert out.read_text() == "trainyard-r3 3 True False"
    assert worker_rank(os.getpid()) is None  # this process is no worker


def test_a_forked_worker_exits_as_a_process_would(tmp_path):
    assert _forked("exit-0", tmp_path)[0] == 0
    assert _forked("exit-2", tmp_path)[0] == 2
    code, err = _forked("exit-text", tmp_path)
    assert code == 1 and "one line" in err
    code, err = _forked("raises", tmp_path)
    assert code == 1 and "Traceback" in err and "ValueError: broke on purpose" in err


def test_a_forked_worker_joins_its_threads_then_runs_its_exit_handlers(tmp_path):
    out = tmp_path / "out"
    assert _forked("leaves", out)[0] == 4
    assert out.read_text() == "thread handler"


def _fails(rank: int, tmp: str) -> None:
    """Rank 1 fails on its own; rank 0 a moment later, as a peer that lost it would."""
    if rank == 0:
        time.sleep(0.3)
    raise SystemExit(1)


@pytest.mark.parametrize("context", [MultiprocessContext, ReportsEveryFailure])
def test_every_worker_that_failed_is_reported_not_only_the_first(context, tmp_path):
    workers = context(
        name="fails",
        entrypoint=_fails,
        args={0: (0, str(tmp_path)), 1: (1, str(tmp_path))},
        envs={0: {}, 1: {}},
        start_method="fork",
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    workers.start()
    try:
        deadline = time.monotonic() + 60
        while any(p.is_alive() for p in workers._pc.processes):  # both end before the poll
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = workers.wait(timeout=10)
    finally:
        workers.close()
    assert result is not None and result.is_failed()
    if context is MultiprocessContext:  # torch.multiprocessing names one: the first it checks
        assert len(result.failures) == 1
    else:
        assert list(result.failures) == [0, 1]
        assert {f.exitcode for f in result.failures.values()} == {1}
