"""Experiment tracking: one Comet experiment per rank, so a run shows one curve per worker.

Without COMET_API_KEY, Comet runs offline and writes a zip per rank under the offline folder
(upload later with `comet upload FILE.zip`). With a key it logs online; when the server is
unreachable Comet silently saves nothing, so we detect that and fall back to offline.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from trainyard.config import TrackingConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExperimentRef:
    rank: int
    mode: str  # "online", "offline" or "none"
    key: str | None = None
    archive: str | None = None  # offline zip path
    url: str | None = None


class Tracker(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def end(self) -> ExperimentRef: ...


class NullTracker:
    def __init__(self, rank: int):
        self.rank = rank

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def end(self) -> ExperimentRef:
        return ExperimentRef(rank=self.rank, mode="none")


class CometTracker:
    def __init__(self, config: TrackingConfig, run_id: str, rank: int, offline_dir: Path):
        # Comet patches ML libraries on import unless told not to; we log explicitly.
        os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
        import comet_ml

        self.rank = rank
        self.offline_dir = offline_dir
        offline_dir.mkdir(parents=True, exist_ok=True)
        settings = comet_ml.ExperimentConfig(
            name=f"{run_id}-rank{rank}",
            tags=[f"run:{run_id}", f"rank:{rank}", "trainyard"],
            offline_directory=str(offline_dir),
            auto_metric_logging=False,
            auto_param_logging=False,
            auto_output_logging=False,
            log_code=False,
            log_git_metadata=False,
            log_git_patch=False,
            log_env_details=False,
            parse_args=False,
            display_summary_level=0,
        )
        online = bool(os.environ.get("COMET_API_KEY"))
        common = {
            "project_name": config.project,
            "workspace": config.workspace,
            "experiment_config": settings,
        }
        experiment = comet_ml.start(online=online, **common)
        if online and not experiment.alive:
            log.warning("Comet server unreachable; logging offline to %s instead", offline_dir)
            experiment = comet_ml.start(online=False, **common)
            online = False
        self.mode = "online" if online else "offline"
        self.experiment = experiment
        experiment.log_other("trainyard_run_id", run_id)
        experiment.log_other("rank", rank)

    def log_params(self, params: dict[str, Any]) -> None:
        self.experiment.log_parameters(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.experiment.log_metrics(metrics, step=step)

    def end(self) -> ExperimentRef:
        key = self.experiment.get_key()
        url = getattr(self.experiment, "url", None) if self.mode == "online" else None
        self.experiment.end()
        archive = None
        if self.mode == "offline":
            archives = sorted(self.offline_dir.glob(f"{key}*.zip"))
            archive = str(archives[-1]) if archives else None
        return ExperimentRef(rank=self.rank, mode=self.mode, key=key, archive=archive, url=url)


def _comet_reachable(timeout_s: float = 3.0) -> bool:
    url = urlsplit(os.environ.get("COMET_URL_OVERRIDE") or "https://www.comet.com/clientlib/")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_tracker(config: TrackingConfig, run_id: str, rank: int, offline_dir: Path) -> Tracker:
    if config.backend == "none":
        return NullTracker(rank)
    return CometTracker(config, run_id, rank, offline_dir)
