"""Messy data: each problem is one DataError naming the file, the column and the rows."""

import os

import numpy as np
import pandas as pd
import pytest

from trainyard.config import TrainyardConfig
from trainyard.data.tables import read_table
from trainyard.errors import ConfigError, DataError
from trainyard.runs.plan import handed_over, plan_run
from trainyard.runs.preflight import preflight

GOOD = "a,b,label\n1,2,x\n3,4,y\n5,6,x\n"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.csv", "", r"empty\.csv: the file is empty"),
        ("header.csv", "a,b,label\n", r"header\.csv: has a header but no rows"),
        (
            "binary.csv",
            b"\xff\xfe\x00\x81garbage",
            r"binary\.csv: cannot read as CSV \(not UTF-8 text\)",
        ),
        ("text.parquet", "a,b,label\n1,2,x\n", r"text\.parquet: cannot read as Parquet"),
        (
            "nolabel.csv",
            "a,b,lable\n1,2,x\n",
            r"nolabel\.csv: no label column 'label'; did you mean 'lable'\?",
        ),
        (
            "words.csv",
            "a,b,label\n1,2,x\n3,oops,y\n5,6,x\n",
            r"words\.csv: feature column 'b' is not numeric \('oops' at line 3\)",
        ),
        (
            "nan.csv",
            "a,b,label\n1,2,x\n3,,y\n5,6,x\n",
            r"nan\.csv: feature column 'b' has missing, NaN or infinite values at line 3",
        ),
        (
            "inf.csv",
            "a,b,label\n1,inf,x\n3,4,y\n5,-inf,x\n",
            r"inf\.csv: feature column 'b' has missing, NaN or infinite values at line 2, line 4",
        ),
        (
            "dup.csv",
            "a,a,label\n1,2,x\n",
            r"dup\.csv: column name 'a' appears 2 times \(columns 1, 2\)",
        ),
        (
            "nolabels.csv",
            "a,label\n1,x\n2,\n3,y\n",
            r"nolabels\.csv: column 'label' has empty labels at line 3",
        ),
        ("onlylabel.csv", "label\nx\ny\n", r"onlylabel\.csv: no feature columns besides the label"),
    ],
)
def test_bad_tables(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message):
        read_table(path, "label")


@pytest.mark.parametrize("name", ["t.csv", "t.parquet"])
def test_a_column_list_quotes_each_name(tmp_path, name):
    """A comma in a column name ("b,c") cannot be read as two columns."""
    from trainyard.data.table_writer import table_summary

    path = tmp_path / name
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "b,c": [4.0, 5.0, 6.0], "lable": ["x", "y", "x"]})
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)  # the header's "b,c" is quoted as CSV quotes it
    listed = r"\(columns: 'a', 'b,c', 'lable'\); set data\.label_column"
    with pytest.raises(DataError, match=listed):
        read_table(path, "label")
    with pytest.raises(DataError, match=listed):
        table_summary(path, "label", "class")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"missing\.csv: dataset file not found; set data\.path"):
        read_table(tmp_path / "missing.csv", "label")


def test_parquet_rows_are_numbered_from_one(tmp_path):
    path = tmp_path / "t.parquet"
    pd.DataFrame({"a": [1.0, np.nan, 3.0], "label": ["x", "y", "x"]}).to_parquet(path)
    with pytest.raises(
        DataError,
        match=r"t\.parquet: feature column 'a' has missing, NaN or infinite values at row 2",
    ):
        read_table(path, "label")


def test_many_offending_rows_are_summarized(tmp_path):
    path = tmp_path / "many.csv"
    path.write_text("a,label\n" + "".join(f"{'x' if i % 2 else i},c\n" for i in range(40)))
    with pytest.raises(DataError, match=r"line 3, line 5, line 7, line 9, line 11 and 15 more"):
        read_table(path, "label")


def test_good_table_reads_labels_as_text(tmp_path):
    path = tmp_path / "good.csv"
    path.write_text(GOOD)
    frame = read_table(path, "label")
    assert frame["label"].tolist() == ["x", "y", "x"] and frame.shape == (3, 3)


