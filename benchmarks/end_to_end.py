"""2. End-to-end wall time of a short job (launch -> trained, checkpointed, validated) and
time to the first training step, for: a default `trainyard run` with the project's Prefect
server already up (what every run after a project's first is), the same run starting that
server first (a project's first run), the raw torchrun script, and Ray Train's
TorchTrainer. Same model, data, batch and 2 workers.

Also where a default trainyard run's time goes (against the running server): its wall time
cut into consecutive stages at events read off its own output, Prefect's log lines and the
workers' (both carry millisecond timestamps), so the stages add up to the wall time.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.common import (
    BIN,
    REPO,
    BenchProject,
    _env,
    interleaved,
    ratio,
    run_raw_script,
    summary,
)
from trainyard.cli.prefect_server import PrefectServer
from trainyard.runs.record import load_record
from trainyard.storage import Store, StoreSettings

WORKERS = 2
SERVER = "trainyard (project's Prefect server running)"
STARTING = "trainyard (starting the project's Prefect server)"


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (5, 3)
    run_ids = (f"bench-e2e-{n}" for n in itertools.count())
    first_step: dict[str, list[float]] = {}
    stages: dict[str, list[float]] = {}
    common: dict[str, Any] = {"project": project, "epochs": epochs, "first_step": first_step}
    trainyard = functools.partial(_measure_trainyard, run_ids=run_ids, stages=stages, **common)
    server = PrefectServer(project.root / ".trainyard" / "prefect")
    # Quick mode (a smoke test) leaves out the server's start: the same flow, 15 s more; it
    # reports to the user's PREFECT_API_URL where one is set (a test session's server).
    if not (quick and os.environ.get("PREFECT_API_URL")):
        server.up()  # a first run's migrations are no part of any contender's figure
    contenders: dict[str, Callable[[], float]] = {}
    if not quick:
        contenders[STARTING] = functools.partial(trainyard, server, STARTING)
    contenders[SERVER] = functools.partial(trainyard, None, SERVER)
    contenders["raw"] = functools.partial(_measure_raw, **common)
    if _has_ray():
        contenders["ray"] = functools.partial(_measure_ray_train, **common)
    measured = interleaved(reps, contenders)
    figures = {f"{name}, wall s": summary(values) for name, values in measured.items()}
    figures |= {
        f"{name}, time to first step s": summary(values) for name, values in first_step.items()
    }
    figures |= {f"{SERVER}, {stage} s": summary(values) for stage, values in stages.items()}
    result: dict[str, Any] = {"figures": figures, "ratios": _comparisons(measured, first_step)}
    if "ray" not in measured:  # its ratios would be missing without a word
        result["left_out"] = "Ray Train (not installed: `make bench` installs the bench extra)"
    return result


# --- the contenders: each returns one run's wall time and adds its time to first step ---


def _measure_trainyard(
    stopped: PrefectServer | None,
    label: str,
    *,
    project: BenchProject,
    epochs: int,
    run_ids: Iterator[str],
    first_step: dict[str, list[float]],
    stages: dict[str, list[float]],
) -> float:
    """One default `trainyard run`, which reports to the project's Prefect server (stopped
    first where `stopped` names it, so the run starts it); the running server's runs are
    also cut into `stages`."""
    run_id = next(run_ids)
    if stopped is not None:
        stopped.down()
    env = project.env()
    started = time.time()
    done = subprocess.run(
        [str(BIN / "trainyard"), "run", "--run-id", run_id, "-S", f"train.epochs={epochs}"],
        cwd=project.root, env=env, check=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ended = time.time()
    with _env(env):  # what `trainyard runs show --json` prints, without a command's start
        record = load_record(Store(StoreSettings.from_worker_env()), run_id).model_dump(mode="json")
    first_step.setdefault(label, []).append(record["first_step_at"] - started)
    if label == SERVER:
        for stage, seconds in breakdown(done.stdout, record, started, ended).items():
            stages.setdefault(stage, []).append(seconds)
    return ended - started


def _measure_raw(
    *, project: BenchProject, epochs: int, first_step: dict[str, list[float]]
) -> float:
    started = time.time()
    result = run_raw_script(
        project,
        WORKERS,
        ["--epochs", str(epochs), "--checkpoint", str(project.root / "raw.pt")],
    )
    first_step.setdefault("raw", []).append(result["first_step_at"] - started)
    return time.time() - started


def _measure_ray_train(
    *, project: BenchProject, epochs: int, first_step: dict[str, list[float]]
) -> float:
    out = project.root / "ray.json"
    started = time.time()
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ray_train.py"), "--data", str(project.processed),
         "--out", str(out), "--workers", str(WORKERS), "--epochs", str(epochs)],
        env=project.env(), check=True, capture_output=True,
    )  # fmt: skip
    first_step.setdefault("ray", []).append(json.loads(out.read_text())["first_step_at"] - started)
    return time.time() - started


def _comparisons(measured: dict[str, list[float]], first_step: dict[str, list[float]]) -> dict:
    """Wall-time ratios of medians, and time to first step against the raw script's, in s."""
    comparisons = {
        f"{name} / raw, wall": ratio(values, measured["raw"])
        for name, values in measured.items()
        if name != "raw"
    }
    late = statistics.median(first_step[SERVER]) - statistics.median(first_step["raw"])
    comparisons[f"{SERVER} - raw, time to first step s (target <= 3)"] = late
    if "ray" in measured:
        for name in (STARTING, SERVER) if STARTING in measured else (SERVER,):
            comparisons[f"{name} / ray, wall (target <= 0.6)"] = ratio(
                measured[name], measured["ray"]
            )
    return comparisons


