"""Images: an array file of N x C x H x W, or a folder of image files per class.

The array file is memory-mapped (`.npy`, or an uncompressed `.npz` whose members are mapped
in place), so a worker holds only the rows it reads. Pixels are normalized per channel with a
mean and std computed from the training rows alone, in chunks of bounded size; the other
splits reuse those statistics (`ChannelStats`), which travel with the prepared data.

Image folders hold `root/<class>/<image>` (or deeper, `root/<class>/<any>/<image>`): files
Pillow reads (PNG, JPEG, BMP, GIF, TIFF, WebP) of any size and mode, normalized to one
C x H x W uint8 shape (trainyard.datasets.decode), and `.npy` (one H x W or C x H x W
array) or `.pgm` (portable graymap) files, read as stored. The shape is `data.image_size`
and `data.channels`, each by default the most common among the folder's files (their
headers say it; nothing is decoded to find out).
"""

from __future__ import annotations

import io
import shutil
import struct
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch

from trainyard.data_spec import DataSpec
from trainyard.datasets.base import MapDataset, as_rows
from trainyard.errors import DataError
from trainyard.util.files import replacing

PILLOW_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
FOLDER_SUFFIXES = (".npy", ".pgm", *PILLOW_SUFFIXES)
STATS_CHUNK_BYTES = 1 << 20  # float64 pixels converted at a time while computing statistics


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel pixel mean and std of the training rows (std 1 for a constant channel)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def normalize(self, pixels: np.ndarray) -> torch.Tensor:
        mean = np.asarray(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
        return torch.from_numpy((pixels.astype(np.float32) - mean) / std)


def channel_stats(read, rows: np.ndarray, image_shape: tuple[int, ...]) -> ChannelStats:
    """Mean/std per channel over `rows`, reading `read(rows_chunk) -> (n, C, H, W)` in chunks
    whose float64 copy stays under STATS_CHUNK_BYTES (sums in float64, one pass)."""
    rows = np.sort(np.asarray(rows, dtype=np.int64))  # sequential reads of the file
    if rows.size == 0:
        raise ValueError("channel statistics need at least one training row")
    channels, pixels = image_shape[0], int(np.prod(image_shape[1:]))
    chunk = max(1, STATS_CHUNK_BYTES // (8 * channels * pixels))
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for start in range(0, rows.size, chunk):
        block = np.asarray(read(rows[start : start + chunk]), dtype=np.float64)
        total += block.sum(axis=(0, 2, 3))
        squares += np.einsum("nchw,nchw->c", block, block)
    count = rows.size * pixels
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    std[std < 1e-8] = 1.0
    return ChannelStats(tuple(float(m) for m in mean), tuple(float(s) for s in std))


class _Labels:
    """Label values -> class ids (position in `classes`); unknown values are a DataError."""

    def __init__(self, classes: Sequence | np.ndarray, source: str) -> None:
        self.classes = np.asarray(list(classes))
        if self.classes.size == 0:
            raise DataError(f"{source}: no classes")
        if np.unique(self.classes).size != self.classes.size:
            raise ValueError(f"classes {list(classes)} has duplicates")
        self.sorter = np.argsort(self.classes, kind="stable")
        self.source = source

    def ids(self, values: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.classes, values, sorter=self.sorter)
        ids = self.sorter[np.minimum(pos, self.classes.size - 1)]
        unknown = self.classes[ids] != values
        if np.any(unknown):
            raise DataError(
                f"{self.source}: label {values[unknown][0]!r} is not among the "
                f"{self.classes.size} classes {self.classes.tolist()[:10]}; pass the full class list"
            )
        return ids.astype(np.int64)


class ImageArray(MapDataset):
    """Rows of an (N, C, H, W) array (usually a memmap) with N labels; inputs are float32,
    normalized with `stats`, targets are int64 class ids."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        train_rows: np.ndarray | torch.Tensor | Sequence[int] | None = None,
        stats: ChannelStats | None = None,
        classes: Sequence | None = None,
        source: str = "image array",
    ) -> None:
        if images.ndim != 4:
            raise DataError(
                f"{source}: images have shape {images.shape}; expected N x C x H x W "
                "(add a channel axis for grayscale: x[:, None])"
            )
        if labels.ndim != 1 or len(labels) != len(images):
            raise DataError(
                f"{source}: {len(images)} images but labels of shape {labels.shape}; "
                "expected one label per image"
            )
        self.images, self.labels, self.source = images, labels, source
        # The label column is small (one value per image): its distinct values are the classes.
        self._classes = _Labels(np.unique(labels) if classes is None else classes, source)
        if stats is None:
            if train_rows is None:
                raise ValueError(
                    "pass train_rows (the training split's rows) so pixel statistics come "
                    "from training data only, or stats computed earlier"
                )
            rows = as_rows(train_rows, len(images))
            stats = channel_stats(lambda r: images[r], rows, images.shape[1:])
        if len(stats.mean) != images.shape[1]:
            raise DataError(
                f"{source}: stats for {len(stats.mean)} channels, images have {images.shape[1]}"
            )
        self.stats = stats

    @property
    def classes(self) -> list:
        return self._classes.classes.tolist()

    def __len__(self) -> int:
        return len(self.images)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = as_rows(indices, len(self))
        pixels = self.images[rows]  # one gather: reads only these rows of the mapped file
        return self.stats.normalize(pixels), torch.from_numpy(self._classes.ids(self.labels[rows]))

    @property
    def spec(self) -> DataSpec:
        shape = tuple(int(d) for d in self.images.shape[1:])
        return DataSpec("image", shape, len(self._classes.classes))


def open_image_array(
    path: str | Path,
    labels: str | Path | None = None,
    *,
    train_rows: np.ndarray | torch.Tensor | Sequence[int] | None = None,
    stats: ChannelStats | None = None,
    classes: Sequence | None = None,
) -> ImageArray:
    """`images.npz` (members x and y, saved with np.savez) or `images.npy` + a labels `.npy`,
    memory-mapped read-only."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: image array file not found")
    if path.suffix == ".npz":
        if labels is not None:
            raise DataError(
                f"{path}: an .npz holds its labels as member 'y'; do not pass a labels file"
            )
        images, values = memmap_npz_member(path, "x"), memmap_npz_member(path, "y")
    elif path.suffix == ".npy":
        if labels is None:
            raise DataError(f"{path}: an .npy holds only images; pass the labels .npy beside it")
        images, values = memmap_npy(path), memmap_npy(Path(labels))
    else:
        raise DataError(f"{path}: expected an .npy or .npz array file")
    return ImageArray(
        images, values, train_rows=train_rows, stats=stats, classes=classes, source=str(path)
    )


def memmap_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read as .npy ({exc})") from None
    return array


def memmap_npz_member(path: str | Path, name: str) -> np.ndarray:
    """Map one member of an uncompressed .npz in place (np.load would decompress it whole)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
            info = archive.getinfo(f"{name}.npy")
    except zipfile.BadZipFile:
        raise DataError(f"{path}: not a valid .npz (zip) file") from None
    except KeyError:
        found = [m.removesuffix(".npy") for m in members]
        raise DataError(
            f"{path}: has no array '{name}' (found {found}); save images as x and labels as y: "
            "np.savez(path, x=images, y=labels)"
        ) from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise DataError(
            f"{path}: array '{name}' is compressed, so it cannot be memory-mapped; "
            "save with np.savez (not np.savez_compressed) or as .npy files"
        )
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)  # zip local file header; its name/extra lengths end it
        if header[:4] != b"PK\x03\x04":
            raise DataError(f"{path}: corrupt zip header for member '{name}'")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        handle.seek(info.header_offset + 30 + name_length + extra_length)
        version = np.lib.format.read_magic(handle)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read_header(handle)
        offset = handle.tell()
    if dtype.hasobject:
        raise DataError(f"{path}: array '{name}' holds Python objects; save numeric arrays")
    order: Literal["C", "F"] = "F" if fortran_order else "C"
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)


def write_npz(path: str | Path, **arrays: np.ndarray) -> None:
    """An uncompressed .npz with fixed timestamps (byte-stable, memory-mappable), written
    beside and renamed in."""
    with replacing(Path(path)) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue(), compress_type=zipfile.ZIP_STORED)


def write_digits_images(path: str | Path) -> None:
    """scikit-learn's bundled digits (1,797 images, pixels 0-16) as x: uint8 N x 1 x 8 x 8 and
    y: int64 labels, in a byte-stable uncompressed .npz."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.uint8)[:, None, :, :]
    write_npz(path, x=images, y=digits.target.astype(np.int64))


def write_digits_png(path: str | Path) -> None:
    """The same digits as a folder per class of 8 x 8 greyscale PNGs (pixels scaled to
    0-255), the layout users' image folders have; written beside and renamed in, and
    byte-stable for a given Pillow."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for index, (image, label) in enumerate(zip(pixels, digits.target, strict=True)):
        folder = tmp / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"{index:04d}.png", optimize=False)
    tmp.rename(path)


# --- folders of image files ----------------------------------------------------------------


def read_pgm(path: str | Path) -> np.ndarray:
    """A portable graymap (binary P5 or text P2) as a 1 x H x W uint8 (or uint16) array."""
    path = Path(path)
    data = path.read_bytes()
    fields: list[bytes] = []
    pos = 0
    while len(fields) < 4:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":  # a comment runs to the end of the line
            end = data.find(b"\n", pos)
            pos = len(data) if end < 0 else end + 1
            continue
        start = pos
        while pos < len(data) and not data[pos : pos + 1].isspace() and data[pos : pos + 1] != b"#":
            pos += 1
        if start == pos:
            raise DataError(f"{path}: truncated PGM header")
        fields.append(data[start:pos])
    magic = fields[0]
    try:
        width, height, maxval = (int(f) for f in fields[1:])
    except ValueError:
        raise DataError(f"{path}: PGM header {fields!r} is not numeric") from None
    if magic not in (b"P5", b"P2") or not (0 < maxval < 65536) or width <= 0 or height <= 0:
        raise DataError(f"{path}: not a graymap (P5/P2) with 0 < maxval < 65536")
    dtype = np.dtype(np.uint8) if maxval < 256 else np.dtype(">u2")
    if magic == b"P5":
        body = data[pos + 1 : pos + 1 + width * height * dtype.itemsize]  # one whitespace byte
        pixels = np.frombuffer(body, dtype=dtype)
    else:
        pixels = np.array(data[pos:].split(), dtype=np.int64).astype(dtype)
    if pixels.size != width * height:
        raise DataError(f"{path}: {pixels.size} pixels, header says {width} x {height}")
    return pixels.astype(dtype.newbyteorder("=")).reshape(1, height, width)


def write_pgm(path: str | Path, image: np.ndarray) -> None:
    """An H x W (or 1 x H x W) uint8/uint16 array as a binary PGM (P5)."""
    image = np.asarray(image)
    image = image[0] if image.ndim == 3 else image
    if image.ndim != 2 or image.dtype not in (np.uint8, np.uint16):
        raise ValueError(
            f"expected an H x W uint8 or uint16 image, got {image.dtype} {image.shape}"
        )
    maxval = 255 if image.dtype == np.uint8 else 65535
    header = f"P5\n{image.shape[1]} {image.shape[0]}\n{maxval}\n".encode()
    Path(path).write_bytes(header + image.astype(image.dtype.newbyteorder(">")).tobytes())


def is_image_file(file: Path) -> bool:
    """Whether `file` is an image trainyard reads (by its suffix)."""
    return file.suffix.lower() in FOLDER_SUFFIXES and file.is_file()


def _decoded_by_pillow(path: Path) -> bool:
    return path.suffix.lower() in PILLOW_SUFFIXES


def image_header(path: Path) -> tuple[tuple[int, int, int], np.dtype]:
    """An image file's C x H x W (as it will be normalized: Pillow's modes give 1 or 3
    channels) and the dtype it is read as, without decoding a Pillow file."""
    if _decoded_by_pillow(path):
        from trainyard.datasets.decode import read_header  # Pillow: the split's, not workers'

        header = read_header(path)
        return (header.channels, header.height, header.width), np.dtype(np.uint8)
    array = read_image_file(path)
    return cast(tuple[int, int, int], tuple(int(n) for n in array.shape)), array.dtype


def common_shape(
    shapes: Sequence[tuple[int, int, int]],
    image_size: Sequence[int] | None = None,
    channels: int | None = None,
) -> tuple[int, int, int]:
    """The folder's C x H x W: `channels` and `image_size` where given, else the most common
    among `shapes` (a tie goes to the first file's)."""
    if channels is None:
        channels = Counter(shape[0] for shape in shapes).most_common(1)[0][0]
    if image_size is None:
        image_size = Counter(tuple(shape[1:]) for shape in shapes).most_common(1)[0][0]
    height, width = image_size
    return int(channels), int(height), int(width)


def read_image_file(path: Path, shape: tuple[int, int, int] | None = None) -> np.ndarray:
    """One image file as C x H x W: a Pillow file decoded into `shape` (which it needs), an
    .npy or .pgm as stored, refused if `shape` is given and it differs."""
    if _decoded_by_pillow(path):
        if shape is None or shape[0] not in (1, 3):
            raise DataError(
                f"{path}: a {path.suffix} image reads as 1 or 3 channels, but the images "
                f"are {shape}; set data.channels to 1 or 3"
            )
        from trainyard.datasets.decode import decode  # Pillow loads only for its formats

        return decode(path, shape)
    image = read_pgm(path) if path.suffix.lower() == ".pgm" else np.asarray(memmap_npy(path))
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3:
        raise DataError(f"{path}: image of shape {image.shape}; expected H x W or C x H x W")
    if shape is not None and tuple(image.shape) != tuple(shape):
        raise DataError(
            f"{path}: image of shape {tuple(image.shape)}; the model reads images of shape "
            f"{tuple(shape)} (data.image_size and data.channels, by default the folder's most "
            "common); .npy and .pgm images are read as stored: save it so, or as a .png"
        )
    return image


class ImageFolder(MapDataset):
    """`root/<class>/<image>`: one row per file (classes and files in sorted order), each
    normalized to `image_shape` (C x H x W) when read."""

    def __init__(
        self,
        root: str | Path,
        *,
        train_rows: np.ndarray | torch.Tensor | Sequence[int] | None = None,
        stats: ChannelStats | None = None,
        classes: Sequence[str] | None = None,
        image_size: Sequence[int] | None = None,
        channels: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.classes, self.files, self.labels = _class_files(self.root, classes)
        headers = [image_header(file) for file in self.files]
        self.image_shape = common_shape([shape for shape, _ in headers], image_size, channels)
        self.dtype = np.result_type(*{dtype for _, dtype in headers})
        if stats is None:
            if train_rows is None:
                raise ValueError(
                    "pass train_rows (the training split's rows) so pixel statistics come "
                    "from training data only, or stats computed earlier"
                )
            rows = as_rows(train_rows, len(self.files))
            stats = channel_stats(self.read, rows, self.image_shape)
        self.stats = stats

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Raw images of `rows`, (n, C, H, W), before normalization."""
        images = np.empty((len(rows), *self.image_shape), self.dtype)
        for i, row in enumerate(rows):
            images[i] = read_image_file(self.files[row], self.image_shape)
        return images

    def __len__(self) -> int:
        return len(self.files)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = as_rows(indices, len(self))
        return self.stats.normalize(self.read(rows)), torch.from_numpy(self.labels[rows])

    @property
    def spec(self) -> DataSpec:
        return DataSpec("image", tuple(int(d) for d in self.image_shape), len(self.classes))


def _images_under(folder: Path) -> list[Path]:
    """A class's image files at any depth below its folder (`cat/indoor/1.png` is a cat, as
    torchvision's ImageFolder has it), sorted by path; hidden files and folders (`.DS_Store`,
    `.ipynb_checkpoints`) left out."""
    if not folder.is_dir():
        return []
    found = []
    for file in folder.rglob("*"):
        inside = file.relative_to(folder).parts
        if not any(_hidden(part) for part in inside) and is_image_file(file):
            found.append(file)
    return sorted(found)


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _class_files(
    root: Path, classes: Sequence[str] | None
) -> tuple[list[str], list[Path], np.ndarray]:
    """The class names (the root's folders), the image files (by class, then path) and each
    file's class id."""
    if not root.is_dir():
        raise DataError(f"{root}: image folder not found")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not _hidden(p.name))
    names = list(found if classes is None else classes)
    missing = [c for c in found if c not in names]
    if missing:
        raise DataError(f"{root}: folder '{missing[0]}' is not among classes {names}")
    files: list[Path] = []
    labels: list[int] = []
    for class_id, name in enumerate(names):
        for file in _images_under(root / name):
            files.append(file)
            labels.append(class_id)
    if not files:
        suffixes = ", ".join(FOLDER_SUFFIXES)
        raise DataError(f"{root}: no images; expected {root}/<class>/<name> with {suffixes}")
    return names, files, np.asarray(labels, dtype=np.int64)
