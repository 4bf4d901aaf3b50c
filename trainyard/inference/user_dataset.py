"""An input that the model's own `data.dataset` factory reads: checked against what the
model was trained on, and described as an InputTable; nothing is converted."""

from __future__ import annotations

from pathlib import Path

from trainyard.data.prepared import open_user_dataset
from trainyard.data.split import SplitSchema
from trainyard.errors import DataError
from trainyard.inference.documents import InputTable
from trainyard.storage.versioning import content_md5


def check_user_dataset(path: Path, schema: SplitSchema) -> InputTable:
    """The model's own `data.dataset` factory reads `path`; what it returns must be what the
    model was trained on (kind and sample shape). Nothing is converted."""
    assert schema.dataset is not None  # inputs.input_reader: "dataset" only with a factory
    dataset = open_user_dataset(schema.dataset, path)
    try:
        spec, rows = dataset.spec, len(dataset)
    except Exception as exc:  # the user's code: one line naming it, not a traceback
        raise DataError(
            f"data.dataset = {schema.dataset!r} on {path}: its spec or length failed "
            f"({type(exc).__name__}: {exc})"
        ) from None
    wanted = (schema.kind, list(schema.input_shape or []))
    found = (spec.kind, list(spec.input_shape))
    if found != wanted:
        raise DataError(
            f"{path}: data.dataset = {schema.dataset!r} reads it as {found[0]} samples of shape "
            f"{found[1]}; the model reads {wanted[0]} samples of shape {wanted[1]}"
        )
    if rows < 1:
        raise DataError(f"{path}: data.dataset = {schema.dataset!r} finds no rows in it")
    return InputTable(
        path=str(path),
        md5=content_md5(path),
        rows=rows,
        columns=[],
        array="",
        shape=list(spec.input_shape),
        reader="dataset",
    )
