"""Logging with the rank in every line. Configured by entry points, never at import."""

from __future__ import annotations

import logging
import os
import sys


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
