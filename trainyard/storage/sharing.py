"""What another machine needs to reach this machine's embedded store: its environment lines.

They hold the store's secret key. They are made for `trainyard storage env`, which prints
them on the user's explicit request; nothing here logs them or writes them anywhere.
"""

from __future__ import annotations

import shlex

from trainyard.errors import StoreError
from trainyard.storage.embedded import HOST, EmbeddedS3
from trainyard.storage.store import BUCKET_ENV, PREFIX_ENV, StoreSettings


def other_machine_env(server: EmbeddedS3) -> dict[str, str]:
    """The running store's endpoint and key pair, under the names a worker reads them by
    (StoreSettings.worker_env); the bucket and prefix stay each project's own settings."""
    state = server.status()
    if state is None:
        raise StoreError(
            "the embedded store is not running; start it where other machines reach it: "
            "`trainyard storage up --host ADDR`"
        )
    creds = server.credentials()
    settings = StoreSettings("", "", state.endpoint, creds.access_key, creds.secret_key)
    env = settings.worker_env()
    return {name: value for name, value in env.items() if name not in (BUCKET_ENV, PREFIX_ENV)}


def export_lines(env: dict[str, str]) -> list[str]:
    """`export NAME=value` lines a POSIX shell reads back as they were."""
    return [f"export {name}={shlex.quote(value)}" for name, value in env.items()]


def loopback_only(server: EmbeddedS3) -> bool:
    """Whether the running store serves this machine alone."""
    state = server.status()
    return state is not None and state.host == HOST
