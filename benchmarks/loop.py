"""1b. The training loop alone: trainyard's `train()` against the raw script's loop, in the
same two torchrun processes on the same tensors (`loop_ddp.py`), interleaved. The throughput
benchmark compares whole jobs, whose processes, imports and background work differ; this
one leaves only the loops and their hooks (no tracker, no checkpoint store) to differ, and
also runs trainyard without its straggler check. Digits MLP 128-64, batch 32 per worker, 2
workers: sub-millisecond compute, so per-step work shows.

Where valgrind is installed (`make bench` installs it), the loops are also compared by the
instructions executed per training row, counted by callgrind: by one worker, and by two (each
torchrun worker under callgrind, both counted), whose epochs end twice as often. On the
2-core VM the wall-clock ratios move by +-0.1 (and whole jobs' by +-0.15) from run to run;
the counts repeat to ~0.1% (0.946 and 0.947), so they show what a change to the loop saves.
They leave out what costs time but not instructions (cache misses, waiting for the other
rank), and trainyard's count includes its epoch ends (validation, hooks), which its
samples/s leave out. trainyard checkpoints at the end only, as the digits job mostly does:
with a checkpoint (to no store) every epoch the two-worker ratio read 0.856, not 0.936."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import REPO, BenchProject, one_worker_env, ratio, summary

WORKERS = 2
# Epochs of the two runs per arm whose difference is counted: it cancels start-up and imports.
COUNTED_EPOCHS = (2, 22)


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (2, 1) if quick else (150, 5)
    out = project.root / f"loop-{time.time_ns()}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={WORKERS}", str(REPO / "benchmarks" / "loop_ddp.py"),
        "--data", str(project.processed), "--out", str(out),
        "--epochs", str(epochs), "--reps", str(reps),
    ]  # fmt: skip
    env = project.env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run(cmd, env=env, cwd=project.root, check=True, capture_output=True)
    measured = json.loads(out.read_text())
    label = "digits MLP 128-64, 2 workers, same processes"
    result: dict[str, Any] = {
        "figures": {
            f"{label}: raw loop, samples/s": summary(measured["raw"]),
            f"{label}: trainyard train(), samples/s": summary(measured["trainyard"]),
            f"{label}: trainyard train() without the straggler check, samples/s": summary(
                measured["trainyard_no_stragglers"]
            ),
        },
        "ratios": {
            f"{label}: trainyard train() / raw loop": ratio(measured["trainyard"], measured["raw"]),
            f"{label}: trainyard train() without the straggler check / raw loop": ratio(
                measured["trainyard_no_stragglers"], measured["raw"]
            ),
        },
    }
    if not quick and shutil.which("valgrind"):
        result["ratios"] |= _instruction_ratios(project)
    return result


def _instruction_ratios(project: BenchProject) -> dict[str, float]:
    """Instructions per row of the raw loop / trainyard's, with one worker and with two (a
    higher ratio is a leaner trainyard, as with samples/s)."""
    arms = ["raw", "trainyard"]
    runs = [(arm, epochs) for arm in arms for epochs in COUNTED_EPOCHS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one core each
        one = dict(zip(runs, pool.map(lambda run: _callgrind(project, *run), runs), strict=True))
    two = {run: _callgrind(project, *run, workers=WORKERS) for run in runs}  # both cores
    ratios = {}
    for workers, counted in ((1, one), (WORKERS, two)):
        per_row = {}
        for arm in arms:
            (short, rows), (long, _) = (counted[arm, epochs] for epochs in COUNTED_EPOCHS)
            per_row[arm] = (long - short) / (rows * (COUNTED_EPOCHS[1] - COUNTED_EPOCHS[0]))
        label = f"digits MLP 128-64, {workers} worker{'s' * (workers > 1)}, instructions per row"
        ratios[f"{label} (callgrind): raw loop / trainyard train()"] = (
            per_row["raw"] / per_row["trainyard"]
        )
    return ratios


def _callgrind(project: BenchProject, arm: str, epochs: int, workers: int = 1) -> tuple[int, int]:
    """(instructions executed by all workers, rows per epoch) of `arm` run for `epochs`; with
    several workers, each torchrun starts runs under callgrind."""
    out = project.root / f"loop-{arm}-{epochs}-{workers}-{time.time_ns()}.json"
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    script = [
        sys.executable, str(REPO / "benchmarks" / "loop_ddp.py"), "--data", str(project.processed),
        "--out", str(out), "--epochs", str(epochs), "--arm", arm,
    ]  # fmt: skip
    env = project.env(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        PYTHONHASHSEED="0",  # dict probes vary with the hash seed: ~1.5% of a step's count
    )
    if workers == 1:
        cmd = valgrind + script
        env |= one_worker_env()
    else:  # each worker's count in its own log (%p: its process id)
        logs = out.with_suffix("")
        logs.mkdir()
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={workers}", "--no-python",
        ]  # fmt: skip
        cmd = launcher + valgrind + [f"--log-file={logs}/%p.log"] + script
    done = subprocess.run(cmd, env=env, cwd=project.root, check=True, capture_output=True)
    reports = [done.stderr] if workers == 1 else [f.read_bytes() for f in logs.glob("*.log")]
    counts = [re.search(rb"Collected : (\d+)", report) for report in reports]
    assert len(counts) == workers and all(counts), reports
    return sum(int(c.group(1)) for c in counts if c), json.loads(out.read_text())["rows_per_epoch"]
