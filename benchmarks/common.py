"""What every benchmark shares: a throw-away project with its own store, the runners for the
trainyard worker and the raw script, and statistics over interleaved repetitions."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from trainyard.runs.record import DatasetInfo

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class BenchProject:
    """A project folder (params, dvc.yaml, the digits split) and an embedded store of its own."""

    root: Path
    store_env: dict[str, str]

    @property
    def processed(self) -> Path:
        return self.root / "data" / "processed"

    def env(self, **extra: str) -> dict[str, str]:
        from trainyard.checkpoint.signing import SIGNING_KEY_ENV

        env = {**os.environ, **self.store_env, **extra}
        env.pop("COMET_API_KEY", None)  # benchmarks never reach Comet's servers
        env["PREFECT_HOME"] = str(self.root / ".trainyard" / "prefect")
        # The bench project's key, for this process's reads of its checkpoints too (its
        # working folder is the repository, which may hold a project key of its own).
        env[SIGNING_KEY_ENV] = str(self.root / ".trainyard" / "signing.key")
        env["PATH"] = f"{BIN}:{env['PATH']}"
        return env


@contextlib.contextmanager
def bench_project() -> Iterator[BenchProject]:
    from trainyard.cli.prefect_server import PrefectServer
    from trainyard.config import load_config
    from trainyard.data.split import prepare_splits
    from trainyard.runs.preflight import preflight

    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        root = Path(tmp) / "project"
        root.mkdir()
        for name in ("params.yaml", "dvc.yaml", ".dvcignore"):
            shutil.copy(REPO / name, root / name)
        shutil.copytree(
            REPO / ".dvc",
            root / ".dvc",
            ignore=shutil.ignore_patterns("config.local", "cache", "tmp"),
        )
        subprocess.run(["git", "init", "-q"], cwd=root, check=True)
        with _embedded_store(root) as store_env:
            config = load_config(root / "params.yaml")
            preflight(config, root)
            prepare_splits(
                config.data, config.split, root / config.data.path, root / "data" / "processed"
            )
            try:
                yield BenchProject(root, store_env)
            finally:  # the Prefect server its commands started, if any
                PrefectServer(root / ".trainyard" / "prefect").down()


@contextlib.contextmanager
def bench_store() -> Iterator[BenchProject]:
    """A folder with an embedded store and nothing else: what checkpoint_cost needs, so it
    runs where there is no DVC or Prefect (a lent GPU machine with many cores, where the
    store does not share the workers' CPU)."""
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        root = Path(tmp) / "project"
        root.mkdir()
        with _embedded_store(root) as store_env:
            yield BenchProject(root, store_env)


@contextlib.contextmanager
def _embedded_store(root: Path) -> Iterator[dict[str, str]]:
    """The project's own SeaweedFS under `root`, with its bucket; yields the workers' store
    settings, and stops the server on the way out."""
    from trainyard.storage import Store, StoreSettings
    from trainyard.storage.embedded import EmbeddedS3

    server = EmbeddedS3(root / ".trainyard" / "s3")
    state = server.up()
    try:
        creds = server.credentials()
        settings = StoreSettings(
            "trainyard", "", state.endpoint, creds.access_key, creds.secret_key
        )
        Store(settings).fs.mkdir("trainyard")
        yield settings.worker_env()
    finally:
        server.down()


def run_trainyard_worker(
    project: BenchProject,
    overrides: list[str],
    run_id: str,
    dataset: DatasetInfo | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The real trainyard worker (`trainyard.engine.worker train` under torchrun), Comet offline and
    checkpoints uploaded to the store, as the pipeline runs it. Returns its training.json.
    `dataset` (a DatasetInfo from `prepare_run_split`) points the workers at that split;
    without it they read data/processed. `env`: more environment for the workers."""
    from trainyard.config import load_config
    from trainyard.engine.jobs import training_key
    from trainyard.runs.record import RunRecord, now, save_record
    from trainyard.runtime.launch import run_worker
    from trainyard.storage import Store, StoreSettings

    config = load_config(project.root / "params.yaml", overrides)
    with _env(project.env(**(env or {}))):
        store = Store(StoreSettings.from_worker_env())
        save_record(
            store,
            RunRecord(
                run_id=run_id,
                created_at=now(),
                params=config.model_dump(mode="json"),
                dataset=dataset,
            ),
        )
        run_worker(
            project.root,
            config.train,
            project.store_env,
            ["train", "--run-id", run_id],
            lambda _: None,
        )
        return store.read_json(training_key(run_id))


def prepare_run_split(project: BenchProject, overrides: list[str]) -> DatasetInfo:
    """The split a run with these overrides trains on, prepared as `trainyard run` does it
    (preflight writes a bundled dataset on first use; the split goes to the project's
    content-addressed cache, never data/processed, which the other benchmarks read).
    Returns the DatasetInfo to put in the run's record (DVC versioning left out)."""
    from trainyard.config import load_config
    from trainyard.data.split import prepare_cached_splits
    from trainyard.objectives import target_kind
    from trainyard.project import ProjectPaths
    from trainyard.runs.preflight import preflight
    from trainyard.runs.record import DatasetInfo
    from trainyard.storage.versioning import content_md5

    config = load_config(project.root / "params.yaml", overrides)
    preflight(config, project.root)
    md5 = content_md5(project.root / config.data.path)
    target = target_kind(config.task.name)
    paths = ProjectPaths(project.root)
    split = prepare_cached_splits(paths, config.data, config.split, md5, target)
    rows = split.schema.rows
    return DatasetInfo(
        path=config.data.path,
        dvc_md5=md5,
        rows=sum(rows.values()),
        split_rows=rows,
        classes=split.schema.classes,
        split_key=split.key,
    )


def split_folder(project: BenchProject, dataset: DatasetInfo) -> Path:
    from trainyard.project import ProjectPaths

    assert dataset.split_key is not None  # prepare_run_split names the split it made
    return ProjectPaths(project.root).split_cache(dataset.split_key)


def run_raw_script(
    project: BenchProject,
    workers: int,
    args: list[str],
    script: str = "raw_ddp.py",
    data: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A baseline script in benchmarks/ under torchrun, one thread per worker; `data` is
    the split folder it reads (default: data/processed); `env`: more environment."""
    out = project.root / f"raw-{time.time_ns()}.json"
    data = data or project.processed
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
        str(REPO / "benchmarks" / script), "--data", str(data), "--out", str(out), *args,
    ]  # fmt: skip
    env = project.env(OMP_NUM_THREADS="1", **(env or {}))
    subprocess.run(cmd, env=env, cwd=project.root, check=True, capture_output=True)
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_worker_env() -> dict[str, str]:
    """What torchrun gives a single worker on this machine, for a process started without it."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


Measured = TypeVar("Measured")  # a time, or whatever one measurement returns


def interleaved(
    reps: int, contenders: dict[str, Callable[[], Measured]]
) -> dict[str, list[Measured]]:
    """A, B, C, A, B, C, ...: machine noise hits every contender alike."""
    results: dict[str, list[Measured]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, measure in contenders.items():
            results[name].append(measure())
    return results


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(numerator) / statistics.median(denominator)


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median of each repetition's own ratio. Interleaved repetitions run side by side,
    so this cancels the machine's drift between repetitions (its neighbours moved the raw
    digits script's samples/s by +-12% from one repetition to the next on the 2-core VM)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def paired_interval(
    numerator: list[float], denominator: list[float], resamples: int = 4000
) -> tuple[float, float]:
    """A 95% bootstrap interval of `paired_ratio`: whether a target lies inside the
    machine's noise. On the 2-core VM one digits repetition's ratio ranged 0.79-1.15, so
    five repetitions read 0.90 one day and 0.97 the next; fifteen gave 1.005 (0.948-1.033).
    Seeded, so a run's report repeats."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    draw = random.Random(0)
    medians = sorted(
        statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def per_repetition(label: str, numerator: list[float], denominator: list[float]) -> dict:
    """`paired_ratio` and its 95% interval, as three of a benchmark's ratios: a target inside
    the interval is neither missed nor met beyond the machine's noise."""
    low, high = paired_interval(numerator, denominator)
    return {
        f"{label}, median of per-repetition ratios": paired_ratio(numerator, denominator),
        f"{label}, median of per-repetition ratios, 95% interval low": low,
        f"{label}, median of per-repetition ratios, 95% interval high": high,
    }


def machine() -> dict[str, Any]:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("prefect", "comet_ml", "s3fs", "ray"):
        with contextlib.suppress(ImportError):
            versions[package] = __import__(package).__version__
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions,
    }
