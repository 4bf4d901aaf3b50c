"""Which row of a streamed table goes to train, val or test: prepare_splits' stratified
split, made on the row numbers and the labels alone (same strata, same seed, same rows)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainyard.config import SplitConfig
from trainyard.data.stratified import NEEDS_3_PER_CLASS, set_aside_too_few
from trainyard.data.table_chunks import ChunkedTable
from trainyard.data.table_labels import Labels
from trainyard.data.tables import where_in_file
from trainyard.errors import DataError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Assignment:
    part: np.ndarray  # int8 per row of the file: its split's position in SPLITS
    picked: dict[str, np.ndarray]  # per split, its rows of the file in prepare_splits' order

    @property
    def rows(self) -> dict[str, int]:
        return {name: len(self.picked[name]) for name in SPLITS}


def check_classes_stratifiable(
    table: ChunkedTable, labels: Labels, split: SplitConfig | None = None
) -> None:
    """Every class goes into train, val and test: at least 3 rows each, and with `split`,
    as many as its fractions need. value_counts orders tied counts by where its (unstable)
    sort leaves them; counting ids in file order hands it the same counts in the same order
    as counting the labels, so the same class is named as split.check_stratifiable names."""
    import pandas as pd

    assert labels.ids is not None, "a class target's labels"
    counts = pd.Series(labels.ids).value_counts()
    too_small = counts[counts < 3]
    if not too_small.empty:
        class_id, why = too_small.index[0], NEEDS_3_PER_CLASS
        hint = _regression_hint(table, labels, len(too_small))
    elif split is not None and (short := set_aside_too_few(np.bincount(labels.ids), split)):
        (class_id, why), hint = short, ""
    else:
        return
    rows = np.flatnonzero(labels.ids == class_id)
    raise DataError(
        f"{table.path}: class {labels.classes[class_id]!r} in column '{table.label}' has "
        f"{len(rows)} row(s) ({where_in_file(table.path, rows)}); {why}{hint}"
    )


def _regression_hint(table: ChunkedTable, labels: Labels, rare_classes: int) -> str:
    """A hint when the classes look like measurements rather than categories: every label is
    a number and most classes are too rare to split (a quantity read as one class per value)."""
    try:
        [float(label) for label in labels.classes]
    except (TypeError, ValueError):
        return ""
    if rare_classes * 2 < len(labels.classes):
        return ""
    return (
        f"; column '{table.label}' holds {len(labels.classes)} distinct numbers: if it is a "
        "quantity, use -S task.name=regression"
    )


def assign_rows(table: ChunkedTable, labels: Labels, split: SplitConfig, target: str) -> Assignment:
    """prepare_splits' split of the row numbers: it depends only on the row count, the
    strata and the seed. Class ids stratify like the labels because they number the classes
    in sorted order, as np.unique inside sklearn does."""
    import pandas as pd

    strata: np.ndarray
    if labels.ids is not None:  # a class target
        check_classes_stratifiable(table, labels)
        strata = labels.ids
    else:
        values = pd.Series(labels.values)
        bins = max(2, min(10, len(values) // 30))
        strata = pd.qcut(values, q=bins, labels=False, duplicates="drop").to_numpy()
    try:
        picked = _split_rows(labels.rows, strata, split)
    except ValueError as exc:
        reason = str(exc)
        if target == "class":  # a class too rare for these fractions, named as preflight does
            check_classes_stratifiable(table, labels, split)
            try:  # else sklearn's message names classes: ask again with their names
                _split_rows(labels.rows, np.asarray(labels.classes, object)[labels.ids], split)
            except ValueError as named:
                reason = str(named)
        raise DataError(f"{table.path}: cannot split with these fractions ({reason})") from None
    part = np.empty(labels.rows, dtype=np.int8)
    for code, rows in enumerate(picked):
        part[rows] = code
    return Assignment(part, dict(zip(SPLITS, picked, strict=True)))


def _split_rows(count: int, strata: np.ndarray, split: SplitConfig) -> tuple[np.ndarray, ...]:
    """prepare_splits' two train_test_split calls, on row numbers instead of the frame."""
    from sklearn.model_selection import train_test_split  # a worker never needs it

    holdout = split.val_fraction + split.test_fraction
    train, rest = train_test_split(
        np.arange(count), test_size=holdout, stratify=strata, random_state=split.seed
    )
    val, test = train_test_split(
        rest,
        test_size=split.test_fraction / holdout,
        stratify=strata[rest],
        random_state=split.seed,
    )
    return train, val, test
