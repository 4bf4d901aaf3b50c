"""The Prefect API a `trainyard` command reports to when no PREFECT_API_URL is set.

It is Prefect's own temporary server, started in a session of its own: a Ctrl-C sent to
the terminal's process group must not kill the API while the flow still has to report
how it ended (with the server gone, Prefect retried it for minutes). Prefect stops it at
interpreter exit, after its own services have flushed; the guardian stops it if the
command is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings


class DetachedServer(SubprocessASGIServer):
    def _run_uvicorn_command(self) -> subprocess.Popen:
        # Prefect's own command line (SubprocessASGIServer), in a new session.
        return subprocess.Popen(
            args=[
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",
                str(prefect.__module_path__.parent),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
                # Our own clients may still hold connections when it is stopped at exit;
                # uvicorn would wait for them until Prefect kills it 5 s later.
                "--timeout-graceful-shutdown",
                "1",
            ],
            env={
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
                **get_current_settings().to_environment_variables(exclude_unset=True),
            },
            start_new_session=True,
        )


@contextmanager
def prefect_api() -> Iterator[str]:
    """The API URL flows in this block report to: the configured one, or a detached
    temporary server."""
    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    server = DetachedServer()
    server.start()
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield server.api_url
