from __future__ import annotations

from prefect import task

from trainyard.config import TrainyardConfig
from trainyard.project import ProjectPaths
from trainyard.runs.record import RunRecord, save_record
from trainyard.storage import Store, connect_shared


def open_store(config: TrainyardConfig, paths: ProjectPaths) -> Store:
    """Each task connects itself (credentials never pass through Prefect parameters or
    results), to the process's shared Store: see `trainyard.storage.connect_shared`."""
    return connect_shared(config.storage, paths)


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
