"""Images and token corpora, prepared once per split key, then read by every worker.

A table is split by `trainyard.data.split.prepare_splits`. Images and text get the same
treatment here, into the same kind of content-addressed folder:

- images (an N x C x H x W array file or a folder of image files per class): a stratified
  split whose rows are copied, in bounded chunks, into `<split>_x.npy` / `<split>_y.npy`,
  which workers memory-map; per-channel statistics come from the training rows alone.
- text: tokenized once (byte or character level) into `tokens.bin`; train, val and test
  are contiguous ranges of it, so held-out text is text the model never saw.

A dataset of the user's own (`data.dataset`) is split by row numbers; workers read their
rows through it.

What a model needs again later (classes, channel statistics, the character table) lives in
the folder's schema and the token file's description, beside the data.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainyard.config import DataConfig, SplitConfig
from trainyard.data.stratified import NEEDS_3_PER_CLASS, set_aside_too_few
from trainyard.datasets.base import MapDataset, Subset
from trainyard.datasets.images import (
    ChannelStats,
    ImageArray,
    ImageFolder,
    channel_stats,
    memmap_npz_member,
)
from trainyard.datasets.tokens import TokenWindows, open_tokens, tokenize_file
from trainyard.errors import DataError

COPY_CHUNK_BYTES = 16 << 20  # image bytes copied at a time into a split's array
TOKEN_FILE = "tokens.bin"
USER_SOURCE = "source"  # a split of the user's own dataset keeps its data here


@dataclass(frozen=True)
class ImageSource:
    """An image dataset as the split needs it: labels up front, pixels read by rows."""

    labels: np.ndarray  # one raw label per image (small: read whole)
    read: Callable[[np.ndarray], np.ndarray]  # rows -> (n, C, H, W)
    image_shape: tuple[int, ...]
    dtype: np.dtype


def open_image_source(path: Path, data: DataConfig | None = None) -> ImageSource:
    """Labels and a pixel reader of an image array file or folder; a folder's images are
    normalized to `data.image_size` x `data.channels` (nothing is decoded until `read`)."""
    size, channels = (data.image_size, data.channels) if data is not None else (None, None)
    if path.is_dir():
        # Statistics are computed by the split, from its training rows; these are not used.
        folder = ImageFolder(
            path, stats=ChannelStats((0.0,), (1.0,)), image_size=size, channels=channels
        )
        names = np.asarray(folder.classes)
        return ImageSource(names[folder.labels], folder.read, folder.image_shape, folder.dtype)
    if not path.is_file():
        raise DataError(f"{path}: image data not found; set data.path in params.yaml")
    if path.suffix.lower() == ".npz":
        images, labels = memmap_npz_member(path, "x"), memmap_npz_member(path, "y")
    else:
        images, labels = _image_npy(path)
    if images.ndim != 4 or labels.ndim != 1 or len(labels) != len(images):
        raise DataError(
            f"{path}: images of shape {images.shape} with labels of shape {labels.shape}; "
            "expected N x C x H x W images and N labels (grayscale: add a channel axis, x[:, None])"
        )
    _check_array_shape(path, images.shape[1:], size, channels)
    return ImageSource(
        np.asarray(labels), lambda rows: images[rows], images.shape[1:], images.dtype
    )


def _check_array_shape(path: Path, shape: tuple, size, channels) -> None:
    """An array file is read as stored: data.image_size / data.channels may only agree."""
    if (size is not None and list(shape[1:]) != list(size)) or (
        channels is not None and shape[0] != channels
    ):
        raise DataError(
            f"{path}: holds images of shape {tuple(shape)}, which data.image_size = "
            f"{list(size) if size else None} and "
            f"data.channels = {channels} do not match; an array file is read as stored (they "
            "normalize image folders), so set both to null"
        )


def _image_npy(path: Path) -> tuple[np.ndarray, np.ndarray]:
    labels_path = path.with_name(f"{path.stem}.labels.npy")
    if not labels_path.is_file():
        raise DataError(
            f"{path}: an .npy image array needs its labels beside it in {labels_path.name} "
            "(or save both in one .npz as x and y)"
        )
    try:
        return (
            np.load(path, mmap_mode="r", allow_pickle=False),
            np.load(labels_path, mmap_mode="r", allow_pickle=False),
        )
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read as .npy ({exc})") from None


def image_classes(
    labels: np.ndarray, source: Path, split: SplitConfig | None = None
) -> tuple[list[str], np.ndarray]:
    """Sorted distinct labels as text, and each image's class id; every class goes into
    train, val and test (at least 3 images each; with `split`, as many as it needs)."""
    values, ids = np.unique(labels, return_inverse=True)
    if len(values) < 2:
        raise DataError(f"{source}: all images have one label; need at least 2 classes")
    counts = np.bincount(ids)
    short: tuple[int, str] | None = None
    if counts.min() < 3:
        short = int(counts.argmin()), NEEDS_3_PER_CLASS
    elif split is not None:
        short = set_aside_too_few(counts, split)
    if short is not None:
        class_id, why = short
        raise DataError(
            f"{source}: class {str(values[class_id])!r} has {counts[class_id]} image(s); {why}"
        )
    return [str(v) for v in values.tolist()], ids.astype(np.int64)


def stratified_rows(ids: np.ndarray, split: SplitConfig, source: Path) -> dict[str, np.ndarray]:
    """The same two-step stratified split the tables get, over row numbers."""
    from sklearn.model_selection import train_test_split  # ~1 s of imports no worker needs

    holdout = split.val_fraction + split.test_fraction
    rows = np.arange(len(ids))
    try:
        train, rest = train_test_split(
            rows, test_size=holdout, stratify=ids, random_state=split.seed
        )
        val, test = train_test_split(
            rest,
            test_size=split.test_fraction / holdout,
            stratify=ids[rest],
            random_state=split.seed,
        )
    except ValueError as exc:
        raise DataError(f"{source}: cannot split with these fractions ({exc})") from None
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def prepare_image_split(
    source: Path, split: SplitConfig, out_dir: Path, data: DataConfig | None = None
) -> dict:
    """Split and copy the images into out_dir (a folder's files decoded here, once each);
    returns the schema's fields."""
    images = open_image_source(source, data)
    classes, ids = image_classes(images.labels, source, split)
    parts = stratified_rows(ids, split, source)
    _write_image_arrays(images, ids, parts, out_dir)
    # From the training array just written: a folder's images are not decoded again.
    train = np.load(out_dir / "train_x.npy", mmap_mode="r")
    stats = channel_stats(train.__getitem__, np.arange(len(train)), images.image_shape)
    return {
        "kind": "image",
        "classes": classes,
        "feature_columns": [],
        "feature_mean": list(stats.mean),
        "feature_std": list(stats.std),
        "rows": {name: len(rows) for name, rows in parts.items()},
        "input_shape": [int(n) for n in images.image_shape],
    }


def _write_image_arrays(
    images: ImageSource, ids: np.ndarray, parts: dict[str, np.ndarray], out_dir: Path
) -> None:
    """Each split's `<name>_x.npy` (pixels, copied in chunks of bounded size) and
    `<name>_y.npy` (class ids), renamed into place only once every image was read: a file
    that cannot be decoded leaves `out_dir` as it was (`trainyard prepare` writes into
    data/processed itself)."""
    row_bytes = images.dtype.itemsize * int(np.prod(images.image_shape))
    chunk = max(1, COPY_CHUNK_BYTES // row_bytes)
    partial = {}
    try:
        for name, rows in parts.items():
            pixels = partial[f"{name}_x.npy"] = out_dir / f".{name}_x.npy.partial"
            target = np.lib.format.open_memmap(
                pixels, "w+", images.dtype, (len(rows), *images.image_shape)
            )
            for start in range(0, len(rows), chunk):
                target[start : start + chunk] = images.read(rows[start : start + chunk])
            target.flush()
            del target
            labels = partial[f"{name}_y.npy"] = out_dir / f".{name}_y.npy.partial"
            with labels.open("wb") as handle:
                np.save(handle, ids[rows])
        for final, written in partial.items():
            os.replace(written, out_dir / final)
    finally:
        for written in partial.values():
            written.unlink(missing_ok=True)


def prepare_token_split(data: DataConfig, split: SplitConfig, source: Path, out_dir: Path) -> dict:
    """Tokenize the corpus into out_dir; train, val and test are its contiguous ranges."""
    meta = tokenize_file(source, out_dir / TOKEN_FILE, data.tokenizer)
    train_share = 1 - split.val_fraction - split.test_fraction
    n = meta.num_tokens
    cuts = [0, round(n * train_share), round(n * (1 - split.test_fraction)), n]
    rows = {}
    for name, start, stop in zip(("train", "val", "test"), cuts, cuts[1:], strict=False):
        rows[name] = max(0, (stop - start - 1) // data.context)
        if rows[name] == 0:
            raise DataError(
                f"{source}: its {name} part holds {stop - start} tokens, less than one window of "
                f"data.context = {data.context} + 1; use a larger corpus or a smaller data.context"
            )
    return {
        "kind": "tokens",
        "target": "tokens",
        "classes": [],
        "feature_columns": [],
        "feature_mean": [],
        "feature_std": [],
        "rows": rows,
        "input_shape": [data.context],
        "vocab_size": meta.vocab_size,
        "token_level": meta.level,
        "token_cuts": cuts,
        "token_chars": list(meta.chars) if meta.chars is not None else None,
    }


def open_image_split(folder: Path, name: str, schema) -> MapDataset:
    """A split's images, memory-mapped: a worker holds the rows it reads, not the file."""
    images = np.load(folder / f"{name}_x.npy", mmap_mode="r", allow_pickle=False)
    labels = np.load(folder / f"{name}_y.npy", allow_pickle=False)
    stats = ChannelStats(tuple(schema.feature_mean), tuple(schema.feature_std))
    classes = range(len(schema.classes))  # the files hold class ids already
    return ImageArray(images, labels, stats=stats, classes=classes, source=str(folder))


def open_token_split(folder: Path, name: str, schema) -> MapDataset:
    tokens, meta = open_tokens(folder / TOKEN_FILE)
    index = ("train", "val", "test").index(name)
    start, stop = schema.token_cuts[index], schema.token_cuts[index + 1]
    return TokenWindows(tokens, schema.input_shape[0], meta.vocab_size, start, stop)


def open_user_dataset(name: str, source: Path) -> MapDataset:
    """`data.dataset`'s factory called on the data file: the user's own MapDataset."""
    module, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
        dataset = factory(source)
    except Exception as exc:  # the user's code: one line naming it, not a traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"data.dataset = {name!r} could not read {source}: {reason}") from None
    missing = [a for a in ("__len__", "take", "spec") if not hasattr(dataset, a)]
    if missing:
        raise DataError(
            f"data.dataset = {name!r} returned {type(dataset).__name__}, which lacks "
            f"{', '.join(missing)}; return a trainyard.datasets.MapDataset"
        )
    return dataset


def prepare_user_split(
    data: DataConfig, split: SplitConfig, source: Path, out_dir: Path, target: str
) -> dict:
    """Rows of the user's dataset per split (stratified when it exposes `labels`, its class
    ids); workers open the dataset again and read their split's rows through a Subset."""
    assert data.dataset is not None  # the split of a custom dataset (data.kind)
    dataset = open_user_dataset(data.dataset, source)
    spec = dataset.spec
    labels = getattr(dataset, "labels", None)
    if labels is not None:
        parts = stratified_rows(np.asarray(labels, dtype=np.int64), split, source)
    else:
        parts = shuffled_rows(len(dataset), split)
    for name, rows in parts.items():
        np.save(out_dir / f"{name}_rows.npy", rows)
    classes = [str(i) for i in range(spec.num_outputs)] if target == "class" else []
    return {
        "kind": spec.kind,
        "target": target,
        "classes": classes,
        "feature_columns": [],
        "feature_mean": [],
        "feature_std": [],
        "rows": {name: len(rows) for name, rows in parts.items()},
        "input_shape": list(spec.input_shape),
        "vocab_size": spec.vocab_size,
        "dataset": data.dataset,
        "source": data.path,
    }


def shuffled_rows(count: int, split: SplitConfig) -> dict[str, np.ndarray]:
    """A seeded random split, for data without class labels to stratify by."""
    order = np.random.default_rng(split.seed).permutation(count)
    val, test = round(count * split.val_fraction), round(count * split.test_fraction)
    train = count - val - test
    return {
        "train": np.sort(order[:train]),
        "val": np.sort(order[train : train + val]),
        "test": np.sort(order[train + val :]),
    }


def open_user_split(folder: Path, name: str, schema, root: Path) -> MapDataset:
    """The user's dataset on the copy of its data the split was made from, which the split
    folder keeps (the working file may have changed since); `trainyard prepare`'s folder
    has none, and reads the working file."""
    kept = folder / USER_SOURCE / Path(schema.source).name
    dataset = open_user_dataset(schema.dataset, kept if kept.exists() else root / schema.source)
    return Subset(dataset, np.load(folder / f"{name}_rows.npy"))
