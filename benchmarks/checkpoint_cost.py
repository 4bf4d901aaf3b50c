"""4. Checkpoint cost: step time while ~100 MB of state is checkpointed in the background,
no more often than the store can absorb it, vs no checkpointing, vs waiting for each upload
(synchronous), vs uploading the same file alone from a child process (the floor: what the
store's work costs training on this machine, before anything trainyard adds); how long
`save()` blocks the training thread against one in-memory copy of the state (a clone; a
copy into memory already allocated is reported beside it: the writer copies into its last
snapshot's memory); and upload throughput to the store.

In-process, with the real CheckpointWriter (rank 0's owner of uploads) and the real store;
a fixed matrix multiply stands in for the training step so only the checkpoint differs.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import BenchProject, _env, interleaved, ratio, summary
from trainyard.checkpoint.writer import CheckpointWriter
from trainyard.config import CheckpointConfig
from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import EmbeddedS3
from trainyard.storage.sender import FileSender

META = {  # a checkpoint manifest's run fields: what CheckpointWriter.save takes
    "run_id": "bench",
    "model": {"name": "stand-in", "options": {}},
    "dataset_md5": None,
    "world_size": 1,
    "global_batch_size": 1,
    "strategy": "ddp",
    "schema": {},
    "params_hash": "0" * 16,
    "epoch": 0,
    "step_in_epoch": 0,
}


@dataclass(frozen=True)
class _Measured:
    megabytes: int  # of state
    size_mb: float  # of the serialized file
    absorb_s: float  # serialize, hash, upload and commit one checkpoint
    upload_mb_s: list[float]
    server_cpu_s: list[float]  # the store server's, per upload
    step_ms: dict[str, list[float]]  # by mode
    blocked_ms: list[float]  # save() on the training thread
    every: int  # steps between checkpoints
    every_s: float
    copy_ms: list[float]  # a clone
    copy_into_ms: list[float]  # into memory already allocated

    @property
    def extra_s_per_checkpoint(self) -> float:
        """What a checkpoint costs the steps around it."""
        extra_ms = statistics.median(self.step_ms["background"]) - statistics.median(
            self.step_ms["none"]
        )
        return extra_ms / 1000 * self.every


def run(project: BenchProject, quick: bool) -> dict:
    megabytes, reps = (8, 1) if quick else (100, 3)
    torch.set_num_threads(1)
    state = {"weights": torch.randn(megabytes * 2**20 // 4)}
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
    server = EmbeddedS3(project.root / ".trainyard" / "s3").status()
    assert server is not None, "the project's store is not up"
    absorb_s, throughput, size_mb, server_cpu_s = _store_absorbs(store, state, reps, server.pid)
    step_ms, blocked_ms, every, step_s = _step_times(store, state, absorb_s, quick, reps)
    spare = {name: tensor.clone() for name, tensor in state.items()}
    measured = _Measured(
        megabytes,
        size_mb,
        absorb_s,
        throughput,
        server_cpu_s,
        step_ms,
        blocked_ms,
        every,
        every * step_s,
        copy_ms=[_copy_ms(state) for _ in range(max(3, reps * 3))],
        copy_into_ms=[_copy_ms(state, spare) for _ in range(max(3, reps * 3))],
    )
    return {"figures": _figures(measured), "ratios": _ratios(measured)}


def _figures(m: _Measured) -> dict:
    label = f"{m.megabytes} MB checkpoint every {m.every} steps ({m.every_s:.1f} s)"
    return {
        "step time, no checkpoint, ms": summary(m.step_ms["none"]),
        f"step time, {label}, background upload, ms": summary(m.step_ms["background"]),
        f"step time, {label}, synchronous upload, ms": summary(m.step_ms["synchronous"]),
        f"step time, the same file uploaded every {m.every} steps from a child process, "
        "no checkpoint, ms": summary(m.step_ms["upload only"]),
        f"training thread blocked per {m.megabytes} MB checkpoint (save()), ms": summary(
            m.blocked_ms
        ),
        f"one in-memory copy of the {m.megabytes} MB state, ms": summary(m.copy_ms),
        f"one copy of the {m.megabytes} MB state into memory already allocated, ms": summary(
            m.copy_into_ms
        ),
        f"store absorbs one {m.size_mb:.0f} MB checkpoint (serialize, hash, upload), s": summary(
            [m.absorb_s]
        ),
        f"upload of {m.size_mb:.0f} MB to the store, MB/s": summary(m.upload_mb_s),
        # On one machine the store's work is the workers' loss: this is what a store on
        # another machine (S3) takes off the training machine.
        f"the store server's CPU per {m.size_mb:.0f} MB upload (SeaweedFS, same machine), s": (
            summary(m.server_cpu_s)
        ),
    }


def _ratios(m: _Measured) -> dict:
    # How far apart the default policy (checkpoint.max_overhead) puts checkpoints that take
    # this long to absorb.
    max_overhead = CheckpointConfig().max_overhead
    assert max_overhead is not None  # the default is a share, not null
    default_every_s = m.absorb_s / max_overhead
    steps, blocked_ms = m.step_ms, statistics.median(m.blocked_ms)
    return {
        "background / no checkpoint, step time (target <= 1.03)": ratio(
            steps["background"], steps["none"]
        ),
        (
            "background / no checkpoint, step time, at the default cadence "
            "(derived: the extra time per checkpoint above, spread over "
            f"absorb / checkpoint.max_overhead = {default_every_s:.0f} s)"
        ): 1 + m.extra_s_per_checkpoint / default_every_s,
        # What trainyard adds to what uploading the file costs on this machine.
        "background / the upload alone, step time": ratio(
            steps["background"], steps["upload only"]
        ),
        "upload alone / no checkpoint, step time": ratio(steps["upload only"], steps["none"]),
        "extra training time per checkpoint / the store server's CPU per upload": (
            m.extra_s_per_checkpoint / statistics.median(m.server_cpu_s)
        ),
        "save() blocking / one in-memory copy of the state (target <= 1)": (
            blocked_ms / statistics.median(m.copy_ms)
        ),
        "save() blocking / one copy into memory already allocated": (
            blocked_ms / statistics.median(m.copy_into_ms)
        ),
        "synchronous / no checkpoint, step time": ratio(steps["synchronous"], steps["none"]),
    }


def _step_times(
    store: Store, state: dict, absorb_s: float, quick: bool, reps: int
) -> tuple[dict[str, list[float]], list[float], int, float]:
    """Mean step times with no checkpoint, background and synchronous uploads, a checkpoint
    every 1.5x the store's absorb time; and (blocked ms per save(), steps between
    checkpoints, seconds per step)."""
    a = torch.randn(384, 384)

    def one_step() -> None:
        for _ in range(4):
            a @ a  # noqa: B018  (the stand-in for a training step)

    started = time.perf_counter()
    for _ in range(50):
        one_step()
    step_s = (time.perf_counter() - started) / 50
    # No more often than the store can take them: 1.5x the time one takes to absorb.
    every = max(1, math.ceil(1.5 * absorb_s / step_s))
    steps = every * (2 if quick else 4)
    blocked_ms: list[float] = []
    counter = itertools.count()

    schedule = _Schedule(one_step, steps, every)

    def step_time(mode: str) -> float:
        run_id = f"bench-ckpt-{mode}-{next(counter)}"
        return _ms_per_step(store, run_id, state, schedule, mode, blocked_ms)

    modes = ("none", "background", "upload only")
    measured = interleaved(reps, {mode: functools.partial(step_time, mode) for mode in modes})
    measured |= interleaved(1, {"synchronous": lambda: step_time("synchronous")})
    return measured, blocked_ms, every, step_s


@dataclass(frozen=True)
class _Schedule:
    one_step: Callable[[], None]  # the stand-in training step
    steps: int
    every: int  # steps between checkpoints


def _ms_per_step(
    store: Store, run_id: str, state: dict, schedule: _Schedule, mode: str, blocked_ms: list[float]
) -> float:
    """Mean step time with a checkpoint every `schedule.every` steps ("none": never; "upload
    only": the same file's upload, no checkpoint); each save()'s time on the training thread
    goes to `blocked_ms`."""
    if mode == "upload only":
        return _ms_per_step_uploading(store, run_id, state, schedule)
    steps, every = schedule.steps, schedule.every
    with tempfile.TemporaryDirectory() as staging:
        writer = CheckpointWriter(store, run_id, Path(staging), CheckpointConfig(max_staged=8))
        started = time.perf_counter()
        for step in range(1, steps + 1):
            schedule.one_step()
            if mode != "none" and step % every == 0:
                saving = time.perf_counter()
                uri = writer.save(step, state, META)
                blocked_ms.append((time.perf_counter() - saving) * 1000)
                if mode == "synchronous":
                    while uri not in writer.committed:
                        time.sleep(0.005)
        elapsed = time.perf_counter() - started
        writer.close()
    return elapsed / steps * 1000


def _ms_per_step_uploading(store: Store, run_id: str, state: dict, schedule: _Schedule) -> float:
    """The floor under a background checkpoint on this machine: mean step time while the
    serialized state is uploaded every `schedule.every` steps from a child process (what the
    writer does after its snapshot, serialization, hash and commit), one upload at a time."""
    with tempfile.TemporaryDirectory() as folder:
        blob = Path(folder) / "blob"
        torch.save(state, blob)
        sender = FileSender(store)
        try:
            with ThreadPoolExecutor(max_workers=1) as uploads:
                started, sent = time.perf_counter(), []
                for step in range(1, schedule.steps + 1):
                    schedule.one_step()
                    if step % schedule.every == 0:
                        sent.append(uploads.submit(sender.put_file, blob, f"bench/{run_id}/{step}"))
                elapsed = time.perf_counter() - started
            for upload in sent:
                upload.result()  # a failed upload would make this floor look cheap
        finally:
            sender.close()
    store.delete(f"bench/{run_id}", recursive=True)
    return elapsed / schedule.steps * 1000


def _store_absorbs(
    store: Store, state: dict, reps: int, server_pid: int
) -> tuple[float, list[float], float, list[float]]:
    """(seconds to serialize, hash and upload one checkpoint; upload MB/s; its size in MB;
    the store server's CPU seconds per upload)."""
    with tempfile.TemporaryDirectory() as folder:
        # The second of two: the first also starts the writer's upload process.
        writer = CheckpointWriter(store, "bench-ckpt-absorb", Path(folder))
        for step in (1, 2):
            writer.save(step, state, META)
            while writer.staged_steps():
                time.sleep(0.005)
        writer.close()
        absorb_s = writer.last_absorb_s
        assert absorb_s is not None  # both saves were absorbed before close
        blob = Path(folder) / "blob"
        torch.save(state, blob)
        size_mb = blob.stat().st_size / 2**20
        throughput, server_cpu_s = [], []
        for i in range(reps + 1):
            started, cpu_started = time.perf_counter(), _cpu_s(server_pid)
            store.put_file(blob, f"bench/upload-{i}")
            throughput.append(size_mb / (time.perf_counter() - started))
            server_cpu_s.append(_cpu_s(server_pid) - cpu_started)
    return absorb_s, throughput, size_mb, server_cpu_s


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _copy_ms(state: dict, into: dict | None = None) -> float:
    """The baseline: one plain copy of every tensor, nothing else (into `into`'s tensors, or
    into fresh memory: a clone, what a snapshot costs without the writer's spare)."""
    started = time.perf_counter()
    if into is None:
        {name: tensor.clone() for name, tensor in state.items()}  # noqa: B018
    else:
        for name, tensor in state.items():
            into[name].copy_(tensor)
    return (time.perf_counter() - started) * 1000
