"""The input of a prediction (a CSV/Parquet table, or an .npy/.npz image array), checked
against the model's input schema and converted, in one streaming pass, to a float32 array
every rank maps its own slice of.

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
from trainyard.datasets.images import _memmap_npy, memmap_npz_member
from trainyard.errors import DataError
from trainyard.hashing import file_digest
from trainyard.inference.documents import InputTable

INPUT_FORMAT = 1  # bump when the array's bytes change for the same input
ARRAY_FILE = "features.f32"  # rows x sample shape, float32, C order, no header
META_FILE = "input.json"
CHUNK_ROWS = 65_536
CHUNK_BYTES = 16 << 20
SUFFIXES = {"table": (".csv", ".parquet"), "image": (".npy", ".npz")}


def prepare_input(path: Path, schema: SplitSchema, cache: Path, root: Path) -> InputTable:
    """Check `path` against what the model reads and convert it once; DataError names the
    column and the rows of the first problem."""
    _check_predictable(path, schema)
    md5 = file_digest(path, "md5")
    identity = {
        "format": INPUT_FORMAT,
        "md5": md5,
        "columns": schema.feature_columns,
        "shape": schema.input_shape,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache / key
    if not (folder / META_FILE).is_file():
        _build(path, schema, folder, md5)
    table = InputTable.model_validate_json((folder / META_FILE).read_text())
    return table.model_copy(
        update={"path": str(path), "array": str((folder / ARRAY_FILE).relative_to(root))}
    )


def _check_predictable(path: Path, schema: SplitSchema) -> None:
    if schema.kind not in SUFFIXES or schema.dataset is not None or schema.target == "tokens":
        raise DataError(
            f"this model was trained on {schema.dataset or schema.kind} data; batch inference "
            "scores tables (CSV or Parquet) and image arrays (.npy or .npz) with a model "
            "trained on the same kind"
        )
    if path.suffix.lower() not in SUFFIXES[schema.kind]:
        wanted = " or ".join(SUFFIXES[schema.kind])
        raise DataError(f"{path}: the model reads {schema.kind}s; --input takes a {wanted} file")
    if not path.is_file():
        raise DataError(f"{path}: input file not found")


def _build(path: Path, schema: SplitSchema, folder: Path, md5: str) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        convert = _convert_images if schema.kind == "image" else _convert
        rows = convert(path, schema, building / ARRAY_FILE)
        table = InputTable(
            path=str(path),
            md5=md5,
            rows=rows,
            columns=schema.feature_columns,
            shape=schema.input_shape or [len(schema.feature_columns)],
            array=ARRAY_FILE,
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


def _convert_images(path: Path, schema: SplitSchema, out: Path) -> int:
    """An .npy of images (N, C, H, W), or an .npz's member x, as the model's input shape."""
    images = memmap_npz_member(path, "x") if path.suffix.lower() == ".npz" else _memmap_npy(path)
    shape = tuple(schema.input_shape or ())
    if images.ndim != 1 + len(shape) or tuple(images.shape[1:]) != shape or not len(images):
        raise DataError(
            f"{path}: holds an array of shape {tuple(images.shape)}; the model reads images of "
            f"shape {shape}, so expected (N, {', '.join(map(str, shape))}) with N >= 1"
        )
    if not (np.issubdtype(images.dtype, np.number) and not np.issubdtype(images.dtype, np.bool_)):
        raise DataError(f"{path}: holds {images.dtype} values; images must be numbers")
    chunk = max(1, CHUNK_BYTES // max(1, images[0].nbytes))
    with out.open("wb") as handle:
        for first in range(0, len(images), chunk):
            block = np.asarray(images[first : first + chunk], dtype=np.float32)
            finite = np.isfinite(block).reshape(len(block), -1).all(axis=1)
            if not finite.all():
                bad = first + np.flatnonzero(~finite)
                shown = ", ".join(str(int(i)) for i in bad[:5])
                raise DataError(
                    f"{path}: NaN or infinite pixels in image {shown} (0-based); fix those images"
                )
            handle.write(np.ascontiguousarray(block))
    return len(images)


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
    """The converted input as rows x sample shape float32, mapped (nothing is read yet)."""
    shape = table.shape or [len(table.columns)]
    return np.memmap(root / table.array, dtype=np.float32, mode="r", shape=(table.rows, *shape))
