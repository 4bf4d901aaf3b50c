"""Servers a project keeps running between commands (its store, its Prefect API): started
detached, so they outlive the command and a Ctrl-C sent to its terminal never reaches them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def spawn_detached(
    command: list[str], log_file: Path, cwd: Path, env: dict[str, str]
) -> subprocess.Popen:
    """`command` in a session of its own, its output appended to `log_file` (0600), with umask
    077: what it writes (databases, volumes, folders) is the owner's alone."""
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
            env=env,
            umask=0o077,
        )
    finally:
        os.close(out)
