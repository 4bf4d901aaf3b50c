"""Experiment tracking: one Comet experiment per rank, so a run shows one curve per worker.

Without COMET_API_KEY, Comet runs offline and writes a zip per rank under the offline folder
(upload later with `trainyard tracking upload`). With a key it logs online; a server
unreachable at the start gets an offline experiment instead, and one that goes away during
the run leaves every point in an offline archive in the same folder (Comet's fallback).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainyard.config import TrackingConfig
from trainyard.util.comet import quiet_comet

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
    def log_others(self, others: dict[str, Any]) -> None: ...
    def end(self) -> ExperimentRef: ...


class NullTracker:
    def __init__(self, rank: int):
        self.rank = rank

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_others(self, others: dict[str, Any]) -> None:
        pass

    def end(self) -> ExperimentRef:
        return ExperimentRef(rank=self.rank, mode="none")


class CometTracker:
    """One rank's Comet experiment, started on a thread: importing comet_ml and creating the
    experiment take about a second (tens of seconds with a key and no server), which the
    first training steps need not wait for. Calls made before it is ready are queued and
    replayed in order, so the experiment receives every point; `end` waits for the start."""

    def __init__(
        self,
        config: TrackingConfig,
        run_id: str,
        rank: int,
        offline_dir: Path,
        tags: Sequence[str] = (),
    ):
        quiet_comet()
        self.rank = rank
        self.offline_dir = offline_dir
        self.mode = "offline"
        offline_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._experiment: Any = None  # set once the queued calls have reached it
        self._queued: list[Callable[[Any], None]] = []
        self._error: BaseException | None = None
        # A daemon: a worker failing meanwhile must not wait for Comet's start to exit.
        self._starter = threading.Thread(
            target=self._start,
            args=(config, run_id, tuple(tags)),
            name=f"comet-start-{rank}",
            daemon=True,
        )
        self._starter.start()

    def log_params(self, params: dict[str, Any]) -> None:
        self._call(lambda experiment: experiment.log_parameters(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call(lambda experiment: experiment.log_metrics(metrics, step=step))

    def log_others(self, others: dict[str, Any]) -> None:
        self._call(lambda experiment: experiment.log_others(others))

    def end(self) -> ExperimentRef:
        self._starter.join()
        if self._error is not None:
            raise self._error
        experiment = self._experiment
        key = experiment.get_key()
        url = getattr(experiment, "url", None) if self.mode == "online" else None
        if self.mode == "offline":
            _end_promptly(experiment)
        experiment.end()
        archive = None
        if self.mode == "online":
            archive = _fallback_archive(experiment)
            if archive is not None:
                self.mode = "offline"
                log.warning(
                    "rank %d: the Comet server went away during the run; every point is in "
                    "%s (upload it with `trainyard tracking upload`)",
                    self.rank,
                    archive,
                )
        else:
            archives = sorted(self.offline_dir.glob(f"{key}*.zip"))
            archive = str(archives[-1]) if archives else None
        return ExperimentRef(rank=self.rank, mode=self.mode, key=key, archive=archive, url=url)

    def _call(self, call: Callable[[Any], None]) -> None:
        if self._error is not None:
            raise self._error  # Comet failed to start: fail the run, as a synchronous start did
        with self._lock:
            experiment = self._experiment
            if experiment is None:
                self._queued.append(call)
                return
        call(experiment)

    def _start(self, config: TrackingConfig, run_id: str, tags: tuple[str, ...]) -> None:
        try:
            experiment, online = _start_experiment(
                config, run_id, self.rank, self.offline_dir, tags
            )
            self.mode = "online" if online else "offline"
            self._hand_over(experiment)
        except BaseException as exc:  # raised in the training thread at its next call
            self._error = exc

    def _hand_over(self, experiment: Any) -> None:
        """Replay the queued calls in order; the experiment becomes visible to new calls
        only when none is left, so no call overtakes an earlier one."""
        while True:
            with self._lock:
                calls, self._queued = self._queued, []
                if not calls:
                    self._experiment = experiment
                    return
            for call in calls:
                call(experiment)


def _start_experiment(
    config: TrackingConfig,
    run_id: str,
    rank: int,
    offline_dir: Path,
    tags: tuple[str, ...] = (),
) -> tuple[Any, bool]:
    """(experiment, online): online with COMET_API_KEY, offline without it or when the
    server cannot be reached."""
    import comet_ml

    settings = comet_ml.ExperimentConfig(
        name=f"{run_id}-rank{rank}",
        tags=[f"run:{run_id}", f"rank:{rank}", "trainyard", *tags],
        offline_directory=str(offline_dir),
        auto_metric_logging=False,
        auto_param_logging=False,
        auto_output_logging=False,  # type: ignore[arg-type]  # Comet's off switch
        log_code=False,
        log_git_metadata=False,
        log_git_patch=False,
        log_env_details=False,
        parse_args=False,
        display_summary_level=0,
    )
    online = bool(os.environ.get("COMET_API_KEY"))
    common: dict[str, Any] = {
        "project_name": config.project,
        "workspace": config.workspace,
        "experiment_config": settings,
    }
    if online and not _reachable(_comet_address()):
        online = False  # asked anyway, Comet retried for ~30 s with ~15 warnings
        log.warning(_OFFLINE_INSTEAD, offline_dir)
    experiment = comet_ml.start(online=online, **common)
    if online and not experiment.alive:  # it connected but did not answer as a server
        log.warning(_OFFLINE_INSTEAD, offline_dir)
        experiment = comet_ml.start(online=False, **common)
        online = False
    experiment.log_other("trainyard_run_id", run_id)
    experiment.log_other("rank", rank)
    return experiment, online


_OFFLINE_INSTEAD = (
    "Comet server unreachable; logging offline to %s instead (`trainyard tracking upload` "
    "sends it later)"
)
PROBE_TIMEOUT_S = 3.0


def _comet_address() -> str:
    """The URL comet_ml would talk to: COMET_URL_OVERRIDE, else the API key's own, else
    Comet's cloud."""
    from comet_ml.config import get_api_key, get_backend_address, get_config

    config = get_config()
    get_api_key(None, config)  # a key may name its server, which then becomes the default
    return get_backend_address(config)


