"""A worker forked by torchrun's agent behaves as one started on its own
(trainyard.runtime.forked), and the agent reports every worker that failed
(trainyard.runtime.failures.ReportsEveryFailure). Real forked processes, no torchrun."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, MultiprocessContext

from trainyard.runtime.failures import ReportsEveryFailure
from trainyard.runtime.forked import run_as_process, worker_rank

FORK = multiprocessing.get_context("fork")


def _forked(main, out: Path, rank: str = "3") -> int:
    """Run `main` under run_as_process in a forked child (as torchrun's agent runs a worker,
    with a SIGTERM handler of its own to leave behind); the child's exit code."""

    def child() -> None:
        os.environ["RANK"] = rank
        run_as_process(lambda: main(out))

    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        process = FORK.Process(target=child)
        process.start()
        process.join(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert process.exitcode is not None, "the forked worker did not end"
    return process.exitcode


def _describe(out: Path) -> None:
    """Write what the process is: its name, session, SIGTERM handler."""
    handler = signal.getsignal(signal.SIGTERM)
    name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    same_session = os.getsid(0) == os.getsid(os.getppid())
    out.write_text(f"{name} {worker_rank(os.getpid())} {handler == signal.SIG_DFL} {same_session}")


def test_a_forked_worker_has_its_rank_for_a_name_a_session_of_its_own_and_default_handlers(
    tmp_path,
):
    out = tmp_path / "out"
    assert _forked(_describe, out) == 0
    assert out.read_text() == "trainyard-r3 3 True False"
    assert worker_rank(os.getpid()) is None  # this process is no worker


def _exits(code):
    def main(out: Path) -> None:
        sys.exit(code)

    return main


def _raises(out: Path) -> None:
    raise ValueError("broke on purpose")


def test_a_forked_worker_exits_as_a_process_would(tmp_path, capfd):
    assert _forked(_exits(0), tmp_path) == 0
    assert _forked(_exits(2), tmp_path) == 2
    assert _forked(_exits("one line"), tmp_path) == 1
    assert _forked(_raises, tmp_path) == 1
    err = capfd.readouterr().err
    assert "one line" in err
    assert "Traceback" in err and "ValueError: broke on purpose" in err


def _leaves_a_thread_and_a_handler(out: Path) -> None:
    def late() -> None:
        time.sleep(0.5)
        with out.open("a") as f:
            f.write("thread ")

    threading.Thread(target=late).start()  # not a daemon: the end waits for it
    import atexit

    atexit.register(lambda: out.open("a").write("handler"))
    sys.exit(4)


def test_a_forked_worker_joins_its_threads_then_runs_its_exit_handlers(tmp_path):
    out = tmp_path / "out"
    assert _forked(_leaves_a_thread_and_a_handler, out) == 4
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
