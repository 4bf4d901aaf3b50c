"""Getting files into a store that may be down: a background queue that works through
staged items oldest first, retrying transient errors with backoff, and failing at once on
what waiting cannot fix (a refusal, a full local disk)."""

from __future__ import annotations

import errno
import functools
import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError

from trainyard.config import CheckpointConfig
from trainyard.errors import CheckpointError, first_line

log = logging.getLogger(__name__)

DISK_FULL = "disk full"


class UploadQueue:
    """One background thread that works through staged items (each with a `step`) oldest
    first, retrying transient store errors with backoff for as long as the store is down.
    Subclasses set their own state, then call `super().__init__`, and say what processing
    an item means (`_process`, returning None when stopped) and what follows it."""

    def __init__(self, config: CheckpointConfig, thread_name: str):
        self.config = config
        self._pending: list[Any] = []  # oldest first; [0] may be in progress
        self._failure: str | None = None
        self._closing = False
        self._stop = threading.Event()  # the end: stop retrying
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _process(self, item: Any) -> Any:
        raise NotImplementedError

    def _describe(self, item: Any) -> str:
        return f"upload of step {item.step}"

    def _record(self, item: Any, result: Any) -> None:
        """Under the lock, once `item` is done and off the queue."""

    def _after(self, item: Any, result: Any) -> None:
        """Outside the lock, once `item` is done."""

    def _before_first(self) -> None:
        pass

    def _run(self) -> None:
        self._before_first()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                item = self._pending[0]
            what = self._describe(item)
            try:
                result = retry_transient(
                    what, functools.partial(self._process, item), self.config, self._stop
                )
                if result is None:  # stopped while the store was still unreachable
                    return
                with self._cond:
                    self._pending.pop(0)
                    self._record(item, result)
                    self._cond.notify_all()
                self._after(item, result)
            except Exception as exc:  # not transient: the run must fail, clearly, not hang
                full = str(exc).startswith(DISK_FULL)  # says all: nothing was uploaded
                if full:
                    log.error("%s", exc)
                else:
                    log.error("%s failed", what, exc_info=True)
                with self._cond:
                    self._failure = self._failure or (str(exc) if full else f"{what} failed: {exc}")
                    self._cond.notify_all()
                return

    def _drain(self, timeout_s: float) -> tuple[bool, list[int], str | None]:
        """Wait for the backlog, then stop: (all done, steps left, the failure if any)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._pending or self._failure, timeout_s)
            left = [item.step for item in self._pending]
        self._stop.set()
        self._thread.join(timeout=30)
        with self._cond:  # after the join: what followed the last commit may have failed
            return bool(done), left, self._failure


def retry_transient(
    what: str,
    action: Callable[[], Any],
    config: CheckpointConfig,
    stop: threading.Event | None = None,
) -> Any:
    """Run `action`, retrying transient store errors with exponential backoff + jitter.
    Returns None if `stop` is set before it succeeded; other errors propagate."""
    stop = stop or threading.Event()
    delay = config.upload_backoff_s
    attempt = 0
    while True:
        try:
            return action()
        except Exception as exc:
            if not _transient(exc):
                raise
            attempt += 1
            wait = min(delay, config.upload_backoff_max_s) * random.uniform(0.5, 1.5)
            log.warning(
                "%s failed (attempt %d: %s); retrying in %.1fs",
                what,
                attempt,
                first_line(exc),
                wait,
            )
            if stop.wait(wait):
                return None
            delay *= 2


def _transient(exc: BaseException) -> bool:
    """Errors worth retrying: the store unreachable or failing, not refused or misused."""
    if isinstance(exc, PermissionError | FileNotFoundError | CheckpointError) or disk_full(exc):
        return False  # a full local disk does not empty itself while we wait
    return isinstance(exc, OSError | BotoCoreError | TimeoutError)


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` comes of a full disk (or quota). torch.save reports a failed write as a
    RuntimeError ("unexpected pos") whose context is the OSError; DCP's CheckpointException
    holds each rank's error in `failures`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(seen, "failures", None)
        if isinstance(failures, dict) and any(disk_full(e) for e, _ in failures.values()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def staging_full(step: int, staging: Path) -> CheckpointError:
    """What a run fails with when its checkpoint cannot be staged for lack of space: at once,
    instead of retrying as if the store were down."""
    return CheckpointError(
        f"{DISK_FULL}: checkpoint step {step} cannot be staged in {staging} (no space left "
        "on its disk); free space there, then run again with the same --run-id to resume"
    )
