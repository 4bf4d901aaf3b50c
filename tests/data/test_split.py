import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainyard.config import DataConfig, SplitConfig
from trainyard.data import split as split_module
from trainyard.data.split import (
    DIGEST_FILE,
    SPLITS,
    SplitSchema,
    prepare_cached_splits,
    prepare_splits,
    read_split_frame,
    split_key,
)
from trainyard.data.tables import write_digits
from trainyard.errors import ConfigError, DataError
from trainyard.project import ProjectPaths
from trainyard.storage.versioning import content_md5


@pytest.fixture
def table(tmp_path):
    """Imbalanced string labels and a unique row id, so rows can be traced across splits."""
    rng = np.random.default_rng(0)
    labels = ["cat"] * 300 + ["dog"] * 150 + ["emu"] * 50
    frame = pd.DataFrame({"row_id": np.arange(500), "x": rng.normal(size=500), "species": labels})
    path = tmp_path / "animals.csv"
    frame.to_csv(path, index=False)
    return path


def split(table, out, seed=7):
    return prepare_splits(
        DataConfig(path="data/animals.csv", label_column="species"),
        SplitConfig(seed=seed),
        table,
        out,
    )


def read(out):
    schema = SplitSchema.read(out)
    return {name: read_split_frame(out, name, schema) for name in SPLITS}


def test_split_is_deterministic_for_a_seed(table, tmp_path):
    split(table, tmp_path / "a")
    split(table, tmp_path / "b")
    split(table, tmp_path / "c", seed=8)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(
        [f"{s}_{part}.npy" for s in SPLITS for part in ("x", "y", "order")] + ["schema.json"]
    )
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "train_x.npy").read_bytes() != (
        tmp_path / "c" / "train_x.npy"
    ).read_bytes()


def test_splits_are_disjoint_cover_the_dataset_and_are_stratified(table, tmp_path):
    schema = split(table, tmp_path / "out")
    parts = read(tmp_path / "out")
    ids = [set(parts[name]["row_id"]) for name in SPLITS]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert ids[0] | ids[1] | ids[2] == set(range(500))
    assert schema.rows == {name: len(parts[name]) for name in SPLITS}
    assert schema.classes == ["cat", "dog", "emu"]
    for name in SPLITS:
        share = parts[name]["species"].value_counts(normalize=True)
        assert share["cat"] == pytest.approx(0.6, abs=0.02)
        assert share["emu"] == pytest.approx(0.1, abs=0.02)


def test_schema_round_trips_and_standardizes_with_training_statistics(table, tmp_path):
    schema = split(table, tmp_path / "out")
    assert SplitSchema.read(tmp_path / "out") == schema
    train = read(tmp_path / "out")["train"]
    assert schema.feature_mean[1] == pytest.approx(train["x"].mean(), abs=1e-6)


def test_a_class_too_small_to_stratify_is_named(tmp_path):
    path = tmp_path / "tiny.csv"
    pd.DataFrame({"x": range(12), "label": ["a"] * 10 + ["b"] * 2}).to_csv(path, index=False)
    with pytest.raises(
        DataError, match=r"class 'b' in column 'label' has 2 row\(s\) \(line 12, line 13\)"
    ):
        prepare_splits(DataConfig(path="data/tiny.csv"), SplitConfig(), path, tmp_path / "out")


def test_bundled_digits_are_byte_stable(tmp_path):
    write_digits(tmp_path / "a.csv")
    write_digits(tmp_path / "b.csv")
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    frame = pd.read_csv(tmp_path / "a.csv")
    assert frame.shape == (1797, 65) and frame["label"].nunique() == 10


def test_the_split_key_changes_with_what_the_split_depends_on():
    data, settings = DataConfig(path="data/a.csv", label_column="species"), SplitConfig(seed=7)
    key = split_key("a" * 32, data, settings)
    assert key == split_key(
        "a" * 32, DataConfig(path="data/b.csv", label_column="species"), settings
    )
    others = [
        split_key("b" * 32, data, settings),
        split_key("a" * 32, DataConfig(path="data/a.csv", label_column="kind"), settings),
        split_key("a" * 32, data, SplitConfig(seed=8)),
        split_key("a" * 32, data, SplitConfig(seed=7, test_fraction=0.3)),
        split_key("a" * 32, data, SplitConfig(seed=7, val_fraction=0.2)),
    ]
    assert len({key, *others}) == 6
    assert ProjectPaths(Path("/p")).split_cache(key) == Path("/p/.trainyard/splits") / key
    with pytest.raises(ConfigError, match="split key '../x' is not valid"):
        ProjectPaths(Path("/p")).split_cache("../x")


def _project_with(table, root):
    (root / "data").mkdir(parents=True)
    shutil.copy(table, root / "data" / "animals.csv")
    return ProjectPaths(root)


def test_a_cached_split_is_built_once_with_the_bytes_of_the_prepare_stage(table, tmp_path):
    paths = _project_with(table, tmp_path / "project")
    data = DataConfig(path="data/animals.csv", label_column="species")
    md5 = content_md5(table)
    first = prepare_cached_splits(paths, data, SplitConfig(seed=7), md5)
    assert first.folder == paths.split_cache(first.key)
    assert first.key == split_key(md5, data, SplitConfig(seed=7))
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in first.folder.iterdir()}
    split(table, tmp_path / "processed")  # what `trainyard prepare` writes
    assert {n: b for n, (b, _) in files.items() if n != DIGEST_FILE} == {
        p.name: p.read_bytes() for p in (tmp_path / "processed").iterdir()
    }

    again = prepare_cached_splits(paths, data, SplitConfig(seed=7), md5)
    assert again == first  # read back, not rebuilt: same files, untouched
    assert files == {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in again.folder.iterdir()}
    other = prepare_cached_splits(paths, data, SplitConfig(seed=7, test_fraction=0.3), md5)
    assert other.key != first.key and other.schema.rows["test"] > first.schema.rows["test"]
    assert sorted(p.name for p in first.folder.parent.iterdir()) == sorted([first.key, other.key])


def test_a_run_that_loses_the_race_to_build_a_split_uses_the_winners(table, tmp_path, monkeypatch):
    """Two runs with the same key build at once: the second rename finds the folder."""
    paths = _project_with(table, tmp_path / "project")
    data = DataConfig(path="data/animals.csv", label_column="species")
    md5 = content_md5(table)
    key = split_key(md5, data, SplitConfig(seed=7))

    def build_then_lose(*args):
        schema = prepare_splits(*args)
        prepare_splits(*args[:3], paths.split_cache(key))  # the other run renames first
        (paths.split_cache(key) / DIGEST_FILE).write_text(
            json.dumps(split_module._digest(paths.split_cache(key)))
        )
        return schema

    monkeypatch.setattr(split_module, "prepare_splits", build_then_lose)
    cached = prepare_cached_splits(paths, data, SplitConfig(seed=7), md5)
    assert cached.key == key and SplitSchema.read(cached.folder) == cached.schema
    assert [p.name for p in cached.folder.parent.iterdir()] == [key]  # no temporary left
