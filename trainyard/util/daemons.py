"""Servers a project keeps running between commands (its store, its Prefect API): started
detached, so they outlive the command and a Ctrl-C sent to its terminal never reaches them."""

from __future__ import annotations

import os
import socket
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


def port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host`, as the server will bind it."""
    with socket.socket() as sock:
        # As the servers bind (Go and uvicorn set SO_REUSEADDR): connections of a stopped
        # server left in TIME_WAIT must not make its port look taken, or a restart moves the
        # endpoint away from clients that still use it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
