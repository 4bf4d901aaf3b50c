"""Bad settings fail before anything is launched or written: one line, exit code 2."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from trainyard.storage import Store

from conftest import trainyard_cli


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["-S", "train.workers=0"],
            "trainyard: error: override train.workers=0: train.workers = 0: Input should be greater "
            "than or equal to 1",
        ),
        (
            ["-S", "model.name=resnet"],
            "trainyard: error: model.name = 'resnet': unknown model; use one of mlp, linear",
        ),
        (
            ["-S", "train.lr=-1"],
            "trainyard: error: override train.lr=-1: train.lr = -1: Input should be greater than 0",
        ),
        (
            ["-S", "train.epoch=3"],
            "trainyard: error: override train.epoch=3: unknown key 'train.epoch'; did you mean "
            "'epochs'?",
        ),
        (["-S", "data.path=data/raw/missing.csv"], "trainyard: error: "),
        (["--run-id", "../escape"], "trainyard: error: run id '../escape' is not valid"),
        # cross-field rules, which need the data or the machine (preflight)
        (
            ["-S", "train.batch_size=700"],
            "trainyard: error: train.batch_size = 700: larger than each worker's shard of the "
            "training split (1257 rows / 2 workers = 628); lower it or use fewer workers",
        ),
        (
            ["-S", "train.device=cuda"],
            "trainyard: error: train.device = 'cuda': no CUDA device is visible; use 'auto' or 'cpu'",
        ),
        (
            ["-S", "split.val_fraction=0.5", "-S", "split.test_fraction=0.45"],
            "trainyard: error: override split.test_fraction=0.45: split: val_fraction + "
            "test_fraction = 0.95; must be "
            "below 0.9",
        ),
        (
            ["-S", "data.path=data/raw/rare.csv"],
            "data/raw/rare.csv: class 'z' in column 'label' has 2 row(s) "
            "(line 5, line 6); a stratified train/val/test split needs at least 3 per class",
        ),
        (  # 3 rows pass the first cut, but the split sets only 1 aside for val and test
            ["-S", "data.path=data/raw/rare3.csv"],
            "data/raw/rare3.csv: class 'w' in column 'label' has 3 row(s) (line 42, line 43, "
            "line 44); the stratified split sets 1 of them aside for val and test, which need "
            "one each; add more of this class, or raise split.val_fraction and "
            "split.test_fraction",
        ),
        (  # linnerud's Pulse read as classes: a measurement, one class per value
            ["-S", "data.path=data/raw/pulse.csv", "-S", "data.label_column=pulse"],
            "a stratified train/val/test split needs at least 3 per class; column 'pulse' "
            "holds 12 distinct numbers: if it is a quantity, use -S task.name=regression",
        ),
    ],
)
def test_invalid_run_fails_before_launch_with_one_line_and_exit_2(
    project, store_settings, args, line
):
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    rows = [
        "a,label",
        *(f"{i},x" for i in range(3)),
        "0.5,z",
        "0.7,z",
        *(f"{i},y" for i in range(3)),
    ]
    (project / "data/raw/rare.csv").write_text("\n".join(rows) + "\n")
    common = [f"{i},{'xy'[i % 2]}" for i in range(40)]
    (project / "data/raw/rare3.csv").write_text(
        "\n".join(["a,label", *common, "1,w", "2,w", "3,w"]) + "\n"
    )
    pulses = [f"{i},{50 + i % 12}" for i in range(20)]
    (project / "data/raw/pulse.csv").write_text("\n".join(["a,pulse", *pulses]) + "\n")
    done = trainyard_cli("run", *args, cwd=project)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("trainyard: error: ")
    assert line.removeprefix("trainyard: error: ") in done.stderr  # data paths are shown in full
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert Store(store_settings).list_dirs("runs") == [], "nothing may be written to the store"
    assert not (project / ".trainyard" / "prefect").exists(), "no flow may start"


def test_prepare_refuses_a_setting_dvc_would_not_know_of(project):
    """`trainyard prepare` is dvc.yaml's stage: data/processed must be what params.yaml
    (recorded in dvc.lock) makes."""
    done = trainyard_cli("prepare", "-S", "split.seed=7", cwd=project)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "-S 'split.seed=7': `trainyard prepare` is dvc.yaml's stage" in done.stderr
    assert not (project / "data" / "processed").exists()


def test_missing_dataset_names_the_file(project):
    done = trainyard_cli("run", "-S", "data.path=data/raw/missing.csv", cwd=project)
    assert (
        "data/raw/missing.csv: dataset file not found; set data.path in params.yaml" in done.stderr
    )


def test_storage_status_reports_a_stopped_embedded_store(project):
    done = trainyard_cli("storage", "status", cwd=project)
    assert done.returncode == 3 and "not running" in done.stdout


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"TRAINYARD_S3_ENDPOINT": "http://127.0.0.1:9"},
            r"cannot reach the artifact store at http://127\.0\.0\.1:9 \(.*\); is it running\?",
        ),
        (
            {"AWS_SECRET_ACCESS_KEY": "sentinel-wrong-secret-42"},
            r"access to bucket 'trainyard' at http://127\.0\.0\.1:\d+ was denied; check AWS_ACCESS_KEY_ID",
        ),
    ],
)
def test_store_problems_fail_at_start_up_without_the_secret(project, store_settings, env, line):

    done = trainyard_cli("run", cwd=project, env={**os.environ, **env})
    assert done.returncode == 2, done.stderr
    assert re.search(line, done.stderr), done.stderr
    assert "sentinel-wrong-secret-42" not in done.stderr + done.stdout
    assert len(done.stderr.strip().splitlines()) == 1
    assert Store(store_settings).list_dirs("runs") == []


def test_missing_bucket_is_named(project, store_settings):
    text = (
        (project / "params.yaml").read_text().replace("bucket: trainyard", "bucket: no-such-bucket")
    )
    (project / "params.yaml").write_text(text)
    done = trainyard_cli("run", cwd=project)
    assert done.returncode == 2
    assert "bucket 'no-such-bucket' not found at http://127.0.0.1:" in done.stderr


def test_secrets_and_local_state_are_git_ignored_and_scanned_before_commits():
    repo = Path(__file__).resolve().parents[2]
    # metrics.json is not private: the dvc train stage writes it and the user commits it.
    private = [".trainyard/s3/credentials.json", ".dvc/config.local", ".venv/x"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *private], cwd=repo, capture_output=True, text=True
    )
    assert sorted(ignored.stdout.split()) == sorted(private)
    hooks = yaml.safe_load((repo / ".pre-commit-config.yaml").read_text())
    hook_ids = {hook["id"] for entry in hooks["repos"] for hook in entry["hooks"]}
    assert {"detect-secrets", "check-added-large-files"} <= hook_ids, hook_ids
