"""How far training got, across torchrun restarts, and a watchdog for workers that stop moving.

`AttemptLog` is rank 0's record in `<staging>/<run_id>/`: `progress.json` (one event per
resume, replaced atomically) and `progress.step`, the last step done, an 8-byte counter in
a shared memory map. Writing it costs one store to memory per step, yet it survives a
`kill -9` (the page belongs to the kernel), so after a restart the new attempt compares it
with the checkpoint it resumed from, which gives the steps redone.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import mmap
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from trainyard.util.attempts import torchrun_restarts
from trainyard.util.files import write_text_atomic

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75
_NO_STEP = -1


class StepCounter:
    """One int64 in a file, mapped into memory: updating it never makes a system call."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < 8:
                os.ftruncate(fd, 0)
                os.write(fd, _NO_STEP.to_bytes(8, "little", signed=True))
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)  # the mapping keeps the file
        self._value = memoryview(self._map).cast("q")

    @property
    def value(self) -> int | None:
        return None if self._value[0] == _NO_STEP else self._value[0]

    @value.setter
    def value(self, step: int) -> None:
        self._value[0] = step


def last_step(folder: Path) -> int | None:
    """The last step rank 0 finished, as its StepCounter in `folder` says (None if none)."""
    try:
        data = (folder / "progress.step").read_bytes()[:8]
    except OSError:
        return None
    step = int.from_bytes(data, "little", signed=True) if len(data) == 8 else _NO_STEP
    return None if step == _NO_STEP else step


def recorded_resumes(folder: Path) -> list[dict[str, Any]]:
    """The resumes rank 0's AttemptLog in `folder` recorded ([] if none could be read)."""
    try:
        return json.loads((folder / "progress.json").read_text())["resumes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


class AttemptLog:
    """Rank 0's account of a training job's attempts, in the staging folder each attempt
    finds again: the resumes, the last step taken, and when the launch's first step was."""

    def __init__(self, folder: Path, launch_began: bool = True):
        """`launch_began`: this attempt is a launch's first (a new command's job), not a
        restart within one, whose first step is not the job's."""
        self.path = folder / "progress.json"
        self.data: dict[str, Any] = {"resumes": []}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                log.warning("ignoring unreadable %s", self.path)
        if launch_began:
            self.data.pop("first_step_at", None)
        self.counter = StepCounter(folder / "progress.step")

    @property
    def first_step_at(self) -> float | None:
        """Unix time this launch's first update finished, in whichever attempt it was."""
        return self.data.get("first_step_at")

    @property
    def resumes(self) -> list[dict[str, Any]]:
        return self.data["resumes"]

    def resumed(
        self, attempt: int, from_step: int, checkpoint: str, regrouped: bool, **details: Any
    ) -> dict[str, Any]:
        """Record a resume; the steps past `from_step` that an earlier attempt had done are
        redone. `regrouped`: node 0's agent restarted the workers for a node that joined or
        left (trainyard.runtime.hosts), which torchrun's restart count misses. `details`:
        what else the entry says (the world size before and after)."""
        last = self.counter.value
        event = {
            "attempt": attempt,
            "from_step": from_step,
            "checkpoint": checkpoint,
            "last_step_before": last,
            "steps_redone": max(0, last - from_step) if last is not None else 0,
            "resumed_at": None,  # set when the first step after the resume is done
            "after": _restarted_after(attempt, regrouped, details),
            **details,
        }
        self.resumes.append(event)
        self._write()
        return event

    def step(self, step: int) -> None:
        self.counter.value = step
        first = self.data.get("first_step_at") is None
        resumed = bool(self.resumes) and self.resumes[-1]["resumed_at"] is None
        if first or resumed:  # an attempt's first step: one write for both
            now = time.time()
            self.data.setdefault("first_step_at", now)
            if resumed:
                self.resumes[-1]["resumed_at"] = now
            self._write()

    def _write(self) -> None:
        write_text_atomic(self.path, json.dumps(self.data))


def _restarted_after(attempt: int, regrouped: bool, details: dict[str, Any]) -> str | None:
    """The restart that began this attempt: a node that joined an elastic run (node 0's
    agent restarts the group to take it in), one that left it (its host lost: the others
    went on without it), one replaced by another, a lost agent (the first attempt of a relaunched torchrun), a failed
    worker (torchrun's restart), or none (a new launch)."""
    if attempt == 0 and not regrouped:
        return None
    before, after = details.get("world_size_before", 0), details.get("world_size_after", 0)
    if after != before:
        return "node joined" if after > before else "node left"
    if regrouped:  # as many nodes as before, another among them
        return "node replaced"
    return "agent lost" if torchrun_restarts() == 0 else "worker failed"


class NullAttemptLog:
    """What ranks other than 0 hold."""

    resumes: list[dict[str, Any]] = []
    first_step_at: float | None = None

    def resumed(
        self, attempt: int, from_step: int, checkpoint: str, regrouped: bool, **details: Any
    ) -> dict[str, Any]:
        return {}

    def step(self, step: int) -> None:
        pass


class Watchdog:
    """Ends this worker when it makes no progress for `timeout_s`, instead of hanging forever.

    It dumps every thread's stack (where it hung) and writes torchrun's error file, so the
    failure names the rank and the reason; torchrun then restarts or fails the job.
    """

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fail(idle)

    def _fail(self, idle: float) -> None:
        message = (
            f"rank {self.rank} made no training progress for {idle:.0f}s "
            f"(train.hang_timeout_s={self.timeout_s:g}); stopping it instead of hanging"
        )
        log.error(message)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _write_error_file(message)
        os._exit(HANG_EXIT_CODE)


def _write_error_file(message: str) -> None:
    """The format torchrun's @record writes, so the launcher shows this rank's reason."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stacks = "".join(
        f"Thread {ident}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
    # torchrun shows py_callstack as the traceback: end it with the reason, like Python does.
    reason = f"WorkerHung: {message}"
    body = {
        "message": {
            "message": reason,
            "extraInfo": {"py_callstack": f"{stacks}{reason}", "timestamp": str(int(time.time()))},
        }
    }
    Path(path).write_text(json.dumps(body))


def peak_rss_mb() -> float:
    """This process's resident-memory high-water mark (VmHWM), in MB. Unlike ru_maxrss it
    starts at this process's own start: a forked child does not inherit its parent's."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):  # noqa: SIM115
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource  # not Linux: the nearest measure there is

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
