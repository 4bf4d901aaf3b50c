"""What a sweep checks before its first trial: every bound and choice of the space against
the data and the model, and how many trials fit on the machine at once."""

from __future__ import annotations

import os
from pathlib import Path

from trainyard.config import TrainyardConfig
from trainyard.errors import ConfigError, TrainyardError
from trainyard.models.registry import check_model_builds
from trainyard.project import ProjectPaths
from trainyard.runs.preflight import (
    PreflightReport,
    check_batch_fits_shard,
    check_task,
    preflight,
)
from trainyard.sweeps.space import extreme_configs
from trainyard.sweeps.study import check_reachable, storage_url


def preflight_sweep(config: TrainyardConfig, root: Path) -> PreflightReport:
    """The sweep's own settings through the run preflight, then each parameter's bounds and
    choices through the checks a value can fail (settings alone were validated already)."""
    # A folder is refused here, and a database server that cannot be reached.
    check_reachable(storage_url(config.sweep, ProjectPaths(root), "preflight"))
    report = preflight(config, root)
    for key, value, trial in extreme_configs(config):
        try:
            check_task(trial)
            check_batch_fits_shard(trial, report.rows)
            check_model_builds(trial.model, report.spec)
        except TrainyardError as exc:
            raise ConfigError(f"sweep.space.{key}: a trial could get {value!r}: {exc}") from None
    return report


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def on_gpu(config: TrainyardConfig) -> bool:
    if config.train.device != "auto":
        return config.train.device == "cuda"
    import torch

    return torch.cuda.is_available()


def trial_slots(config: TrainyardConfig) -> int:
    """Trials that run at once: running trials x workers x threads never exceed the cores
    given to the sweep; on GPUs, trials x workers never exceed the GPUs (`train.gpus`,
    default all), one GPU per worker, so that no two trials share one."""
    sweep, train = config.sweep, config.train
    if on_gpu(config):
        gpus = visible_gpus(config)
        fits = len(gpus) // train.workers
        wanted = sweep.max_concurrent_trials or max(1, fits)
        if wanted > fits:
            raise ConfigError(
                f"sweep.max_concurrent_trials={wanted} x train.workers={train.workers} needs "
                f"{wanted * train.workers} GPUs (one per worker, none shared between trials), "
                f"and the sweep has {len(gpus)}; lower one of them (or list more in train.gpus)"
            )
        return wanted
    per_trial = train.workers * train.threads_per_worker
    cores = sweep.cores or available_cores()
    fits = max(1, cores // per_trial)
    wanted = sweep.max_concurrent_trials or fits
    if wanted > fits:
        raise ConfigError(
            f"sweep.max_concurrent_trials={wanted} x train.workers={train.workers} x "
            f"train.threads_per_worker={train.threads_per_worker} needs {wanted * per_trial} "
            f"cores, and the sweep has {cores}; lower one of them (or set sweep.cores)"
        )
    return wanted


def visible_gpus(config: TrainyardConfig) -> list[int]:
    if config.train.gpus is not None:
        return list(config.train.gpus)
    import torch

    return list(range(torch.cuda.device_count()))


def slot_gpus(config: TrainyardConfig, slots: int) -> list[list[int] | None]:
    """Each trial slot's own GPUs, train.workers of them, disjoint (None on CPUs): a trial
    runs on its slot's, which no other running trial has."""
    if not on_gpu(config):
        return [None] * slots
    gpus, workers = visible_gpus(config), config.train.workers
    return [gpus[slot * workers : (slot + 1) * workers] for slot in range(slots)]