def _reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `url`'s host (or to the proxy the environment names for
    it) opens within `timeout_s`, name lookup included."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and host and not urllib.request.proxy_bypass(host):
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxied.hostname, proxied.port or 80
    answered, opened = threading.Event(), []

    def connect() -> None:
        try:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout_s):
                opened.append(True)
        finally:
            answered.set()

    # On a thread: a name lookup takes no timeout, and may wait for the resolver's own.
    threading.Thread(target=connect, name="comet-probe", daemon=True).start()
    return answered.wait(timeout_s) and bool(opened)


def _fallback_archive(experiment: Any) -> str | None:
    """The offline archive an online experiment wrote when it lost its server: Comet's
    fallback streamer also writes every message offline, and keeps that archive (in the
    run's offline folder) only when the online stream did not finish."""
    streamer = getattr(experiment, "streamer", None)
    archive = getattr(streamer, "offline_archive_file", None)
    return str(archive) if archive and Path(archive).is_file() else None


def _end_promptly(experiment: Any) -> None:
    """The offline writer thread notices that `end()` wants it to stop only between waits
    of `queue_timeout` (1 s) for a message, so every end() took a second. Waiting 0.05 s at
    a time throughout the run cost each rank ~0.4% of a core (20 wake-ups a second, each
    taking the GIL), so the wait is shortened only now, and one last message wakes the
    writer from the long wait it is in."""
    streamer = getattr(experiment, "streamer", None)
    if streamer is not None and hasattr(streamer, "queue_timeout"):
        streamer.queue_timeout = 0.05
        experiment.log_other("trainyard_ended", True)


def start_tracker(
    config: TrackingConfig, run_id: str, rank: int, offline_dir: Path, tags: Sequence[str] = ()
) -> Tracker:
    """`tags` beyond run:<id>, rank:<n> and trainyard: what groups this run's experiments
    with others in Comet's project view (sweep:<id>, a retrain's)."""
    if config.backend == "none":
        return NullTracker(rank)
    return CometTracker(config, run_id, rank, offline_dir, tags)
