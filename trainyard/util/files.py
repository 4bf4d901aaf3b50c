"""Local files that appear whole or not at all: a reader in another process (a progress bar,
DVC, a browser, the next run) never sees half of one, and a failed write leaves no litter."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed onto `path` if the block succeeds,
    removed if it fails. Named per process and thread, so concurrent writers never share one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, private: bool = False) -> None:
    """`text` (UTF-8) as the whole of `path`; `private`: readable by its owner only (0600)."""
    with replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
