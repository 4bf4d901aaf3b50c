"""Worker start: workers forked from torchrun's agent against a new interpreter for each.

The same short 2-worker training job (the digits MLP, one epoch, checkpoints to the store,
Comet off), launched as trainyard launches it (torchrun's `--run-path --start-method=fork`:
the agent imports torch and the engine once and forks each worker, trainyard.runtime.forked)
and as it was launched before (torchrun's `-m trainyard.engine.worker`: each worker a new
interpreter importing them itself), interleaved. Figures: the job's CPU seconds (the agent
and its workers), its wall seconds, and each worker's "start and imports" seconds as it
logs them; ratios forked / new interpreters.
"""

from __future__ import annotations

import itertools
import re
import resource
import statistics
import time
from collections.abc import Callable
from unittest import mock

from benchmarks.common import BenchProject, _env, interleaved, paired_ratio, summary
from trainyard.config import load_config
from trainyard.runs.record import RunRecord, now, save_record
from trainyard.runtime import launch
from trainyard.runtime.launch import run_worker
from trainyard.runtime.torchrun import new_interpreters, torchrun_command
from trainyard.storage import Store, StoreSettings

OVERRIDES = ["train.epochs=1", "train.workers=2", "tracking.backend=none"]
STARTED = re.compile(r"worker up: start and imports (\d+\.\d+)s")


def run(project: BenchProject, quick: bool) -> dict:
    reps = 1 if quick else 5
    config = load_config(project.root / "params.yaml", OVERRIDES)
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
    counter = itertools.count()

    def job(command: Callable[..., list[str]]) -> Callable[[], tuple[float, float, float]]:
        def measure() -> tuple[float, float, float]:
            run_id = f"bench-start-{next(counter)}"
            params = config.model_dump(mode="json")
            save_record(store, RunRecord(run_id=run_id, created_at=now(), params=params))
            lines: list[str] = []
            before, clock = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
            with mock.patch.object(launch, "torchrun_command", command):
                run_worker(
                    project.root, config.train, project.store_env, ["train", "--run-id", run_id],
                    lines.append, rdzv_id=run_id,
                )  # fmt: skip
            wall, after = time.monotonic() - clock, resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
            starts = [float(m[1]) for line in lines if (m := STARTED.search(line))]
            return cpu, wall, statistics.median(starts)

        return measure

    found = interleaved(reps, {"forked": job(torchrun_command), "new": job(_new_interpreters)})
    figures, ratios = {}, {}
    for index, what in enumerate(("job CPU s", "job wall s", "a worker's start and imports s")):
        forked = [result[index] for result in found["forked"]]
        new = [result[index] for result in found["new"]]
        figures[f"{what}, forked from the agent"] = summary(forked)
        figures[f"{what}, a new interpreter per worker"] = summary(new)
        ratios[f"{what}: forked / new interpreters"] = paired_ratio(forked, new)
    return {"figures": figures, "ratios": ratios}


def _new_interpreters(*args: object, **kwargs: object) -> list[str]:
    """The job's torchrun command as it was before workers were forked: `-m` the worker
    (and an agent that does not import the engine: trainyard.runtime.launch.torchrun)."""
    return new_interpreters(torchrun_command(*args, **kwargs))  # type: ignore[arg-type]
