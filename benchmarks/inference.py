"""10. Batch inference: rows/s of the trainyard `predict` job (torchrun, committed Parquet
shards in the store) on 1 and 2 workers, against one plain PyTorch process that reads the
same Parquet table, standardizes it, runs the same model in the same batches and writes one
local Parquet file.

Rows/s counts scoring only: read, forward and write (for trainyard: each rank's loop over
its shards, commits included; the slowest rank's time). Process start-up is reported apart,
as the job's wall time. The model is an MLP 1024-1024 trained one epoch on digits; the input
is a generated table of digits-shaped rows (64 features), converted once by the job's check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks.common import (
    BenchProject,
    _env,
    interleaved,
    prepare_run_split,
    ratio,
    run_trainyard_worker,
    summary,
)

OVERRIDES = [
    "train.workers=1",
    "train.epochs=1",
    "tracking.backend=none",
    "model.options.hidden_sizes=[1024,1024]",
]
BATCH = 4096

PLAIN = """
import json, sys, time
import numpy as np, pandas as pd, pyarrow as pa, pyarrow.parquet as pq, torch
from pathlib import Path
from trainyard.checkpoint.loading import load_model
from trainyard.storage import Store, StoreSettings
torch.set_num_threads(1)
started = time.monotonic()
loaded = load_model(Store(StoreSettings.from_worker_env()), sys.argv[1], Path(sys.argv[4]))
schema = loaded.schema
clock = time.monotonic()
frame = pd.read_parquet(sys.argv[2], columns=schema.feature_columns)
x = torch.from_numpy(frame.to_numpy(np.float32))
x = (x - torch.tensor(schema.feature_mean)) / torch.tensor(schema.feature_std)
with torch.inference_mode():
    probabilities = torch.cat([torch.softmax(loaded.model(b), 1) for b in x.split(int(sys.argv[5]))]).numpy()
labels = np.asarray(schema.classes, dtype=object)[probabilities.argmax(1)]
columns = {"row": np.arange(len(x)), "prediction": labels}
columns |= {f"prob_{c}": probabilities[:, j] for j, c in enumerate(schema.classes)}
pq.write_table(pa.table(columns), sys.argv[3])
print(json.dumps({"scoring_s": time.monotonic() - clock, "rows": len(x)}))
"""


def run(project: BenchProject, quick: bool) -> dict:
    reps, rows = (1, 20_000) if quick else (3, 400_000)
    checkpoint = _trained_checkpoint(project)
    table = _input_table(project.root, rows)
    counter = iter(range(1_000_000))

    def trainyard(workers: int):
        return lambda: _trainyard_rows_per_s(project, checkpoint, table, workers, next(counter))

    arms = {"plain": lambda: _plain_rows_per_s(project, checkpoint, table)}
    if not quick:  # each arm is a torchrun launch: a quick run's time is its launches
        arms["trainyard 1 worker"] = trainyard(1)
    measured = interleaved(reps, arms | {"trainyard 2 workers": trainyard(2)})
    rates = {name: [rate for rate, _ in values] for name, values in measured.items()}
    walls = {name: [wall for _, wall in values] for name, values in measured.items()}
    label = f"MLP 1024-1024, {rows:,} rows x 64 features"
    figures = {f"{label}: {name}, rows/s": summary(v) for name, v in rates.items()}
    figures |= {
        f"{label}: {name}, wall s (process start to exit)": summary(v) for name, v in walls.items()
    }
    ratios = {
        f"{label}: trainyard 2 workers / plain PyTorch, rows/s": ratio(
            rates["trainyard 2 workers"], rates["plain"]
        ),
    }
    if quick:
        left_out = "trainyard with 1 worker and its ratios (quick mode)"
        return {"figures": figures, "ratios": ratios, "left_out": left_out}
    ratios |= {
        f"{label}: trainyard 1 worker / plain PyTorch, rows/s": ratio(
            rates["trainyard 1 worker"], rates["plain"]
        ),
        f"{label}: trainyard 2 workers / 1 worker, rows/s": ratio(
            rates["trainyard 2 workers"], rates["trainyard 1 worker"]
        ),
    }
    return {"figures": figures, "ratios": ratios}


def _trained_checkpoint(project: BenchProject) -> str:
    """A completed run's final checkpoint, trained by the real worker."""
    from trainyard.runs.record import load_record, save_record
    from trainyard.storage import Store, StoreSettings

    dataset = prepare_run_split(project, OVERRIDES)
    result = run_trainyard_worker(project, OVERRIDES, "bench-inference", dataset)
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
        record = load_record(store, "bench-inference")
        record.status, record.final_checkpoint = "completed", result["final_checkpoint"]
        save_record(store, record)
    return result["final_checkpoint"]


def _input_table(root: Path, rows: int) -> Path:
    """Digits-shaped rows (pixel values 0..16), a label column the model ignores."""
    generator = np.random.default_rng(0)
    features = generator.integers(0, 17, size=(rows, 64)).astype(np.float64)
    frame = pd.DataFrame(features, columns=[f"pixel_{i}" for i in range(64)])
    frame["label"] = "0"
    path = root / "data" / f"score-{rows}.parquet"
    frame.to_parquet(path)
    return path


def _plain_rows_per_s(project: BenchProject, checkpoint: str, table: Path) -> tuple[float, float]:
    out = project.root / "plain.parquet"
    scratch = project.root / ".trainyard" / "plain"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, checkpoint, str(table), str(out), str(scratch), str(BATCH)],
        env=project.env(OMP_NUM_THREADS="1"),
        cwd=project.root,
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - started
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["rows"] / result["scoring_s"], wall


def _trainyard_rows_per_s(
    project: BenchProject, checkpoint: str, table: Path, workers: int, n: int
) -> tuple[float, float]:
    """The predict job as the flow launches it (a fresh prediction id: nothing reused)."""
    from trainyard.config import load_config
    from trainyard.inference.documents import job_key
    from trainyard.inference.plan import plan_prediction
    from trainyard.inference.shards import read_output_manifest
    from trainyard.project import ProjectPaths
    from trainyard.runtime.launch import run_worker
    from trainyard.storage import Store, StoreSettings

    # 8 shards, whatever the rows: every worker has some, and each commit is a fair share.
    shard_rows = -(-pd.read_parquet(table, columns=["label"]).shape[0] // 8)
    settings = [
        *OVERRIDES,
        f"inference.workers={workers}",
        f"inference.batch_size={BATCH}",
        f"inference.shard_rows={shard_rows}",
    ]
    config = load_config(project.root / "params.yaml", settings)
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
        paths = ProjectPaths(project.root)
        job = plan_prediction(
            store, paths, config, "run:bench-inference", str(table), f"bench-{workers}w-{n}"
        )
        store.write_json(job_key(job.prediction_id), job.model_dump(mode="json"))
        train = config.train.model_copy(update={"workers": workers})
        started = time.monotonic()
        run_worker(
            project.root, train, project.store_env, ["predict", "--job", job_key(job.prediction_id)],
            lambda _: None, rdzv_id=job.prediction_id,
        )  # fmt: skip
        wall = time.monotonic() - started
        manifest = read_output_manifest(store, job.prediction_id)
    assert manifest is not None and manifest.rows == job.input.rows
    return manifest.rows_scored / manifest.scoring_seconds, wall
