"""A torchrun job's output lines on their way to a console: rank 0's, once, each with one
timestamp, and every rank's warnings and errors.

Each worker logs every line to its own file (`trainyard.util.logs.rank_log`); given a
`log_file`, every line of the job (torchrun's agent's too) goes there as well, and the
console gets torchrun's own tracebacks, and rank 0's, as their exception lines only (a lost
peer made ~100 lines of C++ frames and Python stack a restart; a failed job's summary box,
15 more).
`trainyard run --all-ranks` (TRAINYARD_ALL_RANKS=1) shows every line. The CLI's `join`
prints them; the flow's training task logs them through Prefect's logger.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

ALL_RANKS_ENV = "TRAINYARD_ALL_RANKS"

# trainyard.util.logs' line: "13:37:26.985 [rank 1/2] WARNING trainyard.engine.tracking: message".
_WORKER_LINE = re.compile(
    r"\d\d:\d\d:\d\d\.\d{3} (?P<tag>\[rank (?P<rank>\d+)/\d+\]) "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<rest>.*)",
    re.DOTALL,
)

# torch's own: its Python logging (torchrun's agent), "W1126 13:45:01.123000 2563
# torch/.../api.py:719] message", and its C++ logging (c10d's store and sockets),
# "[W1128 04:33:29.988174618 socket.cpp:207] [c10d] message".
_TORCH_LINE = re.compile(
    r"(?:\[rank\d+\]:)?\[?(?P<level>[VIWEC])\d{4} \d\d:\d\d:\d\d\.\d{6,9}(?: \d+)? "
    r"(?P<where>[^\s\]]+)\] (?P<rest>.*)",
    re.DOTALL,
)
# A worker's stderr as torch prefixes it: "[rank1]: Traceback (most recent call last):".
_STDERR_LINE = re.compile(r"\[rank(?P<rank>\d+)\]: ?(?P<text>.*)", re.DOTALL)
# An untagged traceback's lines after its first (its stack), and the line that chains two.
_STACK_LINE = re.compile(r"\s.*")
_CHAIN_LINE = re.compile(r"The above exception .*|During handling of the above .*")
# c10d's C++ stack under a warning: "Exception raised from recvBytes at ...", "frame #3: ...".
_CPP_STACK_LINE = re.compile(
    r"(?:Exception raised from .*|frame #\d+: .*|<omitting python frames>)"
)
# The summary box torchrun's ChildFailedError prints under its exception line, between two
# rules of "=": the failed ranks, exit codes, error files (the CLI's failure line says them).
_SUMMARY_RULE = re.compile(r"={20,}")
_TORCH_LEVELS = {"V": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}
# torch's warnings that say nothing is wrong, logged at DEBUG: c10d's store names each client
# by a reverse lookup of its address, which a host without a DNS name for it fails.
_HARMLESS = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")


def all_ranks_wanted() -> bool:
    return os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")


class WorkerLines:
    """A torchrun job's output lines (`launch.run_worker`'s `on_line`) on their way to the
    console: `emit(level, text)` gets rank 0's lines, every rank's warnings and errors, and
    the lines no rank tagged (torchrun's own, a traceback); with `all_ranks`, every line.
    A logged line (trainyard's or torch's) loses its timestamp and level: `emit` shows its
    own (Prefect's logger does), so the line has one of each."""

    def __init__(
        self,
        emit: Callable[[int, str], None],
        all_ranks: bool | None = None,
        log_file: Path | None = None,
    ):
        self.emit = emit
        self.all_ranks = all_ranks_wanted() if all_ranks is None else all_ranks
        self.log_file = log_file
        # torchrun's own stacks folded on the console: only where the log file holds them
        self._folds = log_file is not None and not self.all_ranks
        self._torchrun_traceback = _TracebackFold()  # its own, untagged
        self._rank_traceback = _TracebackFold()  # rank 0's, each line tagged [rank0]:
        self._summary_rules_left = 0
        if log_file is not None:  # owner-only, as the ranks' logs beside it
            log_file.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))

    def __call__(self, line: str) -> None:
        if self.log_file is not None:
            self._keep(line)
        match = _WORKER_LINE.fullmatch(line)
        if match is None:
            torch = _TORCH_LINE.fullmatch(line)
            if torch is None:
                stderr = _STDERR_LINE.fullmatch(line)
                # Only untagged lines are torchrun's own: a worker's line may land mid-stack.
                if stderr is None and self._folds and self._stack_of_torchrun(line):
                    return
                if stderr and stderr["rank"] != "0" and not self.all_ranks:
                    # Another rank's traceback: its error file (the failure's one line names
                    # it) and torchrun's summary hold it; printed, it was 30-300 lines a try.
                    return
                if stderr and self._folds and self._stack_of_rank(line, stderr["text"]):
                    return
                self.emit(logging.INFO, line)
            else:
                level = _TORCH_LEVELS.get(torch["level"], logging.CRITICAL)
                if _HARMLESS.match(torch["rest"]):
                    level = logging.DEBUG
                self.emit(level, f"{torch['where']}: {torch['rest']}")
            return
        level = logging.getLevelNamesMapping()[match["level"]]
        if match["rank"] != "0" and level < logging.WARNING and not self.all_ranks:
            return  # in that rank's log file
        self.emit(level, f"{match['tag']} {match['rest']}")

    def _keep(self, line: str) -> None:
        """`line` appended to the log file; where that fails (a full disk), the console gets
        every line whole from then on, and the job goes on: this runs on the thread that
        drains the job's pipe, which must never stop."""
        assert self.log_file is not None  # called only with one
        try:
            with self.log_file.open("a", encoding="utf-8") as log:
                log.write(line + "\n")
        except OSError as exc:
            shown, self.log_file, self._folds = _shown(self.log_file), None, False
            self.emit(logging.WARNING, f"stopped writing {shown} ({exc}); lines shown whole")

    def _stack_of_torchrun(self, line: str) -> bool:
        """Whether `line` belongs to a traceback or C++ stack of torchrun's own, which the log
        file holds; a traceback's exception line is shown, saying where the rest is."""
        if self._summary_rules_left:
            self._summary_rules_left -= bool(_SUMMARY_RULE.fullmatch(line))
            return True
        if _CPP_STACK_LINE.fullmatch(line):
            return True
        part = self._torchrun_traceback.part(line)
        if part != "exception":
            return part == "held"
        held = "traceback"
        if line.rstrip().endswith("ChildFailedError:"):
            self._summary_rules_left = 2
            line, held = line.rstrip().removesuffix(":"), "summary and traceback"
        self.emit(logging.ERROR, f"{line} (its {held}: {_shown(self.log_file)})")
        return True

    def _stack_of_rank(self, line: str, text: str) -> bool:
        """Whether rank 0's stderr `line` (`text`, without its tag) belongs to a Python
        traceback, which the log file holds (a lost peer's was ~40 lines a restart): its
        exception line is shown, a warning, as torchrun may restart the worker (a failed
        run's own line comes from the rank's error file)."""
        part = self._rank_traceback.part(text)
        if part == "exception":
            self.emit(logging.WARNING, f"{line} (its traceback: {_shown(self.log_file)})")
        return part != "other"


class _TracebackFold:
    """Where one stream of lines stands in a Python traceback (chained ones too)."""

    def __init__(self) -> None:
        self.inside = False

    def part(self, text: str) -> str:
        """ "held": `text` is a traceback's first line, its stack, or a blank or chaining line
        between two; "exception": the line that ends it; "other": no traceback's."""
        if text == "Traceback (most recent call last):":
            self.inside = True
            return "held"
        if not text.strip() or _CHAIN_LINE.fullmatch(text):
            return "held"
        if not self.inside:
            return "other"
        if _STACK_LINE.fullmatch(text):
            return "held"
        self.inside = False
        return "exception"


def _shown(path: Path | None) -> str:
    """`path` from the working directory where it is under it (the project's root)."""
    if path is None or not path.is_relative_to(Path.cwd()):
        return str(path)
    return str(path.relative_to(Path.cwd()))
