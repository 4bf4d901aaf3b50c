"""Flow parameters that name paths stay inside the project, whatever starts the flow: each
flow refuses another project_dir in one line before it reads settings or writes anything
(the batch_inference flow's input and output: test_inference.py)."""

from __future__ import annotations

import pytest

from trainyard.errors import TrainyardError
from trainyard.inference.plan import output_target
from trainyard.project import ProjectPaths
from trainyard.runs.confined import (
    flow_project,
    inside_project,
    make_folder_in_project,
    writable_in_project,
)

from conftest import make_project


def one_line(call, *args, **kwargs) -> str:
    with pytest.raises(TrainyardError) as refused:
        call(*args, **kwargs)
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_path_is_inside_the_project_once_links_and_dots_are_resolved(tmp_path):
    root, outside = tmp_path / "project", tmp_path / "outside"
    (root / "out").mkdir(parents=True)
    outside.mkdir()
    (root / "out" / "up").symlink_to(outside, target_is_directory=True)
    (root / "out" / "file.parquet").symlink_to(outside / "file.parquet")
    (root / "alias").symlink_to(root / "out", target_is_directory=True)
    paths = ProjectPaths(root)
    for escape in [outside / "x.parquet", "../outside/x.parquet", "out/../../x.parquet",
                   "out/up/x.parquet", "out/file.parquet", "/etc/passwd"]:  # fmt: skip
        assert "is outside the project" in one_line(inside_project, paths, escape, "output")
    assert inside_project(paths, "alias/x.parquet", "output") == root / "out" / "x.parquet"
    assert inside_project(paths, root / "out" / "x.parquet", "output") == root / "out/x.parquet"
    for state in [".trainyard/splits/ab12cd34/train.parquet", ".git/x", "out/../.dvc/x"]:
        assert "project's own state" in one_line(writable_in_project, paths, state, "output")


def test_an_output_is_a_parquet_file_in_a_folder_of_the_project(tmp_path):
    paths = ProjectPaths(tmp_path)
    (tmp_path / "out").mkdir()
    assert output_target(paths, "out/x.parquet") == tmp_path / "out" / "x.parquet"
    assert "name a .parquet file" in one_line(output_target, paths, "out/x.csv", "--output")
    (tmp_path / "out" / "dir.parquet").mkdir()
    assert "is a folder" in one_line(output_target, paths, "out/dir.parquet")
    (tmp_path / "file").write_text("")
    assert "is a file, not a folder" in one_line(output_target, paths, "file/new/x.parquet")


def test_a_missing_output_folder_is_made_at_the_write_never_through_a_link(tmp_path):
    root, outside = tmp_path / "project", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    paths = ProjectPaths(root)
    assert output_target(paths, "new/deeper/x.parquet") == root / "new/deeper/x.parquet"
    assert not (root / "new").exists(), "the check alone makes nothing"
    assert output_target(paths, "new/deeper/x.parquet", make_folder=True).parent.is_dir()
    # A link planted after the check (here: given the checked path directly) is not followed.
    (root / "planted").symlink_to(outside, target_is_directory=True)
    message = one_line(make_folder_in_project, paths, root / "planted" / "made", "output")
    assert "cannot create folder" in message and not (outside / "made").exists()


def test_project_dir_must_be_the_folder_the_flow_runs_in(tmp_path, monkeypatch):
    here, other = tmp_path / "here", tmp_path / "other"
    here.mkdir(), other.mkdir()
    (tmp_path / "link").symlink_to(here, target_is_directory=True)
    monkeypatch.chdir(here)
    for same in [".", str(here), str(tmp_path / "link"), "../here"]:
        assert flow_project(same).root == here.resolve()
    for elsewhere in [str(other), "..", "../other", "/"]:
        message = one_line(flow_project, elsewhere)
        assert "is not the project this flow runs in" in message, elsewhere


@pytest.mark.slow
def test_every_flow_refuses_another_project_dir_before_writing_anything(
    tmp_path, monkeypatch, prefect_api, project
):
    """Called as flows (a deployment run calls them so): `project_dir` naming another
    project, one with settings of its own, is refused and that project is left untouched."""
    from flows.inference import batch_inference
    from flows.pipeline import training_pipeline
    from flows.retrain import retrain
    from flows.sweep import hyperparameter_sweep
    from flows.train_and_evaluate import train_and_evaluate
    from trainyard.config import load_config
    from trainyard.storage.versioning import DatasetVersion

    other = make_project(tmp_path / "other")
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    config = load_config(project / "params.yaml")
    dataset = DatasetVersion(path=config.data.path, dvc_md5="0" * 32, size=1)
    calls = {
        "training_pipeline": lambda: training_pipeline(project_dir=str(other), run_id="away"),
        "retrain": lambda: retrain(project_dir=str(other)),
        "hyperparameter_sweep": lambda: hyperparameter_sweep(project_dir=str(other)),
        "train_and_evaluate": lambda: train_and_evaluate(
            config=config, dataset=dataset, project_dir=str(other), run_id="away"
        ),
        "batch_inference": lambda: batch_inference(
            model="trainyard", input="data/raw/digits.csv", project_dir=str(other)
        ),
    }
    for name, call in calls.items():
        assert "is not the project this flow runs in" in one_line(call), name
    resume = one_line(train_and_evaluate, config=config, dataset=dataset, resume_from="../x")
    assert "run id '../x' is not valid" in resume  # a key in the store, checked like run_id
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before
