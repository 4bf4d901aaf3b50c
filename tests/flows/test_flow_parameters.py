"""Flow parameters, whatever starts the flow: paths stay inside the project (the
batch_inference flow's input and output: test_inference.py), and a flow run's `overrides`
tune the run but never choose code to import or where credentials go."""

from __future__ import annotations

import pytest

from tasks.nodes import settings_overrides
from trainyard.config import load_config
from trainyard.config.callers import load_caller_config
from trainyard.errors import ConfigError, TrainyardError
from trainyard.inference.plan import output_target
from trainyard.project import ProjectPaths
from trainyard.runs.confined import (
    flow_project,
    inside_project,
    make_folder_in_project,
    writable_in_project,
)
from trainyard.runs.plan import handed_settings, settings_handed_over

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


def caller_refusal(root, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        load_caller_config(root / "params.yaml", overrides)
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_flow_runs_overrides_tune_the_run_but_never_choose_code_or_credentials(tmp_path):
    """What anyone who can start a deployment run may set: tuning, validated as `-S` is;
    what only params.yaml may say: code to import and where credentials go, however the
    override reaches the key (the key itself, its section, a sweep space over it)."""
    root = make_project(tmp_path / "project")
    tuned = load_caller_config(
        root / "params.yaml", ["train.epochs=1", "train.workers=1", "model.name=linear"]
    )
    assert (tuned.train.epochs, tuned.train.workers, tuned.model.name) == (1, 1, "linear")
    assert load_caller_config(root / "params.yaml", []) == load_config(root / "params.yaml")
    bad = caller_refusal(root, ["train.epochs=many"])
    assert "train.epochs" in bad and "many" in bad
    code = {
        "model.name=tests_support:slow_mlp": "model.name",
        "data.dataset=tests_support:counting_dataset": "data.dataset",
        "task.name=os:system": "task.name",
        "model={name: 'tests_support:slow_mlp'}": "model.name",
        "sweep.space.model.name={type: categorical, choices: ['pkg.mod:f']}": "model.name",
        'sweep.space={"model.name": {"type": "categorical", "choices": ["mlp", "linear"]}}': (
            "model.name"
        ),
    }
    for override, key in code.items():
        message = caller_refusal(root, [override])
        assert f"{key} chooses code to import" in message, override
        assert "put it in the project's params.yaml" in message, override
    for override in ["storage.endpoint=http://10.0.0.9:8333", "storage={bucket: other}",
                     "sweep.storage=postgresql://u@10.0.0.9/db",
                     "sweep.space.storage.bucket={type: categorical, choices: [other]}"]:  # fmt: skip
        assert "chooses where the project's credentials go" in caller_refusal(root, [override])


def test_node_0s_settings_reach_the_other_nodes_flow_runs_as_overrides_they_take(tmp_path):
    """A multi-node run's node 0 hands its settings to the other nodes as JSON-quoted
    overrides (tasks.nodes): a registered model so written is the same tuning as -S's."""
    params = make_project(tmp_path / "project") / "params.yaml"
    mine = load_config(params, ["model.name=linear", "model.options={}", "train.epochs=1"])
    overrides = settings_overrides(mine, load_config(params))
    assert 'model.name="linear"' in overrides
    assert load_caller_config(params, overrides) == mine
    # A sweep's space is keyed by dotted names: it goes whole, as one override.
    space = 'sweep.space={"train.lr": {"type": "categorical", "choices": [0.01, 0.1]}}'
    mine = load_config(params, [space])
    overrides = settings_overrides(mine, load_config(params))
    assert [o.split("=")[0] for o in overrides] == ["sweep.space"]
    assert load_caller_config(params, overrides) == mine


def test_a_flow_takes_the_settings_handed_over_only_with_the_same_overrides(tmp_path):
    config = load_config(make_project(tmp_path / "project") / "params.yaml")
    assert handed_settings([]) is None  # a deployment's run: nothing handed over
    with settings_handed_over(config, ["train.epochs=1"]):
        assert handed_settings(["train.epochs=1"]) is config
        assert "differ from the" in one_line(handed_settings, ["train.epochs=2"])


@pytest.mark.slow
def test_train_and_evaluate_refuses_another_project_dir_before_writing_anything(
    tmp_path, monkeypatch, prefect_api, project
):
    """The four deployed flows take no `project_dir` (they work where they run; Prefect
    refuses the parameter: test_deployments.py); the subflow they share checks its own."""
    from flows.train_and_evaluate import train_and_evaluate
    from trainyard.storage.versioning import DatasetVersion

    other = make_project(tmp_path / "other")
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    config = load_config(project / "params.yaml")
    dataset = DatasetVersion(path=config.data.path, dvc_md5="0" * 32, size=1)
    away = one_line(
        train_and_evaluate, config=config, dataset=dataset, project_dir=str(other), run_id="away"
    )
    assert "is not the project this flow runs in" in away
    resume = one_line(train_and_evaluate, config=config, dataset=dataset, resume_from="../x")
    assert "run id '../x' is not valid" in resume  # a key in the store, checked like run_id
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before
