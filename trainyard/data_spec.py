"""What a model factory is told about its data, and what a checkpoint manifest records.

No torch here: the CLI and the flow read specs before any worker starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import PurePath
from typing import Any, Literal, get_args

DataKind = Literal["table", "image", "tokens"]
KINDS: tuple[str, ...] = get_args(DataKind)
TABLE_SUFFIXES = (".csv", ".parquet")
IMAGE_ARRAY_SUFFIXES = (".npy", ".npz")
TEXT_SUFFIXES = (".txt",)
DATA_SUFFIXES = TABLE_SUFFIXES + IMAGE_ARRAY_SUFFIXES + TEXT_SUFFIXES


def data_kind(path: str | PurePath) -> DataKind:
    """What `data.path` holds, from its name alone: a table, images (an array file, or a
    folder: a path without a suffix) or a text corpus read as tokens."""
    suffix = PurePath(path).suffix.lower()
    if suffix in TABLE_SUFFIXES:
        return "table"
    if suffix in TEXT_SUFFIXES:
        return "tokens"
    return "image"


@dataclass(frozen=True)
class DataSpec:
    """The shape of one sample and of the model's output.

    - table:  input_shape (features,)
    - image:  input_shape (channels, height, width)
    - tokens: input_shape (context,), with vocab_size and context set
    num_outputs counts classes, regression outputs, or (tokens) next-token logits.
    """

    kind: DataKind
    input_shape: tuple[int, ...]
    num_outputs: int
    vocab_size: int | None = None
    context: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"DataSpec.kind = {self.kind!r}: use one of {', '.join(KINDS)}")
        # A list from JSON or a numpy shape becomes a plain tuple, so specs compare equal.
        shape = tuple(int(n) for n in self.input_shape)
        object.__setattr__(self, "input_shape", shape)
        if not shape or any(n < 1 for n in shape):
            raise ValueError(f"DataSpec.input_shape = {shape}: needs positive sizes")
        if self.kind == "image" and len(shape) != 3:
            raise ValueError(f"an image spec needs input_shape (C, H, W), got {shape}")
        _check_positive("num_outputs", self.num_outputs, required=True)
        _check_positive("vocab_size", self.vocab_size)
        _check_positive("context", self.context)
        if self.kind == "tokens" and (self.vocab_size is None or self.context is None):
            raise ValueError("a tokens spec needs vocab_size and context")

    @property
    def num_features(self) -> int:
        """Values per sample once flattened (what a tabular model's first layer takes)."""
        return math.prod(self.input_shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: the tuple becomes a list."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            # A manifest from a newer trainyard: refuse rather than drop what it says.
            raise ValueError(f"DataSpec: unknown fields {unknown}; expected {sorted(known)}")
        return cls(**data)


def _check_positive(name: str, value: int | None, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DataSpec.{name} = {value!r}: needs a positive integer")
