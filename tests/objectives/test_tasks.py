"""The task seam: each task's loss and exact metrics, its monitored metric, and a regression
run end to end through `trainyard run` against scikit-learn's own answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from trainyard.checkpoint.layout import MANIFEST_FILE, checkpoint_key, checkpoint_steps
from trainyard.checkpoint.writer import CheckpointWriter
from trainyard.config import CheckpointConfig, TaskConfig
from trainyard.data.split import SplitSchema, read_split_frame
from trainyard.objectives import Classification, Regression, TargetStats, best_by
from trainyard.project import ProjectPaths
from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import trainyard_cli
from tests_support import manifest_fields


def test_regression_metrics_are_sklearns_in_the_targets_own_units():
    rng = np.random.default_rng(0)
    y = rng.normal(150, 40, size=200)
    predicted = y + rng.normal(0, 25, size=200)
    mean, std = 140.0, 38.0  # the training split's, which the model was trained in
    task = Regression(TargetStats(mean=mean, std=std))
    halves = [slice(0, 120), slice(120, 200)]  # two ranks' shares, summed as all-reduce does
    sums = sum(
        task.batch_sums(
            torch.tensor((predicted[part] - mean) / std).unsqueeze(1),
            torch.tensor((y[part] - mean) / std),
        )
        for part in halves
    )
    metrics = task.finish(sums.tolist())
    assert metrics["mse"] == pytest.approx(mean_squared_error(y, predicted))
    assert metrics["mae"] == pytest.approx(mean_absolute_error(y, predicted))
    assert metrics["r2"] == pytest.approx(r2_score(y, predicted))


def test_classification_metrics_and_the_monitored_metrics_direction():
    task = Classification(TargetStats(num_classes=3))
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [2.0, 0.0, 0.0]])
    metrics = task.finish(task.batch_sums(logits, torch.tensor([0, 1, 2, 1])).tolist())
    assert metrics["accuracy"] == 0.75
    assert best_by("monitor", TaskConfig(), task) == ("val_accuracy", "max")
    assert best_by("monitor", TaskConfig(name="regression"), Regression()) == ("val_r2", "max")
    assert best_by("val_loss", TaskConfig(), task) == ("val_loss", "min")
    with pytest.raises(ValueError, match="task.monitor = 'r2': the classification task has no"):
        task.mode("r2")


def test_retention_keeps_the_best_by_the_tasks_direction(store, tmp_path):
    config = CheckpointConfig(keep_last=2, max_staged=10)
    writer = CheckpointWriter(
        store, "mse", tmp_path / "staging", config, best_by=("val_mse", "min")
    )
    for step, mse in {1: 9.0, 2: 1.0, 3: 5.0, 4: 7.0, 5: 8.0}.items():
        writer.save(step, {"step": step}, manifest_fields(metrics={"val_mse": mse}))
    writer.close()
    committed = [
        s
        for s in checkpoint_steps(store, "mse")
        if store.exists(f"{checkpoint_key('mse', s)}/{MANIFEST_FILE}")
    ]
    assert committed == [2, 4, 5]  # the lowest error, and the last two


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("task.name=ranking", "task.name = 'ranking': unknown task"),
        ("task.monitor=r2", "task.monitor = 'r2': the classification task has no such metric"),
        (
            "checkpoint.keep_best_by=val_r2",
            "checkpoint.keep_best_by = 'val_r2': the classification",
        ),
    ],
)
def test_task_settings_that_do_not_fit_are_one_line(project, override, line):
    done = trainyard_cli("run", "-S", override, cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert line in done.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_regression_on_diabetes_reaches_ridge_r2(project, use_store):
    done = trainyard_cli(
        "run",
        "--run-id",
        "diabetes",
        "-S",
        "task.name=regression",
        "-S",
        "data.path=data/raw/diabetes.csv",
        "-S",
        "data.label_column=target",
        "-S",
        "model.name=linear",
        "-S",
        "model.options={}",
        "-S",
        "train.epochs=30",
        "-S",
        "train.batch_size=16",
        "-S",
        "tracking.backend=none",
        cwd=project,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  test r2" in done.stdout
    record = load_record(Store(use_store), "diabetes")
    assert record.monitor["name"] == "r2" and record.monitor["mode"] == "max"
    assert {"test_mse", "test_mae", "test_r2", "val_r2"} <= set(record.metrics)
    assert "test_accuracy" not in record.metrics

    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    schema = SplitSchema.read(folder)
    train, test = (read_split_frame(folder, name, schema) for name in ("train", "test"))
    assert json.loads((folder / "schema.json").read_text())["target"] == "value"
    features = [c for c in train.columns if c != "target"]
    ridge = Ridge(alpha=1.0).fit(train[features], train["target"])
    reference = r2_score(test["target"], ridge.predict(test[features]))
    assert record.metrics["test_r2"] == pytest.approx(reference, abs=0.05)
    listing = trainyard_cli("runs", "list", cwd=project).stdout
    assert f"r2 {record.metrics['test_r2']:.4f}" in listing
