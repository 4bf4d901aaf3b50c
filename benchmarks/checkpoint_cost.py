"""4. Checkpoint cost: step time while ~100 MB of state uploads in the background, vs no
checkpointing, vs waiting for each upload (synchronous); and upload throughput to the store.

In-process, with the real CheckpointWriter (rank 0's owner of uploads) and the real store;
a fixed matrix multiply stands in for the training step so only the checkpoint differs.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import BenchProject, _env, interleaved, ratio, summary
from trainyard.checkpoint import CheckpointWriter
from trainyard.config import CheckpointConfig
from trainyard.storage import Store, StoreSettings


def run(project: BenchProject, quick: bool) -> dict:
    megabytes, steps, every, reps = (20, 40, 10, 1) if quick else (100, 120, 20, 3)
    torch.set_num_threads(1)
    state = {"weights": torch.randn(megabytes * 2**20 // 4)}
    a = torch.randn(384, 384)
    counter = itertools.count()
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())

    def step_time(mode: str) -> float:
        run_id = f"bench-ckpt-{mode}-{next(counter)}"
        with tempfile.TemporaryDirectory() as staging:
            writer = CheckpointWriter(store, run_id, Path(staging), CheckpointConfig(max_staged=8))
            started = time.perf_counter()
            for step in range(1, steps + 1):
                for _ in range(4):
                    a @ a  # noqa: B018  (the stand-in for a training step)
                if mode != "none" and step % every == 0:
                    uri = writer.save(step, state, {"epoch": 0})
                    if mode == "synchronous":
                        while uri not in writer.committed:
                            time.sleep(0.005)
            elapsed = time.perf_counter() - started
            writer.close()
        return elapsed / steps * 1000

    measured = interleaved(
        reps,
        {
            mode: (lambda mode=mode: step_time(mode))
            for mode in ("none", "background", "synchronous")
        },
    )
    with tempfile.TemporaryDirectory() as folder:
        blob = Path(folder) / "blob"
        torch.save(state, blob)
        size_mb = blob.stat().st_size / 2**20
        throughput = []
        for i in range(reps + 1):
            started = time.perf_counter()
            store.put_file(blob, f"bench/upload-{i}")
            throughput.append(size_mb / (time.perf_counter() - started))
    return {
        "figures": {
            "step time, no checkpoint, ms": summary(measured["none"]),
            f"step time, {megabytes} MB checkpoint every {every} steps, background upload, ms": summary(
                measured["background"]
            ),
            f"step time, {megabytes} MB checkpoint every {every} steps, synchronous upload, ms": summary(
                measured["synchronous"]
            ),
            f"upload of {size_mb:.0f} MB to the store, MB/s": summary(throughput),
        },
        "ratios": {
            "background / no checkpoint, step time": ratio(
                measured["background"], measured["none"]
            ),
            "synchronous / no checkpoint, step time": ratio(
                measured["synchronous"], measured["none"]
            ),
        },
    }