# --- where the time goes ----------------------------------------------------------------

PREFECT_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+ +\| (.*)$")
# Passed on by the training task (trainyard.cli.console): rank 0's, stamped by Prefect's line.
WORKER_LINE = re.compile(r"\[rank (\d+)/\d+\] ([\w.]+): (.*)$")
WORKER_UP = re.compile(r"worker up: start and imports ([\d.]+)s, (?:run record and )?process group ([\d.]+)s")  # fmt: skip
# Started ahead of the job (trainyard.runtime.persistent), while the command sets up the flow and
# the flow prepares the data: not a stage on the way to the first step, but reported.
ALONGSIDE = "workers' own start, alongside the above (Python, imports, process group)"


def breakdown(output: str, record: dict, started: float, ended: float) -> dict[str, float]:
    """A `trainyard run`'s wall time (started -> ended, epoch seconds) as consecutive
    stages, from its output and its run record, and the workers' own start, which overlaps
    them. Raises ValueError naming a line it needs and did not find (the log formats of
    Prefect, trainyard.util.logs and the worker changed)."""
    events = _events(output, started)
    worker_up, line = max(events["worker up"])  # rank 0's
    handed = events["job handed to the workers"][0][0]
    scored = min(t for t, _ in events["test scored"])
    evaluation = record["timings_s"]["evaluate"]
    marks = [
        ("CLI start, preflight, Prefect flow start", events["flow started"][0][0]),
        ("store check and DVC", events["dataset versioned"][0][0]),
        ("run record, split (cached), resume plan", handed),
        ("waiting for the workers to be up", max(handed, worker_up)),
        ("data, model, first step", record["first_step_at"]),
        ("training", scored - evaluation),
        ("in-job evaluation", scored),
        ("job end (Comet end, uploads)", events["training task done"][0][0]),
        ("run record write, flow end, workers stopped", ended),
    ]
    stages, previous = {}, started
    for stage, at in marks:
        stages[stage], previous = at - previous, at
    worker_up_line = WORKER_UP.search(line)
    assert worker_up_line, line
    stages[ALONGSIDE] = sum(float(s) for s in worker_up_line.groups())
    return stages


EVENTS = {  # the first Prefect line holding all of these texts
    "flow started": ("Beginning flow run", "for flow 'training_pipeline'"),
    "dataset versioned": ("Task run 'version-dataset-", "Finished in state Completed"),
    "job handed to the workers": ("Task run 'train-distributed-", "training on "),
    "training task done": ("Task run 'train-distributed-", "Finished in state Completed"),
}
WORKER_EVENTS = {  # every rank's line: (logger, start of the message)
    "worker up": ("trainyard.worker", "worker up: "),  # the worker logs under its `-m` name
    "test scored": ("trainyard.engine.jobs", "test "),
}


def _events(output: str, started: float) -> dict[str, list[tuple[float, str]]]:
    """Each event's (epoch seconds, message) lines, in output order."""
    found: dict[str, list[tuple[float, str]]] = {}
    for line in output.splitlines():
        prefect = PREFECT_LINE.match(line)
        if not prefect:
            continue
        at, text = _epoch(prefect.group(1), started), prefect.group(2)
        worker = WORKER_LINE.search(text)  # a worker's line, passed on by the training task
        if worker:
            logger, message = worker.group(2, 3)
            for event, (name, start) in WORKER_EVENTS.items():
                if logger == name and message.startswith(start):
                    found.setdefault(event, []).append((at, message))
            continue
        for event, texts in EVENTS.items():
            if all(part in text for part in texts):
                found.setdefault(event, []).append((at, text))
    missing = [event for event in [*EVENTS, *WORKER_EVENTS] if event not in found]
    if missing:
        raise ValueError(f"trainyard run's output has no line for {', '.join(missing)}")
    return found


def _epoch(clock: str, near: float) -> float:
    """A log line's local HH:MM:SS.mmm as epoch seconds, on the day of `near` (or the
    next, for a run that crossed midnight)."""
    day = dt.datetime.fromtimestamp(near).date()
    at = dt.datetime.combine(day, dt.time.fromisoformat(clock)).timestamp()
    return at + 86400 if at < near - 3600 else at


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True
