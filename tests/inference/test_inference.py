"""Batch inference against a real store, real torchrun workers and a real registered model:
2 workers score what 1 worker and a direct model call score, row for row; a worker killed
with SIGKILL and a rerun give the uninterrupted output, each row once; bad input is refused
in one line before anything is written."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import torch

from trainyard.checkpoint.loading import load_model
from trainyard.cli import main as cli
from trainyard.data.split import SplitSchema
from trainyard.datasets.images import ChannelStats, write_npz
from trainyard.errors import DataError, TrainyardError
from trainyard.inference.documents import record_key
from trainyard.inference.inputs import open_features, prepare_input
from trainyard.inference.job import ShardScorer, token_texts
from trainyard.inference.readers import open_rows
from trainyard.inference.shards import rank_shards, read_output_manifest
from trainyard.objectives import Classification, LanguageModel, Regression, TargetStats
from trainyard.registry import version_uri
from trainyard.runtime.forked import worker_rank
from trainyard.storage import Store

from conftest import BIN, own_store_project, trainyard_cli

TESTS = str(Path(__file__).resolve().parents[1])
INPUT = "data/raw/digits.csv"  # the training file itself: features plus its label column


@pytest.mark.parametrize("shards, world", [(1, 1), (1, 2), (4, 2), (7, 3), (18, 2), (5, 8)])
def test_ranks_take_contiguous_disjoint_slices_covering_every_shard(shards, world):
    taken = [rank_shards(shards, rank, world) for rank in range(world)]
    assert [k for mine in taken for k in mine] == list(range(shards))
    assert all(mine.step == 1 for mine in taken)
    sizes = [len(mine) for mine in taken]
    assert max(sizes) - min(sizes) <= 1


def table_schema(**fields) -> SplitSchema:
    base = dict(
        label_column="label",
        feature_columns=["a", "b"],
        classes=["no", "yes"],
        feature_mean=[1.0, -2.0],
        feature_std=[2.0, 4.0],
        rows={"train": 10, "val": 2, "test": 2},
    )
    return SplitSchema(**(base | fields))


@pytest.mark.parametrize(
    "text, message",
    [
        ("a\n1\n", "missing column 'b' that the model reads"),
        ("a,b,c\n1,2,3\n", "column 'c' is not an input of the model"),
        ("a,b\n1,2\n3,oops\n", "feature column 'b' is not numeric ('oops' at line 3)"),
        ("a,b\n1,2\n,4\n5,6\n7,nan\n", "feature column 'a' has missing, NaN or infinite values at line 3"),
        ("a,b\n", "has a header but no rows"),
        ("", "the file is empty"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_column_and_rows(tmp_path, text, message):
    path = tmp_path / "in.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare_input(path, table_schema(), tmp_path / "cache", tmp_path)
    assert not list((tmp_path / "cache").glob("*")), "nothing is left half-written"


def test_the_label_column_may_be_present_and_columns_are_read_in_the_models_order(tmp_path):
    path = tmp_path / "in.parquet"
    pd.DataFrame({"label": ["x", "y"], "b": [2.0, 4.0], "a": [1.0, 3.0]}).to_parquet(path)
    table = prepare_input(path, table_schema(), tmp_path / "cache", tmp_path)
    assert table.rows == 2 and table.columns == ["a", "b"]
    features = np.fromfile(tmp_path / table.array, dtype=np.float32).reshape(2, 2)
    assert features.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    again = prepare_input(path, table_schema(), tmp_path / "cache", tmp_path)
    assert again == table, "the converted input is found in its cache"


def test_predictions_are_in_the_tasks_own_terms():
    """Classes by name with their probabilities; a regression value in the target's units."""
    linear = torch.nn.Linear(2, 2)
    scorer = ShardScorer(linear.eval(), table_schema(), Classification(TargetStats(2)), "cpu")
    block = np.array([[1.0, -2.0], [3.0, 2.0], [5.0, 6.0]], dtype=np.float32)
    table = scorer.score(block, first=10, batch_size=2).to_pandas()
    assert table["row"].tolist() == [10, 11, 12]
    logits = linear(
        (torch.from_numpy(block) - torch.tensor([1.0, -2.0])) / torch.tensor([2.0, 4.0])
    )
    expected = torch.softmax(logits, 1).detach().numpy()
    assert np.allclose(table[["prob_no", "prob_yes"]].to_numpy(), expected, atol=1e-6)
    assert table["prediction"].tolist() == [["no", "yes"][i] for i in expected.argmax(1)]

    value = torch.nn.Linear(2, 1)
    schema = table_schema(classes=[], target="value", target_mean=100.0, target_std=10.0)
    regression = ShardScorer(
        value.eval(), schema, Regression(TargetStats(mean=100.0, std=10.0)), "cpu"
    )
    table = regression.score(block, first=0, batch_size=8).to_pandas()
    assert list(table.columns) == ["row", "prediction"]
    outputs = value(
        (torch.from_numpy(block) - torch.tensor([1.0, -2.0])) / torch.tensor([2.0, 4.0])
    )
    assert np.allclose(
        table["prediction"], outputs.detach().numpy()[:, 0] * 10.0 + 100.0, atol=1e-4
    )


