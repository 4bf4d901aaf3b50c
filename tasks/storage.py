from __future__ import annotations

import os
import threading
from collections import OrderedDict

from prefect import task

from trainyard.config import TrainyardConfig
from trainyard.errors import StoreError
from trainyard.project import ProjectPaths
from trainyard.runs import RunRecord, save_record
from trainyard.storage import Store, StoreSettings, connect, resolve_settings

KEEP_STORES = 8  # a flow process uses one; a test session many, each with its own client
_connected: OrderedDict[tuple[int, StoreSettings], Store] = OrderedDict()
_connected_lock = threading.Lock()  # tasks run in threads


def open_store(config: TrainyardConfig, paths: ProjectPaths) -> Store:
    """Each task connects itself: credentials never pass through Prefect parameters or results.

    The tasks of a process share one Store per store: a new one cost ~0.1 s a task (its
    client and first requests). A shared one is checked again with one request (~4 ms), as
    the store may have been stopped, restarted or wiped since; a failed check connects anew
    (which recreates an embedded store's bucket). The process id is in the key: a forked
    child must not use its parent's client."""
    # Resolving starts the embedded server if it is down; a restart on other ports is
    # another key, so a Store never points at an old endpoint.
    key = (os.getpid(), resolve_settings(config.storage, paths))
    with _connected_lock:
        store = _connected.get(key)
    if store is not None:
        try:
            store.check()
            return store
        except StoreError:
            pass
    store = connect(config.storage, paths)
    key = (key[0], store.settings)
    with _connected_lock:
        _connected[key] = store
        _connected.move_to_end(key)
        while len(_connected) > KEEP_STORES:
            _connected.popitem(last=False)
    return store


@task(name="check-store", retries=2, retry_delay_seconds=2)
def check_store(config: TrainyardConfig, paths: ProjectPaths) -> str:
    """Start the embedded store if needed, check access; returns a printable location."""
    return open_store(config, paths).settings.where


@task(name="save-run-record", retries=3, retry_delay_seconds=1)
def save_run_record(
    record: RunRecord,
    config: TrainyardConfig,
    paths: ProjectPaths,
    lease_token: str | None = None,
) -> str:
    """`lease_token`: written only while this flow still owns the run."""
    return save_record(open_store(config, paths), record, lease_token)