def test_a_single_class_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "one.csv").write_text("a,label\n1,x\n2,x\n3,x\n")
    config = TrainyardConfig.model_validate({"data": {"path": "data/one.csv"}})
    with pytest.raises(DataError, match=r"one\.csv: column 'label' has a single class"):
        preflight(config, tmp_path)


def test_a_run_is_planned_once_and_a_rewritten_file_is_checked_again(tmp_path):
    """`trainyard run` plans, then hands its plan to the flow (deployments start the flow
    alone, which then plans for itself): inside the hand-over the flow's plan for the same
    settings is the command's; outside it, the data is checked again."""
    (tmp_path / "data").mkdir()
    table = tmp_path / "data" / "t.csv"
    table.write_text("a,b,label\n" + "".join(f"{i},{i % 7},{'xy'[i % 2]}\n" for i in range(200)))
    config = TrainyardConfig.model_validate({"data": {"path": "data/t.csv"}})
    first = plan_run(config, tmp_path)
    assert first.report.rows == 200 and first.report.classes == 2
    with handed_over(first):
        assert plan_run(config, tmp_path) is first
        wider = TrainyardConfig.model_validate(
            {"data": {"path": "data/t.csv"}, "model": {"options": {"hidden_sizes": [256]}}}
        )
        assert plan_run(wider, tmp_path).report.parameters != first.report.parameters
    table.write_text("a,b,label\n" + "".join(f"{i},{i % 7},x\n" for i in range(300)))
    with pytest.raises(DataError, match=r"t\.csv: column 'label' has a single class"):
        plan_run(config, tmp_path)


def test_a_symlink_out_of_the_data_folder_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    outside = tmp_path / "elsewhere.csv"
    outside.write_text(GOOD)
    os.symlink(outside, tmp_path / "data" / "link.csv")
    config = TrainyardConfig.model_validate({"data": {"path": "data/link.csv"}})
    with pytest.raises(
        ConfigError, match=r"data\.path = 'data/link\.csv': resolves to .*elsewhere\.csv, outside"
    ):
        preflight(config, tmp_path)


def test_a_damaged_split_folder_is_one_line(tmp_path):
    from trainyard.data.split import SplitSchema
    from trainyard.data.tensors import load_split

    schema = SplitSchema("label", ["a"], ["x", "y"], [0.0], [1.0], {"test": 4})
    with pytest.raises(DataError, match=r"test_y\.npy: cannot read this split array .*prepare"):
        load_split(tmp_path, "test", schema)


@pytest.mark.parametrize(
    ("text", "tokenizer", "held"),
    [("", "char", "0 characters"), ("héllo", "char", "5 characters"), ("héllo", "byte", "6 bytes")],
)
def test_a_corpus_shorter_than_one_window_is_one_line(tmp_path, text, tokenizer, held):
    """An empty corpus has no vocabulary either: refused by name, not by a model of 0 outputs."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text(text, encoding="utf-8")
    config = TrainyardConfig.model_validate(
        {
            "data": {"path": "data/corpus.txt", "context": 8, "tokenizer": tokenizer},
            "model": {"name": "transformer", "options": {"layers": 1, "heads": 2, "width": 8}},
            "task": {"name": "language_model"},
        }
    )
    with pytest.raises(DataError, match=rf"corpus\.txt: the corpus holds {held}, less than one "):
        preflight(config, tmp_path)


def test_an_image_class_the_split_cannot_share_out_is_named_before_the_split():
    """3 images pass the first cut; the split sets 1 aside, and val and test need one each.
    Without the split's settings (a worker reading prepared data) only the first cut holds."""
    from pathlib import Path

    from trainyard.config import SplitConfig
    from trainyard.data.prepared import image_classes

    labels = np.array(["cat"] * 50 + ["dog"] * 50 + ["owl"] * 3)
    with pytest.raises(DataError, match=r"pets: class 'owl' has 3 image\(s\); the stratified "):
        image_classes(labels, Path("pets"), SplitConfig())
    assert image_classes(labels, Path("pets"))[0] == ["cat", "dog", "owl"]
    wider = SplitConfig(val_fraction=0.3, test_fraction=0.3)  # sets 2 aside: one each
    assert image_classes(labels, Path("pets"), wider)[0] == ["cat", "dog", "owl"]
