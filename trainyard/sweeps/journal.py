"""A sweep's Optuna journal file: written so that a failed write leaves nothing behind, read
without ever creating or changing it.

Optuna appends each operation as one JSON line. A write cut short (a full disk, a killed
process) leaves half a line at the end. Optuna's reader skips such a tail, but the next
append glues a new record onto it, and from then on every reader refuses the file. So a
writer here puts the file back to its size when a write fails, never appends after a torn
tail, and a sweep that opens its journal for writing first repairs it (a torn tail cut off, a
record glued onto a torn one by an older writer split back), keeping a copy of the file as
it was."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from trainyard.errors import TrainyardError

_RECORD_START = b'{"op_code"'  # how every record Optuna writes begins


class JournalError(TrainyardError):
    """A sweep's journal cannot be written (a full disk, a torn tail) or read."""


class SweepJournal(JournalFileBackend):
    """Optuna's journal file, with writes that are whole or absent: a failed write (ENOSPC,
    a quota) truncates the file back to its size before it, under Optuna's own lock."""

    def __init__(self, path: str):
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            super().__init__(path, JournalFileSymlinkLock(path))
        except OSError as exc:
            raise JournalError(f"sweep journal {path}: cannot be created: {_reason(exc)}") from None

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        try:
            with _locked(self._file_path):
                _append_whole(self._file_path, data)
        except OSError as exc:
            raise JournalError(
                f"sweep journal {self._file_path}: cannot be written: {_reason(exc)}; "
                "nothing half-written was kept"
            ) from None


class ReadOnlyJournal(JournalFileBackend):
    """Optuna's journal reader alone: no file is created (Optuna's backend creates a missing
    one), no lock is taken, and every write is refused."""

    def __init__(self, path: str):  # Optuna's __init__ is skipped: it creates the file
        if not Path(path).exists():
            raise JournalError(f"journal {path} is gone")
        if not Path(path).is_file():  # a FIFO or a device would block or never end
            raise JournalError(f"journal {path} is not a regular file")
        self._file_path = path
        self._log_number_offset = {0: 0}

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise JournalError(f"journal {self._file_path} is open read-only")


def _append_whole(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            raise JournalError(
                f"sweep journal {path} ends in half a record (a write was cut short); "
                "nothing was appended after it. Resuming the sweep (`trainyard sweep run "
                "--sweep-id ID`) trims it and keeps a copy"
            )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)  # needs no space: the file is as it was before the write
            raise
    finally:
        os.close(fd)


def repair_journal(path: Path) -> Path | None:
    """Cuts a torn last record off the journal at `path`, and takes back each record that an
    older writer appended after a torn one (the line that joined them is what made every
    reader refuse the file), after copying the file as it was to `<name>.torn-<UTC time>`;
    returns the copy (None when the journal was whole). The torn records themselves were
    never read by anyone: the writer saw its write fail, and readers skip such a line. Done
    under Optuna's lock, so a record being written by a live process is never taken for torn.
    No room for the copy: refused, the journal untouched."""
    if not path.is_file():
        return None
    with _locked(str(path)):
        data = path.read_bytes()
        whole = _whole_records(data, path)
        if whole == data:
            return None
        copy = _keep_copy(path)
        if data.startswith(whole):  # only a tail to cut: in place, needing no space
            with open(path, "r+b") as journal:
                journal.truncate(len(whole))
                os.fsync(journal.fileno())
        else:
            _replace(path, whole)
    return copy


def _whole_records(data: bytes, path: Path) -> bytes:
    kept = []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.endswith(b"\n"):
            break  # the torn tail
        start = 0 if _parses(line) else line.rfind(_RECORD_START)
        if start < 0 or not _parses(line[start:]):
            raise JournalError(
                f"sweep journal {path}: line {number} is damaged in a way that cannot be "
                "repaired (not a record cut short); restore the file from a backup"
            )
        kept.append(line[start:])
    return b"".join(kept)


def _parses(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _keep_copy(path: Path) -> Path:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    copy = path.with_name(f"{path.name}.torn-{stamp}")
    try:
        shutil.copyfile(path, copy)
    except OSError as exc:
        with suppress(OSError):
            copy.unlink()
        raise JournalError(
            f"sweep journal {path} holds a record cut short and a copy of it cannot be "
            f"kept ({_reason(exc)}); free space and run the same command again"
        ) from None
    return copy


def _replace(path: Path, data: bytes) -> None:
    fresh = path.with_name(f"{path.name}.repairing")
    try:
        with open(fresh, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(fresh, path)
    except OSError as exc:
        with suppress(OSError):
            fresh.unlink()
        raise JournalError(f"sweep journal {path} cannot be repaired: {_reason(exc)}") from None


class _locked:
    """Optuna's own journal lock (a symlink beside the file), as its writers take it."""

    def __init__(self, path: str):
        self._lock = JournalFileSymlinkLock(path)

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__
