"""Large uploads from a process of their own.

An upload through s3fs runs about 0.5 s of Python per 100 MB (aiohttp's send loop,
botocore's payload hash and checksum), and on a thread of the training process that
Python takes the GIL from the training thread: steps of 5 ms were 1.2-1.5x slower while
100 MB uploaded beside them, and 1.01-1.04x while the same upload ran in another process
(2-core VM, 2026-11-25). So rank 0's checkpoint writer and each rank's shard uploader hand
files of SENDER_MIN_BYTES and more to one child process, started at the first such file
and kept for the run.

The child reaches the store through the settings in its environment (never its command
line), reads one `SendRequest` per line on stdin, answers one `SendReply` per line on
stdout, and exits at the end of its input: when its owner closes it, or dies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

from botocore.exceptions import BotoCoreError
from pydantic import BaseModel, ConfigDict

from trainyard.errors import StoreError, first_line
from trainyard.storage.store import Store, StoreSettings

# Below this, an upload's Python work is a few ms: not worth a process.
SENDER_MIN_BYTES = 16 << 20


class SendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    local: str
    key: str


class SendReply(BaseModel):
    """`error`: what kind of failure, so the owner retries what is worth retrying."""

    model_config = ConfigDict(extra="forbid")
    error: Literal["permission", "not_found", "unreachable", "other"] | None = None
    message: str = ""


class FileSender:
    """Uploads files to `store`: `send` hands those of SENDER_MIN_BYTES and more to a child
    process (`put_file`), one upload at a time, and puts smaller ones itself. Errors arrive
    as the exceptions an in-process upload raises (PermissionError, FileNotFoundError,
    OSError for a store that cannot be reached), so callers retry alike; a child that died
    is an OSError, and the next upload starts a new one. `close` ends the child."""

    def __init__(self, store: Store):
        self.store = store
        self._process: subprocess.Popen[str] | None = None
        self._answered = False  # whether the current child has replied at least once
        self._closed = False
        self._lock = threading.Lock()

    def send(self, local: Path, key: str) -> None:
        if local.stat().st_size >= SENDER_MIN_BYTES:
            self.put_file(local, key)  # its Python work off this process's GIL
        else:
            self.store.put_file(local, key)

    def put_file(self, local: Path, key: str) -> None:
        """Upload from the child process, whatever the size."""
        request = SendRequest(local=str(local), key=key).model_dump_json()
        with self._lock:
            if self._closed:  # an uploader thread outliving close() starts no new child
                raise OSError("the upload process was closed")
            process = self._process if self._process and self._process.poll() is None else None
            process = process or self._start()
            try:
                process.stdin.write(request + "\n")  # type: ignore[union-attr]
                process.stdin.flush()  # type: ignore[union-attr]
                line = process.stdout.readline()  # type: ignore[union-attr]
            except (OSError, ValueError):  # its pipes broken, or closed by close()
                line = ""
            if not line:
                raise self._exited(process.wait())
            self._answered = True
        reply = SendReply.model_validate_json(line)
        if reply.error is not None:
            raise _ERRORS[reply.error](reply.message)

    def close(self, timeout_s: float = 10) -> None:
        """End the child; one still uploading after `timeout_s` (a hung store) is killed.
        Takes no lock: an upload that hangs cannot hold it up."""
        self._closed = True
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.stdin.close()  # type: ignore[union-attr]
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _start(self) -> subprocess.Popen[str]:
        self._answered = False
        self._process = subprocess.Popen(
            [sys.executable, "-m", "trainyard.storage.sender"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.store.settings.worker_env()},
        )
        return self._process

    def _exited(self, code: int) -> Exception:
        """A child killed (by a signal, e.g. the OOM killer) is worth another: an OSError,
        which the writer retries. One that exited by itself before any reply cannot start
        here (its traceback is in the log above): retrying would only fail again."""
        if code >= 0 and not self._answered:
            return StoreError(f"the upload process exited (code {code}) before its first reply")
        return OSError(f"the upload process exited (code {code}) during the upload")


_ERRORS: dict[str, type[Exception]] = {
    "permission": PermissionError,
    "not_found": FileNotFoundError,
    "unreachable": OSError,
    "other": StoreError,
}


def _kind(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    if isinstance(exc, OSError | BotoCoreError | TimeoutError):
        return "unreachable"
    return "other"


def serve() -> int:
    replies, sys.stdout = sys.stdout, sys.stderr  # stdout carries replies, nothing else
    store = Store(StoreSettings.from_worker_env())
    for line in sys.stdin:
        request = SendRequest.model_validate_json(line)
        try:
            store.put_file(Path(request.local), request.key)
            reply = SendReply()
        except Exception as exc:
            reply = SendReply(error=_kind(exc), message=first_line(exc))
        replies.write(reply.model_dump_json() + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
