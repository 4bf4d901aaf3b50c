"""Which checkpoint a run continues from, and which ones it refuses (real store, real files)."""

from __future__ import annotations

import logging

import pytest
import torch

from trainyard.checkpoint.layout import STATE_FILE, checkpoint_key
from trainyard.checkpoint.reader import latest_committed
from trainyard.checkpoint.resume import (
    ResumePlan,
    ResumeRefused,
    meaning_differences,
    plan_resume,
    plan_warm_start,
)
from trainyard.checkpoint.writer import CheckpointWriter

from conftest import trainyard_cli
from tests_support import manifest_fields

META = {
    "run_id": "a",
    "model": {"name": "mlp", "options": {}, "in_features": 64, "num_classes": 10},
    "dataset_md5": "md5-a",
    "world_size": 2,
    "global_batch_size": 64,
    "strategy": "ddp",
}


def commit(store, tmp_path, run_id, step, **meta):
    writer = CheckpointWriter(store, run_id, tmp_path / "staging")
    state = {"model": {"w": torch.full((2,), float(step))}, "step": step}
    uri = writer.save(step, state, manifest_fields(**{**META, "run_id": run_id, **meta}))
    writer.close()
    return uri


def test_latest_skips_tampered_and_uncommitted_checkpoints_with_a_warning(store, tmp_path, caplog):
    commit(store, tmp_path, "a", 10)
    tampered = commit(store, tmp_path, "a", 20)
    key = store.key_of(tampered)
    store.put_bytes(f"{key}/{STATE_FILE}", store.get_bytes(f"{key}/{STATE_FILE}")[:-7])
    store.put_bytes(f"{checkpoint_key('a', 30)}/{STATE_FILE}", b"never committed")
    with caplog.at_level(logging.WARNING):
        uri, state, manifest = latest_committed(store, "a")
    assert manifest.step == 10 and uri.endswith("step-00000010")
    assert torch.equal(state["model"]["w"], torch.full((2,), 10.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 30" in w and "never committed" in w for w in warnings)
    assert any("step 20" in w and "does not match its manifest" in w for w in warnings)


def test_no_checkpoint_means_a_fresh_start(store):
    assert latest_committed(store, "nothing-here") is None
    assert plan_resume(store, "nothing-here", META, "auto") is None


def test_own_checkpoints_are_continued_or_refused_by_checkpoint_resume(store, tmp_path):
    commit(store, tmp_path, "a", 10)
    plan = plan_resume(store, "a", META, "auto")
    assert plan.step == 10 and plan.source_run == "a" and not plan.warm_start
    with pytest.raises(ResumeRefused, match="already has committed checkpoints.*'never'"):
        plan_resume(store, "a", META, "never")


def test_resume_from_another_run_needs_the_same_dataset_and_model(store, tmp_path):
    commit(store, tmp_path, "old", 40)
    plan = plan_resume(store, "new", {**META, "run_id": "new"}, "auto", resume_from="old")
    assert plan.source_run == "old" and plan.step == 40
    with pytest.raises(
        ResumeRefused, match=r"dataset md5 md5-a, this run uses md5-b: an exact resume needs"
    ):
        plan_resume(store, "new", {**META, "dataset_md5": "md5-b"}, "auto", resume_from="old")
    other_model = {**META["model"], "options": {"hidden_sizes": [8]}}
    with pytest.raises(
        ResumeRefused,
        match=r"was made for another model \(options=\{\} there, \{'hidden_sizes': \[8\]\} here\)",
    ):
        plan_resume(store, "new", {**META, "model": other_model}, "auto", resume_from="old")
    with pytest.raises(ResumeRefused, match="has no committed checkpoint"):
        plan_resume(store, "new", META, "auto", resume_from="missing")


def test_exact_resume_may_change_the_world_size_but_not_the_batch_or_strategy_alone(
    store, tmp_path
):
    """Another world size is an exact resume (the workers keep the checkpoint's global
    batch, trainyard.checkpoint.world_change); another global batch at the same world size,
    or another strategy, changes what the run learns and takes --warm-start."""
    commit(store, tmp_path, "old", 40)
    for world_size, global_batch in ((1, 32), (1, 64), (3, 64), (4, 128)):
        other_world = {**META, "world_size": world_size, "global_batch_size": global_batch}
        plan = plan_resume(store, "new", other_world, "auto", resume_from="old")
        assert not plan.warm_start and plan.step == 40
    other_batch = {**META, "global_batch_size": 32}
    with pytest.raises(ResumeRefused, match="global_batch_size 64, this run 32.*--warm-start"):
        plan_resume(store, "new", other_batch, "auto", resume_from="old")
    other_strategy = {**META, "world_size": 1, "strategy": "fsdp"}
    with pytest.raises(ResumeRefused, match="strategy ddp, this run fsdp.*--warm-start"):
        plan_resume(store, "new", other_strategy, "auto", resume_from="old")
    plan = plan_resume(store, "new", other_batch, "auto", resume_from="old", warm_start=True)
    assert plan.warm_start and plan.step == 40


@pytest.mark.parametrize("sync", ["local_sgd", "diloco", "parameter_server"])
def test_replicas_that_train_apart_resume_only_at_their_own_world_size(store, tmp_path, sync):
    """Such a checkpoint holds state of each worker's own (its weights and optimizer, or its
    server's): refused before launch at another world size or under another train.sync
    (one line); the same world size, or a warm start, is fine."""
    run_id = f"apart-{sync}"
    commit(store, tmp_path, run_id, 40, sync=sync)
    same = {**META, "sync": sync}
    assert plan_resume(store, "new", same, "auto", resume_from=run_id).step == 40
    fewer = {**same, "world_size": 1, "global_batch_size": 32}
    with pytest.raises(
        ResumeRefused, match=f"each of its 2 workers \\(train.sync {sync}\\), this run has 1"
    ):
        plan_resume(store, "new", fewer, "auto", resume_from=run_id)
    plan = plan_resume(store, "new", fewer, "auto", resume_from=run_id, warm_start=True)
    assert plan.warm_start and plan.step == 40
    other = "allreduce" if sync == "parameter_server" else "parameter_server"
    with pytest.raises(
        ResumeRefused, match=f"written under train.sync {sync}, this run has {other}"
    ):
        plan_resume(store, "new", {**same, "sync": other}, "auto", resume_from=run_id)


def test_a_checkpoint_of_all_reducing_replicas_seeds_any_sync(store, tmp_path):
    commit(store, tmp_path, "together", 40)
    for sync in ("local_sgd", "diloco", "parameter_server"):
        wanted = {**META, "sync": sync}
        assert plan_resume(store, "new", wanted, "auto", resume_from="together").step == 40


SCHEMA = {  # a split's schema, as checkpoint_meta and the manifests hold it
    "label_column": "label",
    "feature_columns": ["a", "b", "c"],
    "classes": ["0", "1", "2"],
    "feature_mean": [0.0, 0.0, 0.0],
    "feature_std": [1.0, 1.0, 1.0],
    "rows": {"train": 70, "val": 15, "test": 15},
    "kind": "table",
    "target": "class",
}
# The next dataset version: more rows, other statistics, the same columns and classes.
NEWER = {
    **META,
    "run_id": "new",
    "dataset_md5": "md5-b",
    "schema": {
        **SCHEMA,
        "feature_mean": [0.5, 0.1, 0.2],
        "rows": {"train": 80, "val": 17, "test": 17},
    },
}


def test_a_warm_start_may_read_a_new_dataset_version_an_exact_resume_may_not(store, tmp_path):
    """Fine-tuning, and retraining's challenger warm-started from the champion (a registry
    version's checkpoint URI), read newer data than the checkpoint was trained on."""
    uri = commit(store, tmp_path, "champ", 40, schema=SCHEMA)
    plan = plan_resume(store, "new", NEWER, "auto", resume_from="champ", warm_start=True)
    assert plan == ResumePlan(uri, "champ", warm_start=True, step=40)
    assert plan_resume(store, "new", NEWER, "auto", warm_start_from=uri) == plan
    with pytest.raises(ResumeRefused, match=r"dataset md5 md5-a, this run uses md5-b: an exact"):
        plan_resume(store, "new", NEWER, "auto", resume_from="champ")


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({"classes": ["0", "1", "two"]}, "classes: '2' there only; 'two' here only"),
        ({"classes": ["0", "1", "2", "3"]}, "classes: '3' here only"),
        ({"feature_columns": ["c", "b", "a"]}, "feature_columns: the same, in another order"),
        (
            {"target": "value", "classes": []},
            "target='class' there, 'value' here; classes: '0', '1', '2' there only",
        ),
    ],
    ids=["a-class-renamed", "a-class-added", "columns-reordered", "another-target"],
)
def test_a_warm_start_onto_other_inputs_or_outputs_is_refused_in_one_line(
    store, tmp_path, change, differs
):
    uri = commit(store, tmp_path, "champ", 40, schema=SCHEMA)
    other = {**NEWER, "schema": {**NEWER["schema"], **change}}
    with pytest.raises(ResumeRefused) as refused:
        plan_warm_start(
            store, uri, other, source="champion version 3 of m", fix="set retrain.init: scratch"
        )
    assert str(refused.value) == (
        f"champion version 3 of m was trained for other inputs or outputs ({differs}); "
        "its weights would mean other things here: set retrain.init: scratch"
    )


