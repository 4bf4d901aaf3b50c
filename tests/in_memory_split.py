"""The in-memory table split that trainyard.data.table_writer replaced, kept as the tests'
reference: the whole table read with pandas, split with scikit-learn, written as CSVs and read
back into tensors. The streaming split must make the same splits and raise the same errors."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import train_test_split

from trainyard.config import DataConfig, SplitConfig
from trainyard.data.split import SCHEMA_FILE, SPLITS, SplitSchema
from trainyard.data.tables import read_table, where_in_file
from trainyard.data.tensors import TensorSplit
from trainyard.errors import DataError
from trainyard.util.files import write_text_atomic


def check_stratifiable(frame: pd.DataFrame, label_column: str, source: Path) -> None:
    """Every class needs a row in each of train, val and test."""
    labels = frame[label_column]
    counts = labels.value_counts()
    too_small = counts[counts < 3]
    if not too_small.empty:
        label = too_small.index[0]
        raise DataError(
            f"{source}: class {label!r} in column '{label_column}' has {too_small.iloc[0]} row(s) "
            f"({where_in_file(source, frame.index[labels == label])}); "
            "a stratified train/val/test split needs at least 3 per class"
        )


def prepare_splits_in_memory(
    data: DataConfig, split: SplitConfig, source: Path, out_dir: Path, target: str = "class"
) -> SplitSchema:
    """`target`: "class" labels (stratified by class) or a numeric "value" (stratified by
    quantile bins of the target, so every split covers its range)."""
    frame = read_table(source, data.label_column, target)
    labels = frame[data.label_column]
    if target == "class":
        check_stratifiable(frame, data.label_column, source)
        strata = labels
    else:
        strata = pd.qcut(
            labels, q=max(2, min(10, len(labels) // 30)), labels=False, duplicates="drop"
        )
    holdout = split.val_fraction + split.test_fraction
    try:
        train, rest = train_test_split(
            frame, test_size=holdout, stratify=strata, random_state=split.seed
        )
        val, test = train_test_split(
            rest,
            test_size=split.test_fraction / holdout,
            stratify=strata.loc[rest.index],
            random_state=split.seed,
        )
    except ValueError as exc:
        raise DataError(f"{source}: cannot split with these fractions ({exc})") from None
    schema = _schema(data, frame, train, val, test, target)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in zip(SPLITS, (train, val, test), strict=True):
        write_text_atomic(out_dir / f"{name}.csv", part.to_csv(index=False))
    write_text_atomic(out_dir / SCHEMA_FILE, json.dumps(asdict(schema), indent=2) + "\n")
    return schema


def _schema(data: DataConfig, frame, train, val, test, target: str) -> SplitSchema:
    """Columns, classes and the training split's statistics, which a model trained on it
    needs again to be applied to new rows."""
    features = train.drop(columns=[data.label_column]).to_numpy(dtype=np.float64)
    std = features.std(axis=0)
    values = train[data.label_column].to_numpy(dtype=np.float64) if target == "value" else None
    return SplitSchema(
        label_column=data.label_column,
        feature_columns=[str(c) for c in frame.columns if c != data.label_column],
        classes=sorted(frame[data.label_column].unique().tolist()) if target == "class" else [],
        feature_mean=features.mean(axis=0).round(8).tolist(),
        # Constant columns (digits has blank border pixels) must not divide by zero.
        feature_std=np.where(std > 1e-12, std, 1.0).round(8).tolist(),
        rows={"train": len(train), "val": len(val), "test": len(test)},
        target=target,
        target_mean=round(float(values.mean()), 8) if values is not None else None,
        target_std=round(float(max(values.std(), 1e-12)), 8) if values is not None else None,
    )


def load_split_in_memory(folder: Path, name: str, schema: SplitSchema) -> TensorSplit:
    frame = pd.read_csv(folder / f"{name}.csv", dtype={schema.label_column: str})
    features = torch.tensor(frame[schema.feature_columns].to_numpy(dtype="float32"))
    mean = torch.tensor(schema.feature_mean, dtype=torch.float32)
    std = torch.tensor(schema.feature_std, dtype=torch.float32)
    if schema.target == "value":  # trained standardized; the task reports original units
        values = frame[schema.label_column].to_numpy(dtype="float64")
        target = (values - schema.target_mean) / schema.target_std
        return TensorSplit((features - mean) / std, torch.tensor(target, dtype=torch.float32))
    index = {label: i for i, label in enumerate(schema.classes)}
    unknown = ~frame[schema.label_column].isin(index)
    if unknown.any():
        path = folder / f"{name}.csv"
        raise DataError(
            f"{path}: label {frame[schema.label_column][unknown].iloc[0]!r} in column '{schema.label_column}' "
            f"({where_in_file(path, frame.index[unknown])}) is not among the {len(schema.classes)} classes "
            "the model was built for; train a model on data that has it"
        )
    labels = torch.tensor([index[v] for v in frame[schema.label_column]], dtype=torch.int64)
    return TensorSplit(features=(features - mean) / std, labels=labels)
