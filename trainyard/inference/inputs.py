"""The input of a prediction, checked against what the model reads and, where workers read
it as an array, converted once in a streaming pass:

- a CSV/Parquet table, an .npy/.npz image array or a folder of image files: float32 rows;
- text, for a language model: token ids in the model's own vocabulary, read in windows;
- any file its `data.dataset` factory reads: nothing is converted, workers call the factory.

A converted input lives in a content-addressed folder (`.trainyard/inputs/<key>/`), keyed by
the input's md5 and what the model reads, built beside its place and renamed into it: a
rerun, or the flow after the CLI's check, finds it there and reads nothing again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import cast

import numpy as np

from trainyard.data.split import SplitSchema
from trainyard.data.table_chunks import open_table
from trainyard.data.table_features import FeatureChecks
from trainyard.data_spec import IMAGE_ARRAY_SUFFIXES, TABLE_SUFFIXES, TEXT_SUFFIXES
from trainyard.datasets.images import (
    FOLDER_SUFFIXES,
    is_image_file,
    memmap_npy,
    memmap_npz_member,
    read_image_file,
)
from trainyard.datasets.tokens import tokenize_file
from trainyard.errors import DataError
from trainyard.inference.documents import InputTable
from trainyard.inference.user_dataset import check_user_dataset
from trainyard.storage.versioning import content_md5

INPUT_FORMAT = 2  # bump when the converted bytes change for the same input
ARRAY_FILE = "features.f32"  # rows x sample shape, float32, C order, no header
TOKEN_FILE = "tokens.bin"  # uint8 or uint16 token ids, as training's token file
NAMES_FILE = "files.json"  # an image folder's files, by row
META_FILE = "input.json"
CHUNK_ROWS = 65_536
CHUNK_BYTES = 16 << 20
SUFFIXES = {"table": TABLE_SUFFIXES, "image": IMAGE_ARRAY_SUFFIXES, "tokens": TEXT_SUFFIXES}


def input_reader(schema: SplitSchema) -> str:
    """How workers read an input for this model (InputTable.reader)."""
    if schema.dataset is not None:
        return "dataset"
    return "tokens" if schema.target == "tokens" else "array"


def prepare_input(path: Path, schema: SplitSchema, cache: Path, root: Path) -> InputTable:
    """Check `path` against what the model reads and convert it once; DataError names the
    column and the rows (or the character, or the image) of the first problem."""
    _check_predictable(path, schema)
    if input_reader(schema) == "dataset":
        return check_user_dataset(path, schema)
    md5 = content_md5(path)
    identity = {
        "format": INPUT_FORMAT,
        "md5": md5,
        "columns": schema.feature_columns,
        "shape": schema.input_shape,
        "tokens": [schema.token_level, schema.token_chars],
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache / key
    if not (folder / META_FILE).is_file():
        _build(path, schema, folder, md5)
    table = InputTable.model_validate_json((folder / META_FILE).read_text())
    update = {"path": str(path), "array": str((folder / table.array).relative_to(root))}
    if table.names:
        update["names"] = str((folder / table.names).relative_to(root))
    return table.model_copy(update=update)


def _check_predictable(path: Path, schema: SplitSchema) -> None:
    if input_reader(schema) == "dataset":
        if not path.exists():
            raise DataError(f"{path}: input not found")
        return
    if schema.kind not in SUFFIXES:
        raise DataError(f"this model reads {schema.kind} data, which batch inference cannot read")
    if schema.token_level == "char" and not schema.token_chars:
        raise DataError(
            "this character-level model's checkpoint predates trainyard recording its "
            "character table; retrain it to predict text with it"
        )
    if not path.exists():
        raise DataError(f"{path}: input not found")
    if schema.kind == "image" and path.is_dir():
        return
    if path.suffix.lower() not in SUFFIXES[schema.kind]:
        wanted = " or ".join(SUFFIXES[schema.kind]) + " file"
        if schema.kind == "image":
            wanted += ", or a folder of images (.png, .jpg, ... or .npy/.pgm)"
        what = {"tokens": "text", "table": "tables", "image": "images"}[schema.kind]
        raise DataError(f"{path}: the model reads {what}; --input takes a {wanted}")
    if not path.is_file():
        raise DataError(f"{path}: not a file; --input takes a file here")


def _build(path: Path, schema: SplitSchema, folder: Path, md5: str) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        table = _convert_any(path, schema, building)
        table = table.model_copy(update={"path": str(path), "md5": md5})
        (building / META_FILE).write_text(table.model_dump_json(indent=2) + "\n")
        try:
            os.rename(building, folder)
        except OSError:  # another process built the same key first: its copy is identical
            if not (folder / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _convert_any(path: Path, schema: SplitSchema, building: Path) -> InputTable:
    """The converted input in `building`, described with paths relative to it."""
    shape = schema.input_shape or [len(schema.feature_columns)]
    described = {"path": "", "md5": "", "columns": schema.feature_columns, "shape": shape}
    if schema.target == "tokens":
        rows, tokens = _convert_text(path, schema, building / TOKEN_FILE)
        return InputTable(**described, rows=rows, array=TOKEN_FILE, reader="tokens", tokens=tokens)
    if schema.kind == "image" and path.is_dir():
        files = _image_files(path)
        rows = _convert_image_folder(path, files, schema, building / ARRAY_FILE)
        (building / NAMES_FILE).write_text(
            json.dumps([f.relative_to(path).as_posix() for f in files])
        )
        return InputTable(**described, rows=rows, array=ARRAY_FILE, names=NAMES_FILE)
    convert = _convert_images if schema.kind == "image" else _convert
    return InputTable(
        **described, rows=convert(path, schema, building / ARRAY_FILE), array=ARRAY_FILE
    )


def _convert(path: Path, schema: SplitSchema, out: Path) -> int:
    """Stream the feature columns, in the model's order, into `out`; the rows written."""
    table = open_table(path, schema.label_column, CHUNK_ROWS)
    _check_columns(path, table.columns, schema)
    checks = FeatureChecks(schema.feature_columns)
    # A CSV is read whole, not by usecols: pandas checks field counts only of a whole read.
    columns = schema.feature_columns if table.parquet else None
    rows = 0
    with out.open("wb") as handle:
        for first, frame in table.chunks(columns):
            block = checks.add(first, frame)
            rows = first + len(frame)
            if block is not None:
                handle.write(np.ascontiguousarray(block, dtype=np.float32).data)
    if rows == 0:
        raise DataError(f"{path}: has a header but no rows")
    checks.raise_first(table)
    return rows


