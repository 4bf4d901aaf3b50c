"""Runs as the pipeline leaves them, built by hand in the real store, for the tests of what
reads finished runs (the registry, the comparison page, damaged documents)."""

from __future__ import annotations

import hashlib
import io

import torch

from trainyard.checkpoint.signing import project_key, signed
from trainyard.runs.contracts import CheckpointManifest, FileEntry
from trainyard.runs.record import DatasetInfo, RunRecord, now, save_record
from trainyard.storage import Store


def fake_run(store: Store, run_id: str, accuracy: float, status: str = "completed") -> RunRecord:
    """A run as the pipeline leaves it, built by hand: a committed checkpoint (state.pt plus
    its manifest with sha256, signed with the project's key) and a completed record whose
    monitor is `accuracy`."""
    state = io.BytesIO()
    torch.save({"model": {"w": torch.full((3,), accuracy)}}, state)
    data = state.getvalue()
    key = f"runs/{run_id}/checkpoints/step-00000010"
    store.put_bytes(f"{key}/state.pt", data)
    manifest = CheckpointManifest(
        run_id=run_id,
        model={"name": "mlp", "options": {}},
        dataset_md5="md5-digits",
        world_size=1,
        global_batch_size=32,
        strategy="ddp",
        schema={"classes": ["0", "1"], "mean": [0.5], "std": [0.2]},
        params_hash="p",
        step=10,
        epoch=1,
        step_in_epoch=0,
        torch_version=torch.__version__,
        files={"state.pt": FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())},
    )
    document = signed(project_key(create=True), key, manifest.model_dump(mode="json"))
    store.write_json(f"{key}/manifest.json", document)
    record = RunRecord(
        run_id=run_id,
        status=status,
        created_at=now(),
        params={"task": {"name": "classification", "monitor": None}},
        dataset=DatasetInfo(path="data/raw/digits.csv", dvc_md5="md5-digits", rows=10),
        code={"git_commit": "c0ffee", "git_dirty": False},
        metrics={"test_accuracy": accuracy, "val_accuracy": accuracy},
        monitor={"name": "test_accuracy", "mode": "max", "value": accuracy},
        final_checkpoint=store.uri(key),
    )
    save_record(store, record)
    return record
