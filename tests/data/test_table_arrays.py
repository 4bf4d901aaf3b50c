"""The streaming table split (trainyard.data.table_writer) against the in-memory one it
replaces: same rows in each split, same statistics, same tensors, same error messages,
and memory that does not grow with the table."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pytest
import torch
from in_memory_split import load_split_in_memory, prepare_splits_in_memory

from trainyard.config import DataConfig, SplitConfig, TrainyardConfig
from trainyard.data.split import SPLITS
from trainyard.data.table_writer import split_table_to_arrays, table_summary
from trainyard.data.tables import write_diabetes, write_digits
from trainyard.datasets.table_arrays import TableArrays
from trainyard.errors import ConfigError, DataError
from trainyard.runs.preflight import check_classes_fit_split, preflight

REPO = Path(__file__).resolve().parents[2]
SMALL_CHUNKS = 4  # rows per chunk, so that most bad rows sit in a later chunk


def _old_and_new(
    tmp_path, source: Path, label: str, target: Literal["class", "value"], **new_options
):
    data = DataConfig(path=f"data/{source.name}", label_column=label)
    old = prepare_splits_in_memory(data, SplitConfig(), source, tmp_path / "old", target)
    new = split_table_to_arrays(
        source, label, target, SplitConfig(), tmp_path / "new", chunk_rows=97
    )
    arrays = {
        name: TableArrays(
            tmp_path / "new",
            name,
            old.feature_mean,
            old.feature_std,
            old.target_mean,
            old.target_std,
            **new_options,
        )
        for name in SPLITS
    }
    return old, new, arrays


@pytest.mark.parametrize("map_bytes", [64 << 20, 0], ids=["mapped", "read by rows"])
@pytest.mark.parametrize(
    ("name", "write", "label", "target"),
    [
        ("digits.csv", write_digits, "label", "class"),
        ("diabetes.csv", write_diabetes, "target", "value"),
    ],
)
def test_same_split_statistics_and_tensors_as_prepare_splits_in_memory(
    tmp_path, name, write, label, target, map_bytes
):
    source = tmp_path / name
    write(source)
    old, new, arrays = _old_and_new(tmp_path, source, label, target, map_bytes=map_bytes)
    assert new.rows == old.rows and new.feature_columns == old.feature_columns
    assert new.classes == old.classes and new.num_outputs == old.num_outputs
    np.testing.assert_allclose(new.feature_mean, old.feature_mean, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(new.feature_std, old.feature_std, rtol=1e-7, atol=1e-8)
    if target == "value":
        assert new.target_mean == pytest.approx(old.target_mean, rel=1e-9)
        assert new.target_std == pytest.approx(old.target_std, rel=1e-9)
    for split in SPLITS:
        expected = load_split_in_memory(tmp_path / "old", split, old)
        rows = torch.arange(len(expected))
        features, labels = arrays[split].take(rows)
        # Index k is prepare_splits' k-th row of the split: the same rows, in the same order.
        assert torch.equal(features, expected.features) and torch.equal(labels, expected.labels)
        assert features.dtype == torch.float32 and labels.dtype == expected.labels.dtype
        shuffled = torch.randperm(len(expected), generator=torch.Generator().manual_seed(1))
        for got, want in zip(arrays[split].take(shuffled), expected.take(shuffled), strict=True):
            assert torch.equal(got, want)
        assert arrays[split].spec.num_outputs == old.num_outputs
        assert arrays[split].spec.input_shape == (len(old.feature_columns),)


def test_parquet_splits_like_the_same_table_as_csv(tmp_path):
    write_digits(tmp_path / "digits.csv")
    source = tmp_path / "digits.parquet"
    pd.read_csv(tmp_path / "digits.csv").to_parquet(source, row_group_size=300)
    old, new, arrays = _old_and_new(tmp_path, source, "label", "class")
    assert new.rows == old.rows and new.classes == old.classes
    np.testing.assert_allclose(new.feature_std, old.feature_std, rtol=1e-7, atol=1e-8)
    expected = load_split_in_memory(tmp_path / "old", "val", old)
    assert torch.equal(arrays["val"].take(torch.arange(len(expected)))[0], expected.features)


def test_arrays_survive_pickling_and_refuse_out_of_range_rows(tmp_path):
    source = tmp_path / "digits.csv"
    write_digits(source)
    split = split_table_to_arrays(source, "label", "class", SplitConfig(), tmp_path / "out")
    for map_bytes in (64 << 20, 0):
        data = TableArrays(
            tmp_path / "out", "train", split.feature_mean, split.feature_std, map_bytes=map_bytes
        )
        copy = pickle.loads(pickle.dumps(data))
        rows = torch.tensor([5, 0, 5, len(data) - 1])
        for got, want in zip(copy.take(rows), data.take(rows), strict=True):
            assert torch.equal(got, want)
        assert torch.equal(data[3][0], data.take(torch.tensor([3]))[0][0])
        with pytest.raises(IndexError, match="out of range"):
            data.take(torch.tensor([len(data)]))
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(f"{s}_{a}.npy" for s in SPLITS for a in ("x", "y", "order"))


def test_a_missing_split_array_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"train_y\.npy: cannot read this split array"):
        TableArrays(tmp_path, "train", [0.0], [1.0])


# --- bad data: the same message from both paths -------------------------------------------


def _rows(count: int = 24, classes: str = "xyz") -> list[str]:
    return [f"{i},{i % 7},{classes[i % len(classes)]}" for i in range(count)]


def _csv(header: str, rows: list[str], **replaced: str) -> str:
    """`rows` with row i (0-based; it is on line i + 2) replaced by replaced[f"r{i}"]."""
    rows = list(rows)
    for key, row in replaced.items():
        rows[int(key[1:])] = row
    return header + "\n" + "".join(row + "\n" for row in rows)


def _tied_classes() -> str:
    labels = [f"c{k}" for k in range(6) for _ in range(5)]
    labels += [f"t{k}" for k in range(8) for _ in range(2)] + [f"o{k}" for k in range(6)]
    np.random.default_rng(3).shuffle(labels)
    return _csv("a,b,label", [f"{i},{i % 5},{lab}" for i, lab in enumerate(labels)])


def _parquet(column: str, values: list, labels: list | None = None) -> pd.DataFrame:
    labels = labels if labels is not None else ["x", "y", "z"] * (len(values) // 3)
    return pd.DataFrame({"a": np.arange(len(values), dtype=float), column: values, "label": labels})


GOOD_VALUES = [float(i % 7) for i in range(24)]
BAD_TABLES = [
    ("empty.csv", "", "label", "class"),
    ("header.csv", "a,b,label\n", "label", "class"),
    ("binary.csv", b"\xff\xfe\x00\x81garbage", "label", "class"),
    ("text.parquet", "a,b,label\n1,2,x\n", "label", "class"),
    ("nolabel.csv", _csv("a,b,lable", _rows()), "label", "class"),
    ("nolabel_fields.csv", _csv("a,b,lable", _rows(), r15="1,2,3,x"), "label", "class"),
    ("fields.csv", _csv("a,b,label", _rows(), r15="1,2,3,x"), "label", "class"),
    (
        "utf8.csv",
        _csv("a,b,label", _rows(), r17="1,2,\udcff").encode(errors="surrogateescape"),
        "label",
        "class",
    ),
    ("words.csv", _csv("a,b,label", _rows(), r9="9,oops,x", r17="1,nope,z"), "label", "class"),
    ("nan.csv", _csv("a,b,label", _rows(), r13="13,,y"), "label", "class"),
    ("inf.csv", _csv("a,b,label", _rows(), r0="0,inf,x", r17="17,-inf,z"), "label", "class"),
    (
        "many.csv",
        "a,label\n" + "".join(f"{'x' if i % 2 else i},c\n" for i in range(40)),
        "label",
        "class",
    ),
    ("nolabels.csv", _csv("a,b,label", _rows(), r18="18,4,"), "label", "class"),
    ("onlylabel.csv", "label\n" + "x\ny\nz\n" * 6, "label", "class"),
    (
        "bools.csv",
        _csv(
            "a,b,label",
            [f"{i},{['True', 'false', 'TRUE'][i % 3]},{'xyz'[i % 3]}" for i in range(24)],
        ),
        "label",
        "class",
    ),
    (
        "bools_gaps.csv",
        _csv(
            "a,b,label", [f"{i},{['True', 'false', ''][i % 3]},{'xyz'[i % 3]}" for i in range(24)]
        ),
        "label",
        "class",
    ),
    (
        "bools_numbers.csv",
        _csv("a,b,label", _rows(), r2="2,TRUE,z", r13="13,false,y"),
        "label",
        "class",
    ),
    ("first_column.csv", _csv("a,b,label", _rows(), r1="1,word,y", r20=",6,z"), "label", "class"),
    (
        "nan_and_rare.csv",
        _csv("a,b,label", _rows(), r6="6,6,rare", r19="19,inf,y"),
        "label",
        "class",
    ),
    (
        "label_and_fields.csv",
        _csv("a,b,label", _rows(), r2="2,2,", r19="1,2,3,x"),
        "label",
        "class",
    ),
    (
        "continuous.csv",
        _csv("a,b,label", [f"{i},{i % 3},{i * 0.37:.2f}" for i in range(60)]),
        "label",
        "class",
    ),
    ("rare.csv", _csv("a,b,label", _rows(), r10="10,3,rare", r21="21,0,rare"), "label", "class"),
    ("ties.csv", _tied_classes(), "label", "class"),
    ("tiny.csv", _csv("a,b,label", _rows(6, "xy")), "label", "class"),
    ("target.csv", _csv("a,b,v", _rows(), r14="14,0,abc", r19="19,5,inf"), "v", "value"),
    (
        "no_target.csv",
        _csv("a,b,v", [f"{i},{i % 3},{i * 1.5}" for i in range(24)], r11="11,2,"),
        "v",
        "value",
    ),
    (
        "nan_feature.parquet",
        _parquet("b", GOOD_VALUES[:10] + [np.nan] + GOOD_VALUES[11:]),
        "label",
        "class",
    ),
    (
        "text_feature.parquet",
        _parquet(
            "b",
            [str(v) for v in GOOD_VALUES[:3]]
            + ["oops"]
            + [str(v) for v in GOOD_VALUES[4:12]]
            + ["nope"]
            + [str(v) for v in GOOD_VALUES[13:]],
        ),
        "label",
        "class",
    ),
    ("bool_feature.parquet", _parquet("b", [i % 2 == 0 for i in range(24)]), "label", "class"),
    (
        "no_label.parquet",
        _parquet("b", GOOD_VALUES, ["x", "y", "z"] * 3 + [None] + ["x", "y"] * 7),
        "label",
        "class",
    ),
    (
        "rare.parquet",
        _parquet("b", GOOD_VALUES, ["x", "y"] * 10 + ["rare", "x", "y", "rare"]),
        "label",
        "class",
    ),
    ("wrong_label.parquet", _parquet("b", GOOD_VALUES), "lbl", "class"),
    (
        "target.parquet",
        _parquet("b", GOOD_VALUES, [1.5] * 13 + [np.inf] + [2.5] * 10),
        "label",
        "value",
    ),
]
ALSO_MISSING = [("missing.csv", None, "label", "class")]
CASE_NAMES = [case[0] for case in BAD_TABLES + ALSO_MISSING]


def _place(tmp_path: Path, name: str, content) -> Path:
    path = tmp_path / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, pd.DataFrame):
        content.to_parquet(path, row_group_size=5)
    elif content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _outcome(call) -> str:
    """The DataError's message, or 'data ok' when the data passed (preflight may go on to
    refuse the settings for so small a table)."""
    try:
        call()
    except DataError as exc:
        return str(exc)
    except ConfigError:
        pass
    return "data ok"


@pytest.mark.parametrize(
    ("name", "content", "label", "target"), BAD_TABLES + ALSO_MISSING, ids=CASE_NAMES
)
def test_split_errors_match_prepare_splits_in_memory(tmp_path, name, content, label, target):
    path = _place(tmp_path, name, content)
    data = DataConfig(path=f"data/{name}", label_column=label)
    old = _outcome(
        lambda: prepare_splits_in_memory(data, SplitConfig(), path, tmp_path / "old", target)
    )
    out = tmp_path / "new"
    new = _outcome(
        lambda: split_table_to_arrays(
            path, label, target, SplitConfig(), out, chunk_rows=SMALL_CHUNKS
        )
    )
    assert old != "data ok", "every table here is bad"
    assert new == old
    assert not out.exists() or not any(out.iterdir()), "a failed split leaves no files"


@pytest.mark.parametrize(
    ("name", "content", "label", "target"), BAD_TABLES + ALSO_MISSING, ids=CASE_NAMES
)
def test_summary_errors_match_preflight(tmp_path, name, content, label, target):
    path = _place(tmp_path, name, content)
    task = "classification" if target == "class" else "regression"
    config = TrainyardConfig.model_validate(
        {"data": {"path": f"data/{name}", "label_column": label}, "task": {"name": task}}
    )
    old = _outcome(lambda: preflight(config, tmp_path))
    new = _outcome(lambda: summary_and_split_fit(config, path, label, target))
    assert new == old


def summary_and_split_fit(
    config: TrainyardConfig, path: Path, label: str, target: Literal["class", "value"]
) -> None:
    """The streamed summary, then what preflight checks of its figures before launch: that
    every class fits each part of the stratified split (tiny.csv's 2 classes do not)."""
    rows, _, outputs = table_summary(path, label, target, chunk_rows=SMALL_CHUNKS)
    if target == "class":
        check_classes_fit_split(config, rows, outputs, path)


def test_summary_counts_and_refuses_a_single_class(tmp_path):
    write_digits(tmp_path / "digits.csv")
    assert table_summary(tmp_path / "digits.csv", "label", "class", chunk_rows=100) == (
        1797,
        64,
        10,
    )
    one = _place(tmp_path, "one.csv", "a,label\n1,x\n2,x\n3,x\n")
    with pytest.raises(DataError, match=r"one\.csv: column 'label' has a single class"):
        table_summary(one, "label", "class")


def test_labels_spelled_as_numbers_form_the_same_classes(tmp_path):
    labels = ["1", "1.0", "01", "2", "2.0", "3"] * 20
    rows = [f"{i},{i % 5},{label}" for i, label in enumerate(labels)]
    path = _place(tmp_path, "spelled.csv", _csv("a,b,label", rows))
    old, new, arrays = _old_and_new(tmp_path, path, "label", "class")
    assert new.classes == old.classes == ["1", "2", "3"] and new.rows == old.rows
    expected = load_split_in_memory(tmp_path / "old", "train", old)
    assert torch.equal(arrays["train"].take(torch.arange(len(expected)))[1], expected.labels)


# --- memory ----------------------------------------------------------------------------------

MEASURE = """
import json, sys, time
from pathlib import Path
import torch
from trainyard.config import SplitConfig
from trainyard.data.table_writer import split_table_to_arrays
from trainyard.datasets.table_arrays import TableArrays

def peak_mib():
    # VmHWM, not getrusage's ru_maxrss: Linux carries a parent's peak into ru_maxrss across
    # fork and exec, so a child of a large pytest process would report the parent's.
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmHWM:")).split()[1]) / 1024

mode, source, folder = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
baseline, start = peak_mib(), time.perf_counter()
if mode == "split":
    split = split_table_to_arrays(source, "label", "class", SplitConfig(), folder)
    (folder / "stats.json").write_text(json.dumps([split.feature_mean, split.feature_std]))
else:
    mean, std = json.loads((folder / "stats.json").read_text())
    data = TableArrays(folder, "train", mean, std)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    for batch in order.split(4096):
        data.take(batch)
seconds = time.perf_counter() - start
print(json.dumps({"baseline": baseline, "peak": peak_mib(), "seconds": seconds}))
"""


def _write_wide_table(path: Path, rows: int, features: int = 64) -> None:
    """One-digit features and a 5-class label, written as bytes (fast): 2 bytes a value."""
    rng = np.random.default_rng(0)
    text = np.empty((rows, 2 * features + 2), dtype=np.uint8)
    text[:, 0 : 2 * features : 2] = rng.integers(0, 10, (rows, features), np.uint8) + ord("0")
    text[:, 1 : 2 * features : 2] = ord(",")
    text[:, 2 * features] = rng.integers(0, 5, rows, np.uint8) + ord("a")
    text[:, 2 * features + 1] = ord("\n")
    header = ",".join([*(f"f{i}" for i in range(features)), "label"]) + "\n"
    with open(path, "wb") as handle:
        handle.write(header.encode())
        handle.write(text.tobytes())


def _measure(mode: str, source: Path, folder: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, mode, str(source), str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
def test_peak_memory_does_not_grow_with_the_table(tmp_path):
    """A 26 MB and a 104 MB CSV (64 features), split and then read whole, each in a fresh
    process whose baseline includes torch. The old path grows by about 1.4 GB from one to
    the other; the 4x table's train split (140 MB of float32) is read by rows."""
    peaks = {}
    for scale, rows in (("1x", 200_000), ("4x", 800_000)):
        source = tmp_path / f"table_{scale}.csv"
        _write_wide_table(source, rows)
        for mode in ("split", "read"):
            peaks[scale, mode] = _measure(mode, source, tmp_path / f"arrays_{scale}")
        source.unlink()
    print(json.dumps({f"{s} {m}": v for (s, m), v in peaks.items()}, indent=1))
    for mode in ("split", "read"):
        small, large = peaks["1x", mode]["peak"], peaks["4x", mode]["peak"]
        assert large < 1.2 * small, (mode, small, large)


@pytest.mark.parametrize("sep", [";", "\t", "|"])
def test_a_table_written_with_another_separator_splits_as_the_comma_one(tmp_path, sep):
    """A spreadsheet's `;` file (or a tab-separated one) is read by its header's separator:
    the same arrays as the comma-separated file, a quoted field keeping its separator."""
    rows = [f'{i},{(i * 7) % 11}.5,"{"xy"[i % 2]}, {sep}k"' for i in range(60)]
    comma = tmp_path / "comma.csv"
    comma.write_text("a b,c,label\n" + "\n".join(rows) + "\n")
    other = tmp_path / "other.csv"
    frame = pd.read_csv(comma)
    frame.to_csv(other, sep=sep, index=False)
    assert sep in other.read_text().splitlines()[0]
    outputs = {}
    for source in (comma, other):
        summary = table_summary(source, "label", "class", chunk_rows=SMALL_CHUNKS)
        split = split_table_to_arrays(
            source, "label", "class", SplitConfig(), tmp_path / source.stem, chunk_rows=7
        )
        arrays = {n: np.load(tmp_path / source.stem / f"{n}_x.npy") for n in SPLITS}
        outputs[source.stem] = (summary, split.classes, split.feature_columns, arrays)
    (summary, classes, columns, arrays), theirs = outputs["comma"], outputs["other"]
    assert summary == theirs[0] == (60, 2, 2) and classes == theirs[1] == [
        f"x, {sep}k",
        f"y, {sep}k",
    ]
    assert columns == theirs[2] == ["a b", "c"]
    assert all(np.array_equal(arrays[n], theirs[3][n]) for n in SPLITS)


def test_ignored_columns_are_neither_features_nor_checked_and_the_schema_names_them(tmp_path):
    """An id and a free-text note beside the features: left out as if the file lacked them."""
    rows = [f'{i},{i % 5}.5,{(i * 3) % 7},"note, {i}",{"xy"[i % 2]}' for i in range(60)]
    full = tmp_path / "full.csv"
    full.write_text("id,a,b,note,label\n" + "\n".join(rows) + "\n")
    bare = tmp_path / "bare.csv"
    pd.read_csv(full).drop(columns=["id", "note"]).to_csv(bare, index=False)
    ignored = ["id", "note"]
    assert table_summary(full, "label", "class", ignored=ignored) == (60, 2, 2)
    ours = split_table_to_arrays(
        full, "label", "class", SplitConfig(), tmp_path / "ours", ignored=ignored
    )
    theirs = split_table_to_arrays(bare, "label", "class", SplitConfig(), tmp_path / "theirs")
    assert ours.feature_columns == theirs.feature_columns == ["a", "b"]
    assert ours.ignored_columns == ignored and theirs.ignored_columns == []
    for name in SPLITS:
        assert np.array_equal(
            np.load(tmp_path / "ours" / f"{name}_x.npy"),
            np.load(tmp_path / "theirs" / f"{name}_x.npy"),
        )
    with pytest.raises(DataError, match=r"full\.csv: no column 'nte' to ignore \(columns: 'id', "):
        table_summary(full, "label", "class", ignored=["nte"])
    with pytest.raises(DataError, match=r"feature column 'note' is not numeric"):
        table_summary(full, "label", "class", ignored=["id"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"ignore_columns": ["label"]},
            "holds the label column 'label', which training needs",
        ),
        (
            {"path": "data/raw/digits.npz", "ignore_columns": ["id"]},
            "ignore_columns = ['id']: applies to tables, but path 'data/raw/digits.npz' holds "
            "image data",
        ),
    ],
)
def test_ignore_columns_is_a_tables_and_never_the_label(data, message):
    from trainyard.config import config_from_dict

    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"data": data})


def test_predict_takes_an_input_holding_the_columns_training_ignored(tmp_path):
    from trainyard.data.split import SplitSchema
    from trainyard.inference.inputs import _check_columns

    schema = SplitSchema(
        "label", ["a", "b"], ["x", "y"], [0, 0], [1, 1], {}, ignored_columns=["id"]
    )
    _check_columns(tmp_path / "in.csv", ["id", "a", "b"], schema)  # no error
    with pytest.raises(DataError, match=r"column 'note' is not an input of the model \(it reads "):
        _check_columns(tmp_path / "in.csv", ["id", "a", "b", "note"], schema)
