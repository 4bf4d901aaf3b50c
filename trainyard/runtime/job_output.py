"""What a torchrun job's output says when it ends: the failing rank, its exit code, error
and traceback (from torchrun's summary and the rank's error file), the restarts its agent
made, and whether the agent itself was lost."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections import deque
from pathlib import Path

from trainyard.errors import WorkerFailed

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

    restarts: int  # always counted: what the agent said before it was lost

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
