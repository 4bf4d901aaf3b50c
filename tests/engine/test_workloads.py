"""Each built-in task end to end through `trainyard run`, on real bundled data: digits as a
folder of images with the cnn, a character-level transformer on the standard library's
source, and a user's own task and model from a test package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainyard.config import load_config
from trainyard.datasets.images import write_digits_images
from trainyard.datasets.tokens import bigram_entropy, open_tokens
from trainyard.project import ProjectPaths
from trainyard.runs.preflight import preflight
from trainyard.runs.record import load_record
from trainyard.storage import Store
from trainyard.storage.versioning import content_md5

from conftest import trainyard_cli
from tests_support import write_pictures

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def run(project, run_id: str, *overrides: str):
    settings = [arg for override in overrides for arg in ("-S", override)]
    done = trainyard_cli(
        "run", "--run-id", run_id, "-S", "tracking.backend=none", *settings, cwd=project
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def predict(project, model: str, input_file: str, workers: int = 1) -> pd.DataFrame:
    """`trainyard predict` with `model` on `input_file`: the output rows, in input order."""
    out = f"{input_file.replace('/', '_')}.predictions.parquet"
    done = trainyard_cli(
        "predict", "--model", model, "--input", input_file, "--output", out,
        "-S", f"inference.workers={workers}", "-S", "inference.shard_rows=500", cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return pd.read_parquet(project / out)


def write_digits_folder(project: Path) -> None:
    """The bundled digits images (data/raw/digits.npz) also as data/digits/<label>/<i>.npy."""
    npz = project / "data/raw/digits.npz"
    write_digits_images(npz)
    with np.load(npz) as arrays:
        images, labels = arrays["x"], arrays["y"]
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = project / "data/digits" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i:04d}.npy", image[0])  # one H x W grayscale image per file


CNN = ["model.name=cnn", "model.options={}", "train.optimizer=adamw", "train.lr=0.003"]


def test_cnn_on_a_folder_of_digits_images_reaches_97_percent(project, use_store):
    write_digits_folder(project)
    # The array file and the folder are the same data to the model (the .npz is split and
    # trained by torchrun workers in test_workload_resume, kill and resume included).
    reports = [
        preflight(load_config(project / "params.yaml", [f"data.path={path}", *CNN]), project)
        for path in ("data/raw/digits.npz", "data/digits")
    ]
    assert reports[0] == reports[1] and reports[0].rows == 1797
    done = run(project, "digits-cnn", "data.path=data/digits", *CNN, "train.epochs=15")
    record = load_record(Store(use_store), "digits-cnn")
    assert record.metrics["test_accuracy"] >= 0.97, record.metrics
    assert record.monitor == {
        "name": "accuracy",
        "mode": "max",
        "value": record.metrics["test_accuracy"],
    }
    # Versioned by DVC as a directory; the split is addressed by that hash.
    assert record.dataset.dvc_md5 == content_md5(project / "data/digits")
    assert (project / "data/digits.dvc").read_text().count(record.dataset.dvc_md5) == 1
    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    schema = json.loads((folder / "schema.json").read_text())
    assert schema["kind"] == "image" and schema["input_shape"] == [1, 8, 8]
    assert schema["classes"] == [str(d) for d in range(10)] and len(schema["feature_mean"]) == 1
    # Every image is in exactly one split, copied there: workers map these files.
    sizes = [np.load(folder / f"{name}_x.npy", mmap_mode="r").shape[0] for name in schema["rows"]]
    assert sum(sizes) == 1797 == sum(schema["rows"].values())
    assert "test accuracy" in done.stdout

    # Batch inference reads the same folder (any layout): a row per file, in sorted order.
    scored = predict(project, "run:digits-cnn", "data/digits")
    files = sorted(
        p.relative_to(project / "data/digits").as_posix()
        for p in (project / "data/digits").rglob("*.npy")
    )
    assert scored["file"].tolist() == files and scored["row"].tolist() == list(range(1797))
    truth = scored["file"].str.split("/").str[0]
    assert (scored["prediction"] == truth).mean() >= 0.97


def test_cnn_on_png_and_jpeg_folders_of_mixed_sizes_and_modes(project, use_store):
    """Folders as users have them: three sizes, colour, grey, 16-bit, palette and alpha."""
    write_pictures(project / "data/pictures", "png", per_class=16)
    cut = project / "data/pictures/class1/999.png"  # a download that stopped half-way
    data = (project / "data/pictures/class1/000.png").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    settings = ["data.path=data/pictures", *CNN, "train.batch_size=4", "train.epochs=12"]
    failed = trainyard_cli(
        "run", "-S", "tracking.backend=none", *(a for s in settings for a in ("-S", s)),
        cwd=project,
    )  # fmt: skip
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 2 and len(lines) == 1, failed.stderr[-3000:]
    assert "data/pictures/class1/999.png: cannot decode this image" in lines[0]
    assert not (project / ".trainyard").exists()  # found before anything was written

    cut.unlink()
    run(project, "pictures", *settings, "data.augment=flip_crop")
    record = load_record(Store(use_store), "pictures")
    assert record.metrics["test_accuracy"] >= 0.6, record.metrics  # chance: 1/3
    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    arrays = [np.load(folder / f"{name}_x.npy", mmap_mode="r") for name in ("train", "val", "test")]
    assert {(a.dtype, a.shape[1:]) for a in arrays} == {(np.dtype(np.uint8), (3, 12, 12))}
    assert sum(len(a) for a in arrays) == 48

    # New photos, as JPEG: read and normalized to the run's 3 x 12 x 12, a row per file.
    write_pictures(project / "data/new", "jpg", per_class=4, seed=1)
    scored = predict(project, "run:pictures", "data/new")
    assert len(scored) == 12 and scored["file"].iloc[0] == "class0/000.jpg"
    assert (scored["prediction"] == scored["file"].str.split("/").str[0]).mean() >= 0.6

    # A JPEG folder of its own, normalized to a size and channel count asked for.
    write_pictures(project / "data/photos", "jpg", per_class=8)
    run(project, "photos", "data.path=data/photos", *CNN, "train.epochs=1", "train.batch_size=4", "data.image_size=[10,14]", "data.channels=1")  # fmt: skip
    record = load_record(Store(use_store), "photos")
    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    assert np.load(folder / "train_x.npy", mmap_mode="r").shape[1:] == (1, 10, 14)
    assert json.loads((folder / "schema.json").read_text())["input_shape"] == [1, 10, 14]


def test_char_transformer_goes_below_the_corpus_bigram_entropy(project, use_store):
    run(
        project,
        "stdlib-gpt",
        "task.name=language_model",
        "data.path=data/raw/stdlib.txt",
        "data.context=64",
        "model.name=transformer",
        "model.options={layers: 2, heads: 4, width: 64}",
        "train.optimizer=adamw",
        "train.lr=0.003",
        "train.weight_decay=0.01",
        "train.warmup_epochs=0.05",
        "train.epochs=2",
    )
    record = load_record(Store(use_store), "stdlib-gpt")
    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    tokens, meta = open_tokens(folder / "tokens.bin")
    schema = json.loads((folder / "schema.json").read_text())
    train_end = schema["token_cuts"][1]
    # What a perfect bigram model of the training text scores: the transformer, on text it
    # never saw (the corpus's last 15%), must beat it.
    bigram = bigram_entropy(np.asarray(tokens[:train_end]))
    assert meta.level == "char" and 2.0 < bigram < 3.0
    assert record.metrics["test_loss"] < bigram, (record.metrics, bigram)
    assert record.monitor["name"] == "loss" and record.monitor["mode"] == "min"
    assert record.metrics["test_perplexity"] == pytest.approx(np.exp(record.metrics["test_loss"]))
    assert record.metrics["train_tokens_per_s"] > 0

    # Batch inference of the held-out text, 2 workers: each window's loss, averaged, is the
    # test loss evaluation measured on the same windows.
    with open(project / "data/raw/stdlib.txt", encoding="utf-8", newline="") as corpus:
        held_out = corpus.read()[schema["token_cuts"][2] :]  # char level: token i is char i
    with open(project / "held_out.txt", "w", encoding="utf-8", newline="") as out:
        out.write(held_out)
    scored = predict(project, "run:stdlib-gpt", "held_out.txt", workers=2)
    assert len(scored) == schema["rows"]["test"] == (len(held_out) - 1) // 64
    assert scored["loss"].mean() == pytest.approx(record.metrics["test_loss"], rel=1e-4)
    next_chars = [held_out[64 * (row + 1)] for row in scored["row"]]
    assert (scored["prediction"] == next_chars).mean() > 0.3, "better than any one character"
    assert [meta.chars[t] for t in scored["token"]] == scored["prediction"].tolist()
    print(
        f"test loss {record.metrics['test_loss']:.3f} nats "
        f"({record.metrics['test_loss'] / np.log(2):.3f} bits/char), bigram {bigram:.3f}, "
        f"train {record.timings_s['train']:.0f}s, {record.metrics['train_tokens_per_s']:.0f} tok/s"
    )


def test_a_users_own_task_dataset_and_model_train(project, use_store, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # the test package
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    with open(project / "data/raw/points.jsonl", "w") as out:
        for label in rng.integers(0, 3, 600):
            point = centers[label] + rng.normal(0, 0.8, 2)
            out.write(json.dumps({"x": point.tolist(), "label": int(label)}) + "\n")
    run(
        project,
        "user-parts",
        "task.name=tests_support:smoothed_classification",
        "data.dataset=tests_support:points",
        "data.path=data/raw/points.jsonl",
        "model.name=tests_support:spec_mlp",
        "model.options={width: 8}",
        "train.epochs=5",
        "train.batch_size=16",
    )
    record = load_record(Store(use_store), "user-parts")
    assert record.metrics["test_accuracy"] > 0.95, record.metrics
    assert record.dataset.split_rows == {"train": 420, "val": 90, "test": 90}
    folder = ProjectPaths(project).split_cache(record.dataset.split_key)
    rows = [set(np.load(folder / f"{name}_rows.npy").tolist()) for name in ("train", "val", "test")]
    assert set.union(*rows) == set(range(600)) and sum(map(len, rows)) == 600

    # Batch inference reads a file through the model's own data.dataset factory.
    scored = predict(project, "run:user-parts", "data/raw/points.jsonl", workers=2)
    labels = [json.loads(line)["label"] for line in (project / "data/raw/points.jsonl").open()]
    assert scored["row"].tolist() == list(range(600))
    assert (scored["prediction"].astype(int) == labels).mean() > 0.95
