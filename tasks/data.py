from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from tasks.storage import open_store
from trainyard.config import TrainyardConfig
from trainyard.data.split import CachedSplit, prepare_cached_splits
from trainyard.objectives import target_kind
from trainyard.project import ProjectPaths
from trainyard.storage.versioning import DatasetVersion, configure_remote, version_dataset


@task(name="version-dataset", retries=2, retry_delay_seconds=2)
def version_dataset_task(config: TrainyardConfig, paths: ProjectPaths) -> DatasetVersion:
    """`dvc add` + `dvc push` the raw dataset to the store; returns its DVC content hash."""
    configure_remote(paths.root, open_store(config, paths))
    version = version_dataset(paths.root, config.data.path)
    get_run_logger().info(
        "dataset %s is version md5 %s (%d bytes)", version.path, version.dvc_md5, version.size
    )
    return version


@task(name="split-dataset")
def split_dataset_task(
    config: TrainyardConfig, paths: ProjectPaths, dataset_md5: str
) -> CachedSplit:
    """The dvc.yaml `prepare` stage's split, into the run's own content-addressed folder
    (reused when another run already made the same one)."""
    target = target_kind(config.task.name)
    split = prepare_cached_splits(paths, config.data, config.split, dataset_md5, target)
    get_run_logger().info(
        "split %s into %s (split %s)", config.data.path, split.schema.rows, split.key
    )
    return split
