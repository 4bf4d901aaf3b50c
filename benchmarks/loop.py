"""1b. The training loop alone: trainyard's `train()` against the raw script's loop, in the
same two torchrun processes on the same tensors (`loop_ddp.py`), interleaved. The throughput
benchmark compares whole jobs, whose processes, imports and background work differ; this
one leaves only the loops and their hooks (no tracker, no checkpoint store) to differ, and
also runs trainyard without its straggler check. Digits MLP 128-64, batch 32 per worker, 2
workers: sub-millisecond compute, so per-step work shows."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.common import REPO, BenchProject, ratio, summary

WORKERS = 2


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
    return {
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
