"""The input table of a prediction, checked against the model's input schema and converted,
in one streaming pass, to a float32 array every rank maps its own slice of.

The array lives in a content-addressed folder (`.trainyard/inputs/<key>/`), keyed by the
file's md5 and the columns read, built beside its place and renamed into it: a rerun, or
the flow after the CLI's check, finds it there and reads nothing again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from trainyard.data.split import SplitSchema
from trainyard.data.table_arrays import _FeatureChecks, _open_table
from trainyard.errors import DataError
from trainyard.hashing import file_digest
from trainyard.inference.documents import InputTable

INPUT_FORMAT = 1  # bump when the array's bytes change for the same input
ARRAY_FILE = "features.f32"  # rows x columns float32, C order, no header
META_FILE = "input.json"
CHUNK_ROWS = 65_536
TABLE_SUFFIXES = (".csv", ".parquet")


def prepare_input(path: Path, schema: SplitSchema, cache: Path, root: Path) -> InputTable:
    """Check `path` against what the model reads and convert it once; DataError names the
    column and the rows of the first problem."""
    _check_predictable(path, schema)
    md5 = file_digest(path, "md5")
    identity = {"format": INPUT_FORMAT, "md5": md5, "columns": schema.feature_columns}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache / key
    if not (folder / META_FILE).is_file():
        _build(path, schema, folder, md5)
    table = InputTable.model_validate_json((folder / META_FILE).read_text())
    return table.model_copy(
        update={"path": str(path), "array": str((folder / ARRAY_FILE).relative_to(root))}
    )


def _check_predictable(path: Path, schema: SplitSchema) -> None:
    if schema.kind != "table" or schema.dataset is not None or schema.target == "tokens":
        raise DataError(
            f"this model was trained on {schema.dataset or schema.kind} data; batch inference "
            "scores tables (CSV or Parquet) with a model trained on a table"
        )
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise DataError(f"{path}: not a .csv or .parquet table; --input takes one of those")
    if not path.is_file():
        raise DataError(f"{path}: input file not found")


def _build(path: Path, schema: SplitSchema, folder: Path, md5: str) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        rows = _convert(path, schema, building / ARRAY_FILE)
        table = InputTable(
            path=str(path), md5=md5, rows=rows, columns=schema.feature_columns, array=ARRAY_FILE
        )
        (building / META_FILE).write_text(table.model_dump_json(indent=2) + "\n")
        try:
            os.rename(building, folder)
        except OSError:  # another process built the same key first: its copy is identical
            if not (folder / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _convert(path: Path, schema: SplitSchema, out: Path) -> int:
    """Stream the feature columns, in the model's order, into `out`; the rows written."""
    table = _open_table(path, schema.label_column, CHUNK_ROWS)
    _check_columns(path, table.columns, schema)
    checks = _FeatureChecks(schema.feature_columns)
    # A CSV is read whole, not by usecols: pandas checks field counts only of a whole read.
    columns = schema.feature_columns if table.parquet else None
    rows = 0
    with out.open("wb") as handle:
        for first, frame in table.chunks(columns):
            block = checks.add(first, frame)
            rows = first + len(frame)
            if block is not None:
                handle.write(np.ascontiguousarray(block, dtype=np.float32))
    if rows == 0:
        raise DataError(f"{path}: has a header but no rows")
    checks.raise_first(table)
    return rows


def _check_columns(path: Path, columns: list[str], schema: SplitSchema) -> None:
    """The model's feature columns, all of them; its label column may be there (scoring a
    labelled file), nothing else may: a column the model never saw is a mistake to hear of."""
    wanted = schema.feature_columns
    present = [str(c) for c in columns]
    missing = [c for c in wanted if c not in present]
    if missing:
        raise DataError(
            f"{path}: missing column {_listed(missing)} that the model reads "
            f"({len(wanted)} columns: {_listed(wanted)}); add it"
        )
    extra = [c for c in present if c not in wanted and c != schema.label_column]
    if extra:
        raise DataError(
            f"{path}: column {_listed(extra)} is not an input of the model "
            f"(it reads {_listed(wanted)}, and ignores its label '{schema.label_column}'); drop it"
        )


def _listed(names: list[str], shown: int = 6) -> str:
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def open_features(root: Path, table: InputTable) -> np.memmap:
    """The converted input as rows x columns float32, mapped (nothing is read yet)."""
    return np.memmap(
        root / table.array, dtype=np.float32, mode="r", shape=(table.rows, len(table.columns))
    )
