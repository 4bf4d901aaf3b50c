"""Resolving and reaching the artifact store."""

from __future__ import annotations

import os
import time

from trainyard.config import StorageConfig
from trainyard.errors import StoreError
from trainyard.project import ProjectPaths
from trainyard.storage.embedded import EmbeddedS3
from trainyard.storage.store import ENDPOINT_ENV, Store, StoreSettings
from trainyard.util.recent import Recent

__all__ = ["Store", "StoreSettings", "connect", "connect_shared", "resolve_settings"]

# A run's process uses one; a test session many, each with its own client.
_connected: Recent[tuple[int, StoreSettings], Store] = Recent(keep=8)


def resolve_settings(
    config: StorageConfig, paths: ProjectPaths, serve_on: str | None = None
) -> StoreSettings:
    """Where the store is: TRAINYARD_S3_ENDPOINT overrides storage.endpoint.

    'embedded' starts the local SeaweedFS server if needed (on `serve_on`, an address of
    this machine, when given; else loopback) and uses its credentials; 'aws' or a URL (as
    on a machine reaching another's store) uses the usual AWS credential variables.
    """
    endpoint = _endpoint(config)
    if serve_on is not None and endpoint != "embedded":
        raise StoreError(
            f"this project's store is {endpoint} (TRAINYARD_S3_ENDPOINT or storage.endpoint), "
            "not the embedded one that --host serves; unset TRAINYARD_S3_ENDPOINT to serve it"
        )
    if endpoint == "embedded":
        server = EmbeddedS3(paths.s3_server)
        state = server.up(serve_on)
        creds = server.credentials()
        return StoreSettings(
            config.bucket, config.prefix, state.endpoint, creds.access_key, creds.secret_key
        )
    return StoreSettings(
        bucket=config.bucket,
        prefix=config.prefix,
        endpoint_url=None if endpoint == "aws" else endpoint,
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
    )


def _endpoint(config: StorageConfig) -> str:
    return os.environ.get(ENDPOINT_ENV) or config.endpoint


def connect(config: StorageConfig, paths: ProjectPaths, serve_on: str | None = None) -> Store:
    """A checked store: reachable, credentials accepted, bucket present (created if embedded;
    `serve_on` as resolve_settings')."""
    settings = resolve_settings(config, paths, serve_on)
    store = Store(settings)
    if _endpoint(config) == "embedded":
        _create_bucket(store)
    store.check()
    return store


def _create_bucket(store: Store, timeout_s: float = 30) -> None:
    """The server answers before its filer is ready; retry briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not store.fs.exists(store.settings.bucket):
                store.fs.mkdir(store.settings.bucket)
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise StoreError(
                    f"embedded store at {store.settings.endpoint_url} is not ready ({exc})"
                ) from None
            time.sleep(0.5)


def connect_shared(config: StorageConfig, paths: ProjectPaths) -> Store:
    """`connect`, sharing one Store per store within a process: the CLI that checked the
    store and the flow's tasks after it (credentials never pass through Prefect parameters
    or results, so each task connects itself).

    A new Store cost ~0.1 s (its client and first requests). A shared one is checked again
    with one request (~4 ms), as the store may have been stopped, restarted or wiped since;
    a failed check connects anew (which recreates an embedded store's bucket). The process
    id is in the key: a forked child must not use its parent's client."""
    # Resolving starts the embedded server if it is down; a restart on other ports is
    # another key, so a Store never points at an old endpoint.
    key = (os.getpid(), resolve_settings(config, paths))
    store = _connected.get(key)
    if store is not None:
        try:
            store.check()
            return store
        except StoreError:
            pass
    store = connect(config, paths)
    _connected.put((key[0], store.settings), store)
    return store
