"""Three `trainyard run`s at once in one project: each trains and scores its own split.

Issue 8 item 5: every run wrote and read data/processed, so a run started next to another
evaluated the other's test split, rows of which it had trained on.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from trainyard.data.split import SplitSchema
from trainyard.engine.jobs import evaluation_key
from trainyard.project import ProjectPaths
from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import BIN

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_three_runs_at_once_each_evaluate_their_own_split(project, use_store, tmp_path):
    store = Store(use_store)
    fractions = {"at-once-a": 0.15, "at-once-b": 0.3, "at-once-c": 0.15}
    rates = {"at-once-a": 0.05, "at-once-b": 0.02, "at-once-c": 0.1}
    started = {}
    try:
        for run_id, fraction in fractions.items():
            log = (tmp_path / f"{run_id}.log").open("w")
            started[run_id] = subprocess.Popen(
                [
                    str(BIN / "trainyard"), "run", "--run-id", run_id,
                    "-S", "tracking.backend=none", "-S", "train.epochs=2", "-S", "train.workers=1",
                    "-S", f"split.test_fraction={fraction}", "-S", f"train.lr={rates[run_id]}",
                ],
                cwd=project, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        codes = {run_id: process.wait(timeout=600) for run_id, process in started.items()}
    finally:
        for process in started.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    for run_id, code in codes.items():
        assert code == 0, (tmp_path / f"{run_id}.log").read_text()[-4000:]

    records = {run_id: load_record(store, run_id) for run_id in fractions}
    scored = {run_id: store.read_json(evaluation_key(run_id))["rows"] for run_id in fractions}
    assert scored == {run_id: r.dataset.split_rows["test"] for run_id, r in records.items()}
    for run_id, record in records.items():
        assert record.status == "completed"
        assert record.params["split"]["test_fraction"] == fractions[run_id]
        assert (
            record.params["train"]["lr"] == rates[run_id] and record.metrics["test_accuracy"] > 0.5
        )
        folder = ProjectPaths(project).split_cache(record.dataset.split_key)
        assert SplitSchema.read(folder).rows == record.dataset.split_rows
    a, b, c = (records[f"at-once-{x}"].dataset for x in "abc")
    assert a.split_rows["test"] != b.split_rows["test"] and a.split_key != b.split_key
    assert a.split_key == c.split_key  # the same split settings share one prepared split
    assert a.dvc_md5 == b.dvc_md5 == c.dvc_md5
    accuracies = {records[r].metrics["test_accuracy"] for r in records}
    assert len(accuracies) > 1  # each its own training, not one record copied
    assert not ProjectPaths(project).processed.exists()  # `trainyard prepare`'s, not the runs'
