"""What a command prints beside its workers' lines (trainyard.runtime.worker_lines): stamped
lines, one-line errors, and where its wall time went."""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime


def print_stamped(level: int, text: str) -> None:
    """A console line with one timestamp, for commands that log through no Prefect logger;
    none for DEBUG (as Prefect's logger shows none by default: the log file has them)."""
    if level < logging.INFO:
        return
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


ERROR_LINE_MAX = 500  # characters; a refusal is one readable line, whatever it quotes


def error_line(exc: Exception) -> str:
    """`trainyard: error: ...` as one line of at most ERROR_LINE_MAX characters."""
    return capped(" ".join(part.strip() for part in f"trainyard: error: {exc}".splitlines()))


def capped(line: str) -> str:
    """`line` cut to ERROR_LINE_MAX characters, an ellipsis saying so."""
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 1] + "…"