def test_a_warm_start_needs_the_same_model_and_a_committed_checkpoint(store, tmp_path):
    uri = commit(store, tmp_path, "champ", 40, schema=SCHEMA)
    wider = {**NEWER, "model": {**META["model"], "options": {"hidden_sizes": [8]}}}
    with pytest.raises(ResumeRefused, match=r"^checkpoint of run champ was made for another model"):
        plan_warm_start(store, uri, wider)
    missing = uri.replace("step-00000040", "step-00000041")
    with pytest.raises(ResumeRefused, match="holds no committed checkpoint to warm-start from"):
        plan_warm_start(store, missing, NEWER)


def test_a_runs_own_checkpoint_from_other_settings_is_refused(store, tmp_path):
    """The manifest's settings hash covers what a resume may not change."""
    from trainyard.runs.continuation import settings_hash

    stored = {"train": {"lr": 0.05, "epochs": 20}, "tracking": {"backend": "none"}}
    commit(store, tmp_path, "a", 10, settings_hash=settings_hash(stored))
    longer = {"train": {"lr": 0.05, "epochs": 40}, "tracking": {"backend": "comet"}}
    meta = {**META, "settings_hash": settings_hash(longer)}
    assert plan_resume(store, "a", meta, "auto").step == 10  # epochs and tracking may change
    changed = {**META, "settings_hash": settings_hash({"train": {"lr": 0.5, "epochs": 20}})}
    with pytest.raises(ResumeRefused, match="was made with other settings"):
        plan_resume(store, "a", changed, "auto")


