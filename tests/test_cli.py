"""Bad settings fail before anything is launched or written: one line, exit code 2."""

import pytest
from conftest import trainyard_cli

from trainyard.storage import Store


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["-S", "train.workers=0"],
            "trainyard: error: params.yaml: train.workers = 0: Input should be greater than or equal to 1",
        ),
        (
            ["-S", "model.name=resnet"],
            "trainyard: error: model.name = 'resnet': unknown model; use one of mlp, linear",
        ),
        (
            ["-S", "train.lr=-1"],
            "trainyard: error: params.yaml: train.lr = -1: Input should be greater than 0",
        ),
        (
            ["-S", "train.epoch=3"],
            "trainyard: error: params.yaml: unknown key 'train.epoch'; did you mean 'epochs'?",
        ),
        (["-S", "data.path=data/raw/missing.csv"], "trainyard: error: "),
        (["--run-id", "../escape"], "trainyard: error: run id '../escape' is not valid"),
    ],
)
def test_invalid_run_fails_before_launch_with_one_line_and_exit_2(
    project, store_settings, args, line
):
    done = trainyard_cli("run", *args, cwd=project)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(line)
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert Store(store_settings).list_dirs("runs") == [], "nothing may be written to the store"
    assert not (project / ".trainyard" / "prefect").exists(), "no flow may start"


def test_missing_dataset_names_the_file(project):
    done = trainyard_cli("run", "-S", "data.path=data/raw/missing.csv", cwd=project)
    assert (
        "data/raw/missing.csv: dataset file not found; set data.path in params.yaml" in done.stderr
    )


def test_storage_status_reports_a_stopped_embedded_store(project):
    done = trainyard_cli("storage", "status", cwd=project)
    assert done.returncode == 3 and "not running" in done.stdout
