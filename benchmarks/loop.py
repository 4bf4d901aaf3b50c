"""1b. The training loop alone: trainyard's `train()` against the raw script's loop, in the
same two torchrun processes on the same tensors (`loop_ddp.py`), interleaved. The throughput
benchmark compares whole jobs, whose processes, imports and background work differ; this
one leaves only the loops and their hooks (no tracker, no checkpoint store) to differ, and
also runs trainyard without its straggler check. Digits MLP 128-64, batch 32 per worker, 2
workers: sub-millisecond compute, so per-step work shows.

Where valgrind is installed (`make bench` installs it), the loops are also compared by the
instructions one worker executes per training row, counted by callgrind. On the 2-core VM
the wall-clock ratios move by +-0.1 (and whole jobs' by +-0.15) from run to run; the counts
repeat to ~0.1% (0.946 and 0.947), so they show what a change to the loop saves. They leave out what costs
time but not instructions (cache misses, waiting for the other rank), and trainyard's count
includes its epoch ends (validation, hooks), which its samples/s leave out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    result = {
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
    """Instructions per row of the raw loop / trainyard's, one worker (a higher ratio is a
    leaner trainyard, as with samples/s)."""
    arms = ["raw", "trainyard"]
    runs = [(arm, epochs) for arm in arms for epochs in COUNTED_EPOCHS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one core each
        counted = dict(
            zip(runs, pool.map(lambda run: _callgrind(project, *run), runs), strict=True)
        )
    per_row = {}
    for arm in arms:
        (short, rows), (long, _) = (counted[arm, epochs] for epochs in COUNTED_EPOCHS)
        per_row[arm] = (long - short) / (rows * (COUNTED_EPOCHS[1] - COUNTED_EPOCHS[0]))
    label = "digits MLP 128-64, 1 worker, instructions per row (callgrind)"
    return {f"{label}: raw loop / trainyard train()": per_row["raw"] / per_row["trainyard"]}


def _callgrind(project: BenchProject, arm: str, epochs: int) -> tuple[int, int]:
    """(instructions executed, rows per epoch) of one process running `arm` for `epochs`."""
    out = project.root / f"loop-{arm}-{epochs}-{time.time_ns()}.json"
    cmd = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, str(REPO / "benchmarks" / "loop_ddp.py"), "--data", str(project.processed),
        "--out", str(out), "--epochs", str(epochs), "--arm", arm,
    ]  # fmt: skip
    env = project.env(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        PYTHONHASHSEED="0",  # dict probes vary with the hash seed: ~1.5% of a step's count
        **one_worker_env(),
    )
    done = subprocess.run(cmd, env=env, cwd=project.root, check=True, capture_output=True)
    collected = re.search(rb"Collected : (\d+)", done.stderr)
    assert collected, done.stderr[-2000:]
    return int(collected.group(1)), json.loads(out.read_text())["rows_per_epoch"]