def _convert_images(path: Path, schema: SplitSchema, out: Path) -> int:
    """An .npy of images (N, C, H, W), or an .npz's member x, as the model's input shape."""
    images = memmap_npz_member(path, "x") if path.suffix.lower() == ".npz" else memmap_npy(path)
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
            handle.write(np.ascontiguousarray(block).data)
    return len(images)


def _image_files(folder: Path) -> list[Path]:
    """The folder's images, at any depth, by relative path: row i is the i-th of them."""
    files = [file for file in folder.rglob("*") if is_image_file(file)]
    files.sort(key=lambda file: file.relative_to(folder).as_posix())  # as DVC lists them
    if not files:
        raise DataError(f"{folder}: no images in this folder ({', '.join(FOLDER_SUFFIXES)})")
    return files


def _convert_image_folder(folder: Path, files: list[Path], schema: SplitSchema, out: Path) -> int:
    """Each file as the model reads images: a Pillow file normalized to the run's recorded
    channels and size (as its split was), an .npy/.pgm of exactly that shape."""
    shape = cast("tuple[int, int, int]", tuple(schema.input_shape or ()))  # C x H x W
    with out.open("wb") as handle:
        for file in files:
            image = read_image_file(file, shape)
            pixels = np.asarray(image, dtype=np.float32)
            if not np.isfinite(pixels).all():
                raise DataError(f"{file}: NaN or infinite pixels; fix this image")
            handle.write(np.ascontiguousarray(pixels).data)
    return len(files)


def _convert_text(path: Path, schema: SplitSchema, out: Path) -> tuple[int, int]:
    """The text's tokens in the model's vocabulary; (windows, tokens). Windows are training's:
    non-overlapping, `context` tokens each, the target the same shifted by one."""
    meta = tokenize_file(path, out, schema.token_level or "byte", schema.token_chars)
    context = (schema.input_shape or [0])[0]
    windows = (meta.num_tokens - 1) // context
    if windows < 1:
        raise DataError(
            f"{path}: holds {meta.num_tokens} tokens, less than one window of the model's "
            f"context ({context}) + 1; give it more text"
        )
    return windows, meta.num_tokens


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
    ignored = [schema.label_column, *schema.ignored_columns]  # data.ignore_columns too
    extra = [c for c in present if c not in wanted and c not in ignored]
    if extra:
        raise DataError(
            f"{path}: column {_listed(extra)} is not an input of the model "
            f"(it reads {_listed(wanted)}, and ignores {_listed(ignored)}); drop it"
        )


def _listed(names: list[str], shown: int = 6) -> str:
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def open_features(root: Path, table: InputTable) -> np.memmap:
    """The converted input as rows x sample shape float32, mapped (nothing is read yet)."""
    shape = table.shape or [len(table.columns)]
    return np.memmap(root / table.array, dtype=np.float32, mode="r", shape=(table.rows, *shape))