def image_schema() -> SplitSchema:
    return table_schema(
        kind="image",
        feature_columns=[],
        input_shape=[1, 2, 2],
        feature_mean=[3.0],
        feature_std=[2.0],
    )


def test_image_arrays_are_checked_against_the_models_input_shape(tmp_path):
    images = np.arange(12, dtype=np.uint8).reshape(3, 1, 2, 2)
    np.save(tmp_path / "in.npy", images)
    write_npz(tmp_path / "in.npz", x=images, y=np.zeros(3, dtype=np.int64))  # labels ignored
    for name in ("in.npy", "in.npz"):
        table = prepare_input(tmp_path / name, image_schema(), tmp_path / "cache", tmp_path)
        assert table.rows == 3 and table.shape == [1, 2, 2] and table.columns == []
        assert (open_features(tmp_path, table) == images).all()

    np.save(tmp_path / "wide.npy", np.zeros((2, 1, 3, 2)))
    nan = images.astype(np.float32)
    nan[1, 0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    (tmp_path / "in.csv").write_text("a\n1\n")
    for name, message in [
        ("wide.npy", r"shape \(2, 1, 3, 2\); the model reads images of shape \(1, 2, 2\)"),
        ("nan.npy", "NaN or infinite pixels in image 1"),
        ("in.csv", "the model reads images; --input takes a .npy or .npz file"),
    ]:
        with pytest.raises(DataError, match=message):
            prepare_input(tmp_path / name, image_schema(), tmp_path / "cache", tmp_path)


def test_images_are_standardized_per_channel_as_in_training():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
    scorer = ShardScorer(model, image_schema(), Classification(TargetStats(2)), "cpu")
    block = np.random.default_rng(0).random((5, 1, 2, 2), dtype=np.float32) * 16
    table = scorer.score(block, first=0, batch_size=2).to_pandas()
    standardized = ChannelStats((3.0,), (2.0,)).normalize(block)  # what training's reader does
    expected = torch.softmax(model(standardized), 1).detach().numpy()
    assert np.allclose(table[["prob_no", "prob_yes"]].to_numpy(), expected, atol=1e-6)


@pytest.fixture(scope="module")
def registered(tmp_path_factory, s3_server):
    """One real run (1 worker, 1 epoch; scoring is slowed to 0.05 s a batch, so a job lasts
    long enough to be killed), registered as digits version 1 and promoted to champion."""
    with own_store_project(tmp_path_factory, s3_server, "inference") as (root, settings):
        env = {**os.environ, "PYTHONPATH": TESTS}
        done = trainyard_cli(
            "run", "--run-id", "scorer", "-S", "train.workers=1", "-S", "train.epochs=1",
            "-S", "tracking.backend=none", "-S", "model.name=tests_support:slow_to_score_mlp",
            "-S", "model.options={}", cwd=root, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        for args in (("register", "scorer", "--name", "digits"), ("promote", "digits", "1")):
            step = trainyard_cli("models", *args, cwd=root, env=env)
            assert step.returncode == 0, step.stderr[-3000:]
        (root / "out").mkdir()
        yield {"root": root, "env": env, "store": Store(settings), "settings": settings}


def predict(registered, *args: str) -> subprocess.CompletedProcess:
    return trainyard_cli(
        "predict", "--input", INPUT, *args, cwd=registered["root"], env=registered["env"]
    )


def direct_scores(registered) -> tuple[np.ndarray, np.ndarray]:
    """The registered model called directly on the whole file: labels and probabilities."""
    store, root = registered["store"], registered["root"]
    loaded = load_model(store, version_uri(store, "digits", 1), root / "scratch")
    schema = loaded.schema
    frame = pd.read_csv(root / INPUT)
    x = torch.tensor(frame[schema.feature_columns].to_numpy(np.float32))
    x = (x - torch.tensor(schema.feature_mean)) / torch.tensor(schema.feature_std)
    inner = loaded.model.get_submodule("inner")
    inner.eval()  # the same weights, without the test's sleep
    with torch.no_grad():
        probabilities = torch.softmax(inner(x), 1).numpy()
    return np.asarray(schema.classes)[probabilities.argmax(1)], probabilities


@pytest.mark.slow
@pytest.mark.distributed
def test_two_workers_score_what_one_worker_and_a_direct_call_score(registered):
    root, store = registered["root"], registered["store"]
    small = ("-S", "inference.shard_rows=300", "-S", "inference.batch_size=128")
    one = predict(registered, "--model", "digits@champion", "--prediction-id", "one-worker",
                  "--output", "out/one.parquet", "-S", "inference.workers=1", *small)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = predict(registered, "--model", "digits:1", "--output", "out/two.parquet",
                  "-S", "inference.workers=2", *small)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "1797 rows with digits:1 (2 workers" in two.stdout, two.stdout

    one_rows, two_rows = (
        pd.read_parquet(root / "out/one.parquet"),
        pd.read_parquet(root / "out/two.parquet"),
    )
    pd.testing.assert_frame_equal(one_rows, two_rows)  # bit for bit
    assert two_rows["row"].tolist() == list(range(1797))
    labels, probabilities = direct_scores(registered)
    assert (two_rows["prediction"].to_numpy() == labels).all()
    columns = [
        f"prob_{c}"
        for c in load_model(store, version_uri(store, "digits", 1), root / "s2").schema.classes
    ]
    assert np.allclose(two_rows[columns].to_numpy(), probabilities, atol=1e-6)

    prediction_id = two.stdout.split()[1]
    record = store.read_json(record_key(prediction_id))
    assert record["status"] == "completed" and record["rows"] == 1797 and record["world_size"] == 2
    assert record["model"]["version"] == 1 and record["model"]["run_id"] == "scorer"
    assert record["input"]["md5"] == hashlib.md5((root / INPUT).read_bytes()).hexdigest()
    assert record["rows_per_s"] > 0 and record["shards"] == 6
    manifest = read_output_manifest(store, prediction_id)
    assert [s.first_row for s in manifest.shards] == [0, 300, 600, 900, 1200, 1500]
    assert {s.rank for s in manifest.shards} == {0, 1}, "both ranks wrote shards"

    again = predict(
        registered, "--model", "digits@champion", "--output", "out/again.parquet", *small
    )
    assert again.returncode == 0 and again.stdout.split()[1] == prediction_id, again.stdout
    assert "6 of 6 shards reused" in again.stdout, again.stdout
    pd.testing.assert_frame_equal(pd.read_parquet(root / "out/again.parquet"), two_rows)


def worker_pids(job: str) -> list[int]:
    """The prediction job's workers (forked by their torchrun agent, whose command line
    they share: named by their rank, trainyard.runtime.forked)."""
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if (
            "trainyard.runtime.launch" in cmdline
            and "predict" in cmdline
            and job in " ".join(cmdline)
            and worker_rank(proc.pid) is not None
        ):
            pids.append(proc.pid)
    return pids


@pytest.mark.slow
@pytest.mark.distributed
def test_a_worker_killed_then_a_rerun_scores_every_row_once_as_uninterrupted(registered):
    root, store, env = registered["root"], registered["store"], registered["env"]
    args = ["--model", "digits", "--prediction-id", "killed", "--output", "out/killed.parquet",
            "-S", "inference.shard_rows=60", "-S", "inference.batch_size=20",
            "-S", "inference.max_restarts=0"]  # fmt: skip
    command = [str(BIN / "trainyard"), "predict", "--input", INPUT, *args]
    job = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # 30 shards of 3 slowed batches (>= 0.15 s each): each rank needs >= 2 s. Kill one once
    # a few shards are committed, well before its slice is done.
    commits = "predictions/killed/commits"
    deadline = time.monotonic() + 240
    while len(store.list_files(commits)) < 3:
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.05)
    assert read_output_manifest(store, "killed") is None
    victims = worker_pids("predictions/killed/job.json")
    assert victims, "the workers are running"
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = job.communicate(timeout=240)
    assert job.returncode != 0, out[-3000:]
    assert "torchrun exited" in out or "Root Cause" in out, out[-3000:]
    committed_before = len(store.list_files(commits))
    assert 3 <= committed_before < 30
    assert store.read_json(record_key("killed"))["status"] == "failed"

    rerun = trainyard_cli("predict", "--input", INPUT, *args, cwd=root, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    record = store.read_json(record_key("killed"))
    assert record["status"] == "completed" and record["shards_reused"] == committed_before
    rows = pd.read_parquet(root / "out/killed.parquet")
    assert rows["row"].is_unique and rows["row"].tolist() == list(range(1797))
    labels, probabilities = direct_scores(registered)
    assert (rows["prediction"].to_numpy() == labels).all()
    assert np.allclose(rows.iloc[:, 2:].to_numpy(), probabilities, atol=1e-6)
    manifest = read_output_manifest(store, "killed")
    parts = store.list_files("predictions/killed/parts")
    assert sorted(parts) == sorted(s.key for s in manifest.shards), "no orphan part is left"


def test_bad_input_and_unknown_models_exit_2_in_one_line_writing_nothing(
    registered, monkeypatch, capsys
):
    root, store = registered["root"], registered["store"]
    monkeypatch.chdir(root)
    for name, value in registered["settings"].worker_env().items():  # the module's store
        monkeypatch.setenv(name, value)
    before = set(store.list_files("predictions"))
    frame = pd.read_csv(root / INPUT).drop(columns=["pixel_7"])
    frame.to_csv(root / "data" / "bad.csv", index=False)
    cases = [
        (["--model", "digits", "--input", "data/bad.csv"], "missing column 'pixel_7'"),
        (["--model", "digits@nobody", "--input", INPUT], "model 'digits' has no alias 'nobody'"),
        (["--model", "digits:7", "--input", INPUT], "model 'digits' has no version 7"),
        (["--model", "run:ghost", "--input", INPUT], "no run 'ghost'"),
        (["--model", "digits", "--input", INPUT, "--output", "out/x.csv"], "name a .parquet file"),
        (
            ["--model", "digits", "--input", INPUT, "--output", str(root.parent / "x.parquet")],
            "is outside the project",
        ),
        (
            ["--model", "digits", "--input", INPUT, "--output", "../x.parquet"],
            "outside the project",
        ),
        (["--model", "digits", "--input", str(root.parent / "in.csv")], "is outside the project"),
        (["--model", "digits", "--input", INPUT, "-S", "inference.workers=0"], "inference.workers"),
        (["--model", "digits", "--input", "data/nope.csv"], "data/nope.csv: input not found"),
        (["--model", "digits", "--input", "data/nope"], "data/nope: input not found"),
    ]
    for args, message in cases:
        code = cli.main(["predict", *args])
        out, err = capsys.readouterr()
        assert code == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and message in err, err
    assert set(store.list_files("predictions")) == before


@pytest.mark.slow
@pytest.mark.distributed
def test_predict_creates_a_missing_output_folder_inside_the_project_only(
    registered, monkeypatch, capsys
):
    """The README's `--output out/scores.parquet` in a fresh clone: the folders are made, at
    the write; a refused job makes none, and none is made outside the project, in its state
    folders or through a symlink."""
    root = registered["root"]
    monkeypatch.chdir(root)
    for name, value in registered["settings"].worker_env().items():
        monkeypatch.setenv(name, value)
    (root / "exit").symlink_to(root.parent, target_is_directory=True)
    before = sorted(root.parent.iterdir())
    for output, message in [
        ("exit/made/x.parquet", "is outside the project"),
        (".trainyard/made/x.parquet", "holds the project's own state"),
        ("params.yaml/made/x.parquet", "params.yaml is a file, not a folder"),
    ]:
        code = cli.main(["predict", "--model", "digits", "--input", INPUT, "--output", output])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    code = cli.main(
        ["predict", "--model", "digits:7", "--input", INPUT, "--output", "made/x.parquet"]
    )
    assert code == 2 and "no version 7" in capsys.readouterr().err
    assert not (root / "made").exists() and not (root / ".trainyard" / "made").exists()
    assert sorted(root.parent.iterdir()) == before, "nothing made beside the project"

    done = predict(registered, "--model", "digits:1", "--output", "made/today/scores.parquet",
                   "-S", "inference.workers=1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pd.read_parquet(root / "made/today/scores.parquet")
    assert rows["row"].tolist() == list(range(1797))


@pytest.mark.slow
@pytest.mark.distributed
def test_the_flow_itself_keeps_every_path_inside_the_project(registered, prefect_api, monkeypatch):
    """`batch_inference` called as a flow (as a deployment or the API starts it, with no CLI
    before it): an output or input outside the project, a `..` escape, a symlink out of it,
    the project's own state or another project_dir is refused in one line, and nothing is
    written; a good output is written."""
    from flows.inference import batch_inference

    root, store = registered["root"], registered["store"]
    monkeypatch.chdir(root)
    monkeypatch.setenv("PYTHONPATH", TESTS)  # the workers build tests_support's model
    for name, value in registered["settings"].worker_env().items():
        monkeypatch.setenv(name, value)
    outside = root.parent
    victim = outside / "victim.parquet"
    victim.write_bytes(b"not predictions")
    (outside / "elsewhere.csv").write_bytes((root / INPUT).read_bytes())
    (root / "out" / "link").symlink_to(outside, target_is_directory=True)
    (root / "out" / "planted.parquet").symlink_to(victim)
    listing, predictions = sorted(outside.iterdir()), set(store.list_files("predictions"))

    def score(output=None, input=INPUT):
        return batch_inference(
            model="digits:1", input=input, output=output, overrides=["inference.workers=1"]
        )

    def refused(**parameters) -> str:
        with pytest.raises(TrainyardError) as refusal:
            score(**parameters)
        message = str(refusal.value)
        assert len(message.splitlines()) == 1, message
        return message

    for output in [str(victim), "../victim.parquet", "out/../../victim.parquet",
                   "out/link/victim.parquet", "out/planted.parquet"]:  # fmt: skip
        assert "is outside the project" in refused(output=output), output
    assert "holds the project's own state" in refused(output=".trainyard/x.parquet")
    assert "is outside the project" in refused(input=str(outside / "elsewhere.csv"))
    assert victim.read_bytes() == b"not predictions"
    assert sorted(outside.iterdir()) == listing, "nothing written beside the project"
    assert set(store.list_files("predictions")) == predictions, "no job was recorded"

    record = score("out/flow.parquet")
    assert record.status == "completed" and record.rows == 1797
    rows = pd.read_parquet(root / "out" / "flow.parquet")
    labels, _ = direct_scores(registered)
    assert rows["row"].tolist() == list(range(1797)) and (rows["prediction"] == labels).all()


def text_schema(level: str = "char", chars: list[str] | None = None, context: int = 4):
    table = ["\n", " ", "a", "b", "c"] if level == "char" else None
    return table_schema(
        kind="tokens",
        target="tokens",
        label_column="",
        feature_columns=[],
        classes=[],
        feature_mean=[],
        feature_std=[],
        input_shape=[context],
        vocab_size=len(table) if table else 256,
        token_level=level,
        token_chars=chars if chars is not None else table,
    )


def test_text_is_tokenized_in_the_models_own_vocabulary_and_read_in_its_windows(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("abc cab\nba", encoding="utf-8")  # 10 characters: 2 windows of 4 (+1)
    table = prepare_input(path, text_schema(), tmp_path / "cache", tmp_path)
    assert (table.reader, table.rows, table.tokens, table.shape) == ("tokens", 2, 10, [4])
    rows = open_rows(tmp_path, table, text_schema()).read(0, 2)
    ids = {c: i for i, c in enumerate(["\n", " ", "a", "b", "c"])}
    expected = torch.tensor([ids[c] for c in "abc cab\nba"])
    assert rows.inputs.tolist() == [expected[0:4].tolist(), expected[4:8].tolist()]
    assert rows.targets.tolist() == [expected[1:5].tolist(), expected[5:9].tolist()]

    raw = prepare_input(path, text_schema("byte"), tmp_path / "cache", tmp_path)
    assert raw.md5 == table.md5 and raw.array != table.array, "another vocabulary, another key"
    assert open_rows(tmp_path, raw, text_schema("byte")).read(1, 2).inputs.tolist() == [
        list(b"cab\n")
    ]

    for text, message in [
        ("abc\tab", r"character '\\t' at character 3 \(0-based\) is not among the model's 5"),
        ("abca", "holds 4 tokens, less than one window of the model's context \\(4\\) \\+ 1"),
    ]:
        path.write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=message):
            prepare_input(path, text_schema(), tmp_path / "cache2", tmp_path)
        assert not [p for p in (tmp_path / "cache2").glob("**/*") if p.is_file()]
    with pytest.raises(DataError, match="predates trainyard recording its character table"):
        prepare_input(path, text_schema(chars=[]), tmp_path / "cache2", tmp_path)
    (tmp_path / "in.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="the model reads text; --input takes a .txt file"):
        prepare_input(tmp_path / "in.csv", text_schema(), tmp_path / "cache2", tmp_path)


def test_a_language_model_scores_each_window_and_predicts_its_next_token():
    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(5, 5)

        def forward(self, tokens):
            return self.table(tokens)

    model = Bigram().eval()
    schema = text_schema()
    scorer = ShardScorer(model, schema, LanguageModel(TargetStats(5)), "cpu")
    windows = torch.tensor([[2, 3, 4, 1], [4, 2, 3, 0], [3, 3, 3, 3]])
    targets = torch.tensor([[3, 4, 1, 4], [2, 3, 0, 3], [3, 3, 3, 2]])
    table = scorer.score(windows, first=7, batch_size=2, targets=targets).to_pandas()
    assert list(table.columns) == ["row", "prediction", "token", "loss"]
    assert table["row"].tolist() == [7, 8, 9]
    logits = model(windows).detach()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    assert np.allclose(table["loss"], nll.mean(1).numpy(), atol=1e-6)
    assert table["token"].tolist() == logits[:, -1].argmax(1).tolist()
    assert table["prediction"].tolist() == [schema.token_chars[t] for t in table["token"]]
    assert token_texts(text_schema("byte"))[10] == "\n"
    assert token_texts(text_schema("byte"))[200] == "\\xc8"


def test_an_image_folder_is_read_by_file_in_sorted_order(tmp_path):
    folder = tmp_path / "images"
    images = np.arange(12, dtype=np.uint8).reshape(3, 1, 2, 2)
    for name, image in zip(["b/2.npy", "a.npy", "b/10.npy"], images, strict=True):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        np.save(folder / name, image[0])  # H x W grayscale, as training's folders hold
    table = prepare_input(folder, image_schema(), tmp_path / "cache", tmp_path)
    assert table.rows == 3 and table.md5.endswith(".dir")
    rows = open_rows(tmp_path, table, image_schema()).read(0, 3)
    assert rows.named == {"file": ["a.npy", "b/10.npy", "b/2.npy"]}
    assert rows.inputs.numpy().tolist() == images[[1, 2, 0]].astype(np.float32).tolist()
    scorer = ShardScorer(
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval(),
        image_schema(),
        Classification(TargetStats(2)),
        "cpu",
        named=("file",),
    )
    scored = scorer.score(rows.inputs, 0, 2, named=rows.named).to_pandas()
    assert (
        list(scored.columns)
        == scorer.columns
        == ["row", "file", "prediction", "prob_no", "prob_yes"]
    )

    np.save(folder / "c.npy", np.zeros((3, 2)))
    with pytest.raises(DataError, match=r"c.npy: image of shape \(1, 3, 2\); the model reads"):
        prepare_input(folder, image_schema(), tmp_path / "cache", tmp_path)


def test_a_users_dataset_is_read_by_the_models_own_factory(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    path = tmp_path / "points.jsonl"
    path.write_text("".join(f'{{"x": [{i}, {-i}], "label": {i % 3}}}\n' for i in range(7)))
    schema = table_schema(
        kind="table", input_shape=[2], feature_columns=[], feature_mean=[], feature_std=[],
        classes=["0", "1", "2"], dataset="tests_support:points", source="data/points.jsonl",
    )  # fmt: skip
    table = prepare_input(path, schema, tmp_path / "cache", tmp_path)
    assert (table.reader, table.rows, table.shape, table.array) == ("dataset", 7, [2], "")
    assert not (tmp_path / "cache").exists(), "nothing is converted"
    rows = open_rows(tmp_path, table, schema).read(2, 5)
    assert rows.inputs.tolist() == [[2.0, -2.0], [3.0, -3.0], [4.0, -4.0]]
    assert rows.targets is None

    wide = table_schema(**{**dataclasses.asdict(schema), "input_shape": [3]})
    with pytest.raises(DataError, match=r"reads it as table samples of shape \[2\]; the model"):
        prepare_input(path, wide, tmp_path / "cache", tmp_path)
