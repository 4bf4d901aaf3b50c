import numpy as np
import pandas as pd
import pytest

from trainyard.config import DataConfig, SplitConfig
from trainyard.data.split import SPLITS, SplitSchema, prepare_splits
from trainyard.data.tables import write_digits
from trainyard.errors import DataError


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
    return {name: pd.read_csv(out / f"{name}.csv") for name in SPLITS}


def test_split_is_deterministic_for_a_seed(table, tmp_path):
    split(table, tmp_path / "a")
    split(table, tmp_path / "b")
    split(table, tmp_path / "c", seed=8)
    for name in (*[f"{s}.csv" for s in SPLITS], "schema.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "train.csv").read_bytes() != (
        tmp_path / "c" / "train.csv"
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
