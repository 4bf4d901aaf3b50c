"""Step time with and without checkpoint uploads in flight (2 gloo workers, real SeaweedFS).

    .venv/bin/python benchmarks/checkpoint_upload.py [--epochs 10] [--every-n-steps 5]

Runs the same training twice through torchrun: checkpointing only at the end, then every N
steps (the background uploader then almost always has an upload in flight). Step time is
each rank's time inside training steps (staging and uploads excluded unless they slow the
step down), from `samples_per_s_per_rank` in training.json. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from trainyard.config import config_from_dict
from trainyard.data.split import prepare_splits
from trainyard.data.tables import write_digits
from trainyard.jobs import training_key
from trainyard.launch import run_worker
from trainyard.project import ProjectPaths
from trainyard.runs import DatasetInfo, RunRecord, now, save_record
from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import EmbeddedS3

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--every-n-steps", type=int, default=5)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    server = EmbeddedS3(home / "s3")
    state = server.up()
    try:
        creds = server.credentials()
        store = Store(
            StoreSettings("trainyard", "bench", state.endpoint, creds.access_key, creds.secret_key)
        )
        store.fs.mkdir("trainyard")
        root = home / "project"
        root.mkdir()
        for name in ("params.yaml", "dvc.yaml"):
            shutil.copy(REPO / name, root / name)
        paths = ProjectPaths(root)
        base = config_from_dict({})
        write_digits(root / base.data.path)
        prepare_splits(base.data, base.split, root / base.data.path, paths.processed)
        for label, checkpoint in (
            ("final checkpoint only", {"every_n_epochs": args.epochs}),
            (f"checkpoint every {args.every_n_steps} steps", {"every_n_steps": args.every_n_steps}),
        ):
            run_id = "bench-" + ("none" if "only" in label else "uploads")
            params = config_from_dict(
                {
                    "train": {"workers": 2, "epochs": args.epochs},
                    "checkpoint": {**checkpoint, "max_staged": 64},
                    "tracking": {"backend": "none"},
                }
            )
            record = RunRecord(
                run_id=run_id,
                created_at=now(),
                params=params.model_dump(mode="json"),
                dataset=DatasetInfo(path=base.data.path, dvc_md5="bench", rows=1797),
            )
            save_record(store, record)
            started = time.monotonic()
            run_worker(
                root,
                params.train,
                store.settings.worker_env(),
                ["train", "--run-id", run_id],
                on_line=lambda _: None,
            )
            wall = time.monotonic() - started
            training = store.read_json(training_key(run_id))
            rows_per_step = params.global_batch_size / 2
            step_ms = [1000 * rows_per_step / s for s in training["samples_per_s_per_rank"]]
            print(
                f"{label:<28} steps {training['steps']:4d}  step time per rank "
                f"{', '.join(f'{ms:.2f} ms' for ms in step_ms)}  "
                f"(rank 0 uploads)  job wall {wall:.1f}s"
            )
    finally:
        server.down()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
