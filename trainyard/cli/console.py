"""What a command prints: its workers' lines, and where its wall time went.

Each worker logs every line to its own file (`trainyard.util.logs.rank_log`); the console shows
rank 0's lines, once, each with one timestamp, and every rank's warnings and errors.
`trainyard run --all-ranks` (TRAINYARD_ALL_RANKS=1) shows every rank's lines.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from datetime import datetime

ALL_RANKS_ENV = "TRAINYARD_ALL_RANKS"

# trainyard.util.logs' line: "13:37:26.985 [rank 1/2] WARNING trainyard.engine.tracking: message".
_WORKER_LINE = re.compile(
    r"\d\d:\d\d:\d\d\.\d{3} (?P<tag>\[rank (?P<rank>\d+)/\d+\]) "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<rest>.*)",
    re.DOTALL,
)

# torch's own (torchrun's agent): "W1126 13:45:01.123000 2563 torch/.../api.py:719] message".
_TORCH_LINE = re.compile(
    r"(?:\[rank\d+\]:)?(?P<level>[VIWEC])\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ (?P<where>\S+)\] "
    r"(?P<rest>.*)",
    re.DOTALL,
)
# A worker's stderr as torch prefixes it: "[rank1]: Traceback (most recent call last):".
_STDERR_LINE = re.compile(r"\[rank(?P<rank>\d+)\]:.*", re.DOTALL)
_TORCH_LEVELS = {"V": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}


def all_ranks_wanted() -> bool:
    return os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")


class WorkerLines:
    """A torchrun job's output lines (`launch.run_worker`'s `on_line`) on their way to the
    console: `emit(level, text)` gets rank 0's lines, every rank's warnings and errors, and
    the lines no rank tagged (torchrun's own, a traceback); with `all_ranks`, every line.
    A logged line (trainyard's or torch's) loses its timestamp and level: `emit` shows its
    own (Prefect's logger does), so the line has one of each."""

    def __init__(self, emit: Callable[[int, str], None], all_ranks: bool | None = None):
        self.emit = emit
        self.all_ranks = all_ranks_wanted() if all_ranks is None else all_ranks

    def __call__(self, line: str) -> None:
        match = _WORKER_LINE.fullmatch(line)
        if match is None:
            torch = _TORCH_LINE.fullmatch(line)
            if torch is None:
                stderr = _STDERR_LINE.fullmatch(line)
                if stderr and stderr["rank"] != "0" and not self.all_ranks:
                    # Another rank's traceback: its error file (the failure's one line names
                    # it) and torchrun's summary hold it; printed, it was 30-300 lines a try.
                    return
                self.emit(logging.INFO, line)
            else:
                level = _TORCH_LEVELS.get(torch["level"], logging.CRITICAL)
                self.emit(level, f"{torch['where']}: {torch['rest']}")
            return
        level = logging.getLevelName(match["level"])
        if match["rank"] != "0" and level < logging.WARNING and not self.all_ranks:
            return  # in that rank's log file
        self.emit(level, f"{match['tag']} {match['rest']}")


def print_stamped(level: int, text: str) -> None:
    """A console line with one timestamp, for commands that log through no Prefect logger."""
    stamp = datetime.now().strftime("%H:%M:%S.%f")[:-3]
    print(f"{stamp} {logging.getLevelName(level):<7} {text}", flush=True)


_imported = time.monotonic()


def command_seconds() -> float:
    """Seconds since this process started (Python's own start-up and imports included), read
    from the kernel's process table; since this module's import where that cannot be read."""
    fallback = time.monotonic() - _imported
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Field 22, after the command name in parentheses (which may hold spaces).
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return fallback
    seconds = now - ticks / os.sysconf("SC_CLK_TCK")
    # A container can show a virtual uptime beside the host's start times: not a clock.
    return seconds if fallback <= seconds < fallback + 60 else fallback


def where_time_went(
    started_at: float,
    returned_at: float,
    now: float,
    timings: dict[str, float],
    first_step_at: float | None,
) -> str:
    """`completed in`'s parts, adding up to `now - started_at` (unix times: the command's
    start, its flow's return, now): start-up (Python, Prefect, the checks, the dataset's
    version, the workers' start, until the first training step but for the data stage),
    data (split, resume plan), training (from the first step, the job's end included),
    evaluation, and shutdown (the flow's own record keeping, the workers' stop).
    `timings`: the run record's; `first_step_at`: the record's (None: no step was taken)."""
    data = timings.get("data", 0.0)
    evaluation = timings.get("evaluate", 0.0)
    # The flow's record keeping beside its stages (a separate evaluation's launch too).
    keeping = max(0.0, timings.get("total", 0.0) - data - timings.get("train", 0.0))
    if first_step_at is not None and started_at < first_step_at < returned_at:
        start_up = max(0.0, first_step_at - started_at - data)
    else:  # until the stages began
        start_up = max(0.0, returned_at - started_at - timings.get("total", 0.0))
    shutdown = now - returned_at + keeping
    training = max(0.0, now - started_at - start_up - data - evaluation - shutdown)
    parts = {
        "start-up": start_up,
        "data": data,
        "training": training,
        "evaluation": evaluation,
        "shutdown": shutdown,
    }
    return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in parts.items())
