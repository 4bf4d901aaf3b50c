"""The object store goes away in the middle of training and comes back (real SeaweedFS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.checkpoint.layout import MANIFEST_FILE, checkpoint_key, checkpoint_steps
from trainyard.checkpoint.reader import fetch_files, load_checkpoint
from trainyard.runtime.progress import AttemptLog
from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import EmbeddedS3

from training_jobs import params, prepare_project, save_run, train, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def committed_steps(store: Store, run_id: str) -> list[int]:
    return [
        step
        for step in checkpoint_steps(store, run_id)
        if store.exists(f"{checkpoint_key(run_id, step)}/{MANIFEST_FILE}")
    ]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_rides_out_a_store_outage_and_commits_the_backlog(tmp_path, monkeypatch, strategy):
    """fsdp: every rank uploads its own shard in the background; none may block training."""
    # Workers import the slow test model from tests/ (steps of >= 30 ms: the run outlasts
    # the server's shutdown and several upload retries).
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    server = EmbeddedS3(tmp_path / "s3")  # its own server: this test stops it
    state = server.up()
    try:
        creds = server.credentials()
        settings = StoreSettings(
            "trainyard", "outage", state.endpoint, creds.access_key, creds.secret_key
        )
        store = Store(settings)
        store.fs.mkdir("trainyard")
        paths = prepare_project(tmp_path / "project", settings)
        run_params = params(
            model={"name": "tests_support:slow_mlp", "options": {}},
            train={"epochs": 12, "strategy": strategy},
            checkpoint={
                "every_n_steps": 5,
                "upload_backoff_s": 0.2,
                "upload_backoff_max_s": 1.0,
                "max_staged": 3,
            },
        )
        record = save_run(store, "outage", run_params)
        job, thread = train(paths, store, record)
        wait_for(lambda: committed_steps(store, "outage"), what="a first committed checkpoint")
        progress = AttemptLog(paths.staging / "outage").counter
        step_at_outage = progress.value
        server.down()

        def retries() -> int:
            return sum("failed (attempt" in line for line in list(job.lines))

        # Longer than one upload's retries: several backed-off attempts fail.
        wait_for(lambda: retries() >= 4, what="uploads retrying while the store is down")
        step_in_outage = progress.value
        # A blocking upload would stop training at the first save of the outage; more than
        # max_staged x every_n_steps steps means saves went on without waiting for the store.
        assert step_in_outage - step_at_outage > 3 * 5, "training waited for the store"
        assert any("dropped before upload" in line for line in job.lines)
        assert server.up().endpoint == state.endpoint
        thread.join(timeout=600)
        assert job.error is None, "\n".join(job.lines[-80:])

        training = store.read_json("runs/outage/training.json")
        assert training["steps"] == 12 * 20
        kept = committed_steps(store, "outage")
        assert [store.uri(checkpoint_key("outage", s)) for s in kept] == training["checkpoints"]
        assert kept[-1] == 240 and len(kept) >= 3
        assert max(kept[:-1]) > step_at_outage  # checkpoints made during the outage committed
        for step in kept:  # none is corrupt: every retained one verifies, every shard too
            uri = store.uri(checkpoint_key("outage", step))
            _, manifest = load_checkpoint(store, uri)
            fetch_files(store, uri, manifest, tmp_path / "verified" / str(step))
            if strategy == "fsdp":
                assert "__1_0.distcp" in manifest.files
    finally:
        server.down()