def test_warm_start_without_resume_from_is_a_one_line_error(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  workers: 1\n")
    done = trainyard_cli("run", "--warm-start", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "trainyard: error: --warm-start needs --resume-from RUN_ID (the run to take weights from)"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            [],
            "trainyard: error: join is for nodes 1..nnodes-1 (set -S train.nnodes=N "
            "-S train.node_rank=K); node 0 runs `trainyard run`",
        ),
        (
            ["-S", "train.nnodes=2", "-S", "train.node_rank=1"],
            "trainyard: error: override train.node_rank=1: train: "
            "node_rank 1 needs rdzv_endpoint: host:port of node 0's rendezvous, which node 0 "
            "printed or set in this node's flow-run parameters",
        ),
        (
            ["-S", "train.nnodes=2", "-S", "train.node_rank=1", "-S",
             "train.rdzv_endpoint=127.0.0.1:29999", "-S", "data.path=data/raw/mine.csv"],
            "trainyard: error: data.path data/raw/mine.csv is not on this machine ({root}): "
            "every node splits its own copy of the same bytes; `dvc pull` it (or copy it) here "
            "first",
        ),
    ],
)  # fmt: skip
def test_join_needs_a_multi_node_setting_and_says_so_in_one_line(tmp_path, args, line):
    (tmp_path / "params.yaml").write_text("train:\n  workers: 1\n")
    done = trainyard_cli("join", "--run-id", "big-1", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == line.format(root=tmp_path)


def test_a_char_level_warm_start_needs_the_same_character_table_when_both_record_one():
    """Token ids mean characters: another table (same size or not) gives the weights other
    meanings. A schema written before tables were recorded (None) is not told apart."""
    text = {"kind": "tokens", "target": "tokens", "token_level": "char"}
    saved = {**text, "token_chars": ["a", "b", "c"]}
    assert meaning_differences(saved, {**text, "token_chars": ["a", "b", "d"]}) == [
        "token_chars: 'c' there only; 'd' here only"
    ]
    assert meaning_differences(saved, {**text, "token_chars": ["a", "b", "c"]}) == []
    assert meaning_differences(text, {**text, "token_chars": ["a", "b", "c"]}) == []
