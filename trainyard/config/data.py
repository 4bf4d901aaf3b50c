"""Where a run's data is and how it is split: the `data` and `split` sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainyard.config.base import Section
from trainyard.data_spec import (
    DATA_SUFFIXES,
    IMAGE_ARRAY_SUFFIXES,
    TABLE_SUFFIXES,
    TEXT_SUFFIXES,
    data_kind,
)
from trainyard.factories import locate_factory

DATA_DIR = "data"
BUNDLED_DIGITS = "data/raw/digits.csv"
MAX_IMAGE_SIDE = 4096  # pixels: a split holds every image at this size, uncompressed


class DataConfig(Section):
    dataset: str | None = Field(
        None,
        description="package.module:factory: your own dataset, called as factory(path) to read "
        "data.path (a trainyard.datasets.MapDataset); default: the built-in reader of its kind",
    )
    path: str = Field(
        BUNDLED_DIGITS,
        description="inside data/: a CSV/Parquet table, an .npy/.npz image array, a folder of "
        "images per class (<class>/<image>: PNG, JPEG, BMP, GIF, TIFF, WebP, .npy, .pgm) or a "
        ".txt corpus (the kind follows from the path), or any file data.dataset reads",
    )
    label_column: str = Field("label", min_length=1)
    ignore_columns: list[str] = Field(
        default_factory=list,
        description="tables: columns that are neither features nor the label (an id, a "
        "note), left out of training; predict's input may hold them too",
    )
    context: int = Field(64, ge=2, le=65536, description="tokens per window (text corpora)")
    tokenizer: Literal["char", "byte"] = Field("char", description="text corpora: token level")
    image_size: tuple[int, int] | None = Field(
        None,
        description="image folders: [height, width] every image is resized to "
        "(null: the most common size in the folder)",
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="image folders: 1 (grey) or 3 (RGB) channels every image is converted to "
        "(null: the most common)",
    )
    augment: Literal["none", "flip_crop"] = Field(
        "none",
        description="images: flip_crop pads 4 px, crops back at random and flips horizontally "
        "at random, per training sample, seeded by (train.seed, epoch, row)",
    )

    @field_validator("image_size", mode="before")
    @classmethod
    def _height_and_width(cls, value: Any) -> Any:
        ok = isinstance(value, list | tuple) and len(value) == 2
        if value is not None and not (
            ok and all(type(n) is int and 1 <= n <= MAX_IMAGE_SIDE for n in value)
        ):
            raise ValueError(
                f"must be [height, width] in pixels, each 1 to {MAX_IMAGE_SIDE}, e.g. [32, 32]; "
                "or null for the folder's most common size"
            )
        return value

    @model_validator(mode="after")
    def _image_settings_need_images(self) -> DataConfig:
        given = [
            f"{key} = {list(value) if isinstance(value, tuple) else value!r}"
            for key, default in (("image_size", None), ("channels", None), ("augment", "none"))
            if (value := getattr(self, key)) != default
        ]
        if given and self.kind != "image":  # a section's rule: the line names its keys
            held = "data read by data.dataset" if self.dataset else f"{self.kind} data"
            raise ValueError(
                f"{given[0]} applies to images, but path {self.path!r} holds {held}; "
                "remove it or point data.path at an image folder"
            )
        return self

    @model_validator(mode="after")
    def _ignored_columns_of_a_table(self) -> DataConfig:
        if not self.ignore_columns:
            return self
        if self.kind != "table":
            raise ValueError(
                f"ignore_columns = {self.ignore_columns}: applies to tables, but path "
                f"{self.path!r} holds {self.kind} data; remove it"
            )
        if self.label_column in self.ignore_columns:
            raise ValueError(
                f"ignore_columns = {self.ignore_columns}: holds the label column "
                f"{self.label_column!r}, which training needs; remove it from the list"
            )
        return self

    @field_validator("dataset")
    @classmethod
    def _dataset_found(cls, value: str | None) -> str | None:
        if value is not None:
            if ":" not in value:
                raise ValueError("must be an import path package.module:factory")
            locate_factory(value)  # statically, as model.name: nothing is imported yet
        return value

    @field_validator("path")
    @classmethod
    def _inside_data_folder(cls, value: str, info: ValidationInfo) -> str:
        parts = Path(value).parts
        if Path(value).is_absolute() or ".." in parts or len(parts) < 2 or parts[0] != DATA_DIR:
            raise ValueError(
                f"must be a path inside the project's {DATA_DIR}/ folder, e.g. {BUNDLED_DIGITS}"
            )
        suffix = Path(value).suffix.lower()
        if suffix and suffix not in DATA_SUFFIXES and not info.data.get("dataset"):
            raise ValueError(
                f"must be a table ({', '.join(TABLE_SUFFIXES)}), an image array "
                f"({', '.join(IMAGE_ARRAY_SUFFIXES)}), a text corpus ({', '.join(TEXT_SUFFIXES)}) "
                "or an image folder"
            )
        return value

    @property
    def kind(self) -> str:
        """How the data is split and read: "custom" (data.dataset) or its DataKind."""
        return "custom" if self.dataset else data_kind(self.path)


class SplitConfig(Section):
    val_fraction: float = Field(0.15, gt=0, lt=1)
    test_fraction: float = Field(0.15, gt=0, lt=1)
    seed: int = 42

    @model_validator(mode="after")
    def _leaves_training_rows(self) -> SplitConfig:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError(
                f"val_fraction + test_fraction = {self.val_fraction + self.test_fraction:g}; "
                "must be below 0.9 so that training keeps at least 10% of the rows"
            )
        return self
