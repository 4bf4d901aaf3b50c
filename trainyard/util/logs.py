"""Logging with the rank in every line. Configured by entry points, never at import."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    world = os.environ.get("WORLD_SIZE", "1")
    handler = logging.StreamHandler(sys.stdout)
    # Milliseconds: start-up and shutdown stages are read off these lines (benchmarks/end_to_end).
    line = f"%(asctime)s.%(msecs)03d [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(line, "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # A Python warning is a WARNING line with the rank, which the console shows from any
    # rank (trainyard.cli.console), not an untagged line on stderr.
    logging.captureWarnings(True)


RANK_LOG = "rank-{rank}.log"  # in the run's logs folder (ProjectPaths.run_logs)
# Every line of node {node}'s torchrun job (its agent's own too), beside the ranks' logs.
NODE_LOG = "node-{node}.log"


@contextlib.contextmanager
def rank_log(folder: Path, rank: int) -> Iterator[Path]:
    """While the block runs, every line this process logs is also appended to
    `folder/rank-<rank>.log` (owner-only, like the run's tracebacks beside it), with the
    date: the console shows rank 0's lines only (trainyard.cli.console)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RANK_LOG.format(rank=rank)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    handler = logging.FileHandler(path, encoding="utf-8")
    world = os.environ.get("WORLD_SIZE", "1")
    line = f"%(asctime)s.%(msecs)03d [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(line, "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
