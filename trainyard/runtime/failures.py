"""A failure that repeats is not retried: the worker fingerprints its exception, torchrun's
agent compares two attempts' fingerprints and stops restarting when they match.

Both halves extend torchrun's own extension points: the worker writes its error file with
an `ErrorHandler` (what `record` uses; the fingerprint rides in the file's `extraInfo`), and
the agent is torchrun's `LocalElasticAgent`, which reads those files after every attempt.
A worker killed by a signal, a lost peer or store, or a hang leaves no fingerprint, so such
a failure is restarted as before. Imported by the worker and the torchrun agent only.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic import multiprocessing
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, RunProcsResult
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

from trainyard.errors import StoreError, first_line

# Its failure is another process's, or the network's: the next attempt may well succeed.
TRANSIENT = (ConnectionError, TimeoutError, DistError, StoreError)
_LOST_PEER = ("closed by peer", "reset by peer", "broken pipe")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")  # pids, ports, addresses, sizes vary per attempt
_LIBRARIES = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)
MESSAGE_MAX = 500  # characters of a message that a fingerprint keeps


def fingerprint(exc: BaseException) -> str | None:
    """Type, message with its numbers masked, and the innermost frame outside Python's and
    the installed packages' code; None for a failure that may not happen again."""
    if any(_transient(e) for e in _chain(exc)):
        return None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    message = _NUMBER.sub("#", str(exc))[:MESSAGE_MAX]
    return f"{kind}: {message} @ {_own_frame(exc.__traceback__)}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _transient(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TRANSIENT) or any(sign in text for sign in _LOST_PEER)


def _own_frame(tb: TracebackType | None) -> str:
    frames = traceback.extract_tb(tb)
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES + ("<",))]
    candidates = own or frames
    if not candidates:
        return "-"
    frame = candidates[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


class FailureRecorder(ErrorHandler):
    """torchrun's error file, as `record` writes it, plus the one-line summary and the
    fingerprint the agent compares."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                    "summary": first_line(e),
                    "fingerprint": fingerprint(e),
                },
            }
        }
        with open(path, "w") as fp:
            json.dump(data, fp)


def extra_info(failure: object) -> dict:
    """The `extraInfo` of a torchrun ProcessFailure's error file ({} if it has none)."""
    message = getattr(failure, "error_file_data", {}).get("message")
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def repeated_line(rank: int, before: int, summary: str) -> str:
    """What the agent prints when it stops; trainyard.runtime.job_output.REPEATED reads it back."""
    who = f"rank {rank} failed twice" if rank == before else f"ranks {before} then {rank} failed"
    return f"trainyard: {who} with the same error: {summary}; not restarting"


def restart_line(used: int, allowed: int) -> str:
    """What the agent prints before it restarts its workers after a failure; the launcher
    (trainyard.runtime.job_output.Tail) counts them: were the agent lost, they count against
    the run's restarts too."""
    return f"trainyard: torchrun restarts the workers (restart {used} of {allowed})"


class StopsOnRepeat(LocalElasticAgent):
    """torchrun's agent, which restarts a failed worker group up to --max-restarts times,
    unless the group failed with the same fingerprinted error as the attempt before: then
    it has no restarts left, and ends the job as torchrun ends one that ran out of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last: dict[str, int] = {}  # the previous failed attempt's fingerprints: rank
        self._told = 0  # restarts said so far

    def _restart_workers(self, worker_group):
        # Also called when a node joins: only a failure's restart takes one of max_restarts.
        allowed = worker_group.spec.max_restarts
        used = allowed - self._remaining_restarts
        if used > self._told:
            self._told = used
            print(restart_line(used, allowed), file=sys.stderr, flush=True)
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if not result.is_failed():
            return result
        current = {}
        for rank, failure in sorted(result.failures.items()):
            info = extra_info(failure)
            if info.get("fingerprint"):
                current[info["fingerprint"]] = rank
                repeat = info["fingerprint"] in self._last
                if repeat and self._remaining_restarts > 0:
                    before = self._last[info["fingerprint"]]
                    print(repeated_line(rank, before, info.get("summary", "")), file=sys.stderr)
                    self._remaining_restarts = 0  # the loop then stops, as at max_restarts
        self._last = current
        return result


class ReportsEveryFailure(MultiprocessContext):
    """Forked workers' failures, reported as torchrun reports those of workers it started
    (its SubprocessContext): every worker that had exited non-zero when the first was seen,
    not only that one. torch.multiprocessing names a single failed process, the first in its
    own order, so a rank that lost its peer could stand for the rank whose own error ended
    it: the root cause (trainyard.runtime.job_output) and a repeat's fingerprint need all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._failed_before_close: dict[int, tuple[int, int]] = {}  # rank: (pid, exit code)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        if self._pc is not None:
            # Before the survivors are signalled, which would make them failures too.
            self._failed_before_close = {
                rank: (process.pid, process.exitcode)
                for rank, process in enumerate(self._pc.processes)
                if process.exitcode not in (None, 0)
            }
        super().close(death_sig, timeout)

    def _poll(self) -> RunProcsResult | None:
        result = super()._poll()  # on a failure, after close: _failed_before_close is read
        if result is None or not result.failures:
            return result
        for rank, (pid, code) in self._failed_before_close.items():
            if rank not in result.failures:
                error_file = self.error_files[rank]
                result.failures[rank] = ProcessFailure(rank, pid, code, error_file)
        result.failures = dict(sorted(result.failures.items()))  # by rank, as torchrun's
        return result


class _OneLine(logging.Filter):
    """torch.multiprocessing's "failed (exitcode: N) local_rank: R ..." as the one line
    torchrun logs for a worker it started: without the traceback of the agent's own wait,
    which says nothing of the worker's (its error file and stderr do)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("failed (exitcode"):
            record.exc_info, record.exc_text = None, None
        return True


def report_every_failure() -> None:
    """In torchrun's agent: the workers it forks fail as the ones it started did (one line,
    every failed rank reported)."""
    setattr(multiprocessing, "MultiprocessContext", ReportsEveryFailure)  # noqa: B010
    logging.getLogger(multiprocessing.api.__name__).addFilter(_OneLine())
