"""`dvc repro` reproduces training through `trainyard run`, and only it writes metrics.json,
so `dvc metrics diff` compares the metrics of two commits."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainyard.data.tables import write_digits

from conftest import REPO, trainyard_cli

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    # Stage commands call `trainyard`, found on PATH as in `make repro`.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run(
        [str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def _set(root: Path, key: str, value: str) -> None:
    """Edit the `name: value` line of `section.name` in params.yaml, as a user would
    (comments stay; other sections' keys of the same name are left alone)."""
    params = root / "params.yaml"
    section, name = key.split(".")
    block = re.compile(rf"^{section}:.*\n(?:[ \t#].*\n)*", flags=re.M)
    found = block.search(params.read_text())
    assert found, section
    lines, count = re.subn(rf"^(\s+{name}:) [^#\n]*", rf"\1 {value} ", found[0], flags=re.M)
    assert count == 1, key
    text = params.read_text()
    params.write_text(text[: found.start()] + lines + text[found.end() :])


def _commit(root: Path, *force: str) -> None:
    # Forced: the repo tracks metrics.json although .gitignore still names it.
    subprocess.run([*GIT, "add", "-A"], cwd=root, check=True)
    if force:
        subprocess.run([*GIT, "add", "-f", *force], cwd=root, check=True)
    subprocess.run([*GIT, "commit", "-qm", "repro"], cwd=root, check=True)


@pytest.fixture
def repro_project(project: Path) -> Path:
    """The test project plus everything the train stage depends on, committed."""
    for folder in ("flows", "tasks"):  # the train stage's code deps, beside trainyard/
        shutil.copytree(
            REPO / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    # As in a clone: the dataset's .dvc file is committed, its bytes are not. Without it the
    # run's own `dvc add` would wait on the lock `dvc repro` holds on its dependencies.
    for name in ("data/.gitignore", "data/raw/.gitignore", "data/raw/digits.csv.dvc"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, project / name)
    write_digits(project / "data/raw/digits.csv")
    for key, value in [("train.workers", "1"), ("train.epochs", "1"), ("tracking.backend", "none")]:
        _set(project, key, value)
    _commit(project)
    return project


def test_dvc_repro_trains_and_metrics_diff_compares_commits(repro_project: Path):
    root = repro_project
    first = _dvc(root, "repro")
    assert "Running stage 'train'" in first.stdout and "completed in" in first.stdout
    metrics = json.loads((root / "metrics.json").read_text())
    assert metrics["monitor"] == metrics["test_accuracy"] > 0.5
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["train"]
    assert set(lock["params"]["params.yaml"]) == {
        "task",
        "data",
        "split",
        "model",
        "train",
        "checkpoint",
    }
    assert [out["path"] for out in lock["outs"]] == ["metrics.json"]
    assert "up to date" in _dvc(root, "status").stdout
    _commit(root, "metrics.json")

    _set(root, "train.lr", "0.2")
    changed = json.loads(_dvc(root, "status", "--json").stdout)
    assert changed == {"train": [{"changed deps": {"params.yaml": {"train": "modified"}}}]}
    second = _dvc(root, "repro")
    assert "Stage 'prepare' didn't change, skipping" in second.stdout
    diff = json.loads(_dvc(root, "metrics", "diff", "HEAD", "--json").stdout)["metrics.json"]
    new = json.loads((root / "metrics.json").read_text())
    assert diff["test_accuracy"]["old"] == metrics["test_accuracy"]
    assert diff["test_accuracy"]["new"] == new["test_accuracy"]
    assert diff["test_loss"]["old"] != diff["test_loss"]["new"]


def test_metrics_file_in_a_missing_folder_is_refused_before_training(project: Path):
    done = trainyard_cli("run", "--metrics-file", "nowhere/metrics.json", cwd=project)
    assert done.returncode == 2
    assert done.stderr.startswith("trainyard: error: --metrics-file nowhere/metrics.json: folder")
    assert not (project / ".trainyard" / "staging").exists()
