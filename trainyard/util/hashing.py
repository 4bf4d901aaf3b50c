"""Content hashes of files: read back in blocks (checkpoint files can be large), or taken
as the file is written."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class HashingWriter:
    """A file that hashes what is written to it as it passes, so it need not be read back
    to be hashed. Only for writers that never seek (torch.save's zip is written in order):
    then what passed is the file."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        self.digest.update(data)  # releases the GIL for large blocks, as the write does
        self.size += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()
