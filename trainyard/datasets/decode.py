"""Image files as users have them (PNG, JPEG, BMP, GIF, TIFF, WebP), decoded by Pillow into
C x H x W uint8 arrays of one shape.

A folder mixes sizes and modes, so each file is normalized on the way in:

- mode: grayscale modes (1, L, I;16, I, ...) give 1 channel, the others (RGB, P, CMYK, ...)
  3. Transparency is composited onto black, so a transparent pixel reads the same whatever
  colour the file keeps under it. 16-bit pixels keep their top 8 bits.
- orientation: a photo's EXIF rotation is applied, so it trains the way it is seen.
- size: resized with Pillow's BILINEAR filter. Pillow widens the filter's support by the
  scale factor when it shrinks an image, so every source pixel contributes (no aliasing, as
  an area average), and it is smooth when it enlarges one without the overshoot of bicubic
  or Lanczos. `reducing_gap` first reduces a much larger image by an integer factor (a box
  average, several times cheaper), and a JPEG is drafted at the nearest DCT scale above the
  target: both change the result by well under one grey level at these sizes.

Only the split decodes (once per image); workers read the split's uint8 arrays. A file
Pillow cannot read, a truncated one and a decompression bomb are each one DataError naming
the file.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from trainyard.errors import DataError

PILLOW_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
GRAY_MODES = ("1", "L", "LA", "La", "I", "F") + tuple(m for m in Image.MODES if m.startswith("I;"))
REDUCING_GAP = 3.0  # reduce() by an integer factor first when shrinking by 3x or more
_ORIENTATION = 0x0112  # the EXIF tag; values 5-8 turn the image a quarter
_SWAPS_AXES = (5, 6, 7, 8)


@dataclass(frozen=True)
class Header:
    """What a file's header says: channels once normalized, height and width as seen."""

    channels: int
    height: int
    width: int


@contextmanager
def opened(path: Path) -> Iterator[Image.Image]:
    """The file opened by Pillow (header read, pixels not yet), errors as one DataError."""
    try:
        with warnings.catch_warnings():
            # Above MAX_IMAGE_PIXELS Pillow only warns; above twice that it raises. Both are
            # refused: a small file that expands to gigabytes is an attack or a mistake.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(
            f"{path}: {_reason(exc, path)}; trainyard refuses images over Pillow's "
            f"MAX_IMAGE_PIXELS ({Image.MAX_IMAGE_PIXELS:,} pixels), so downscale it"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path}: not an image Pillow can read ({_reason(exc, path)})") from None
    with image:
        yield image


def _reason(exc: BaseException, path: Path) -> str:
    """The exception's first line, without the path the DataError names already."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text.replace(f" '{path}'", "").replace(f" {path}", "")


def read_header(path: Path) -> Header:
    """Channels, height and width of a Pillow file, from its header. A PNG's chunks are
    checked too (their CRCs, nothing decompressed): a cut or damaged download is then one
    line before anything starts, not a failure of the split."""
    with opened(path) as image:
        width, height = image.size
        if _orientation(image) in _SWAPS_AXES:
            width, height = height, width
        channels = 1 if image.mode in GRAY_MODES else 3
        if image.format == "PNG":
            try:
                image.verify()
            except (OSError, SyntaxError, ValueError, EOFError) as exc:
                raise DataError(
                    f"{path}: cannot decode this image ({_reason(exc, path)}); "
                    "replace or delete the file"
                ) from None
        return Header(channels, height, width)


def _orientation(image: Image.Image) -> int:
    # Only where the header carried EXIF already: asking a PNG for it otherwise decodes it.
    if "exif" not in image.info:
        return 1
    return int(image.getexif().get(_ORIENTATION, 1))


def decode(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    """The file as a uint8 array of `shape` (channels 1 or 3, height, width)."""
    channels, height, width = shape
    with opened(path) as image:
        try:
            turned = _orientation(image)
            if image.format == "JPEG":  # decode at the smallest DCT scale still >= target
                image.draft(
                    image.mode, (height, width) if turned in _SWAPS_AXES else (width, height)
                )
            image.load()
            if turned != 1:
                image = ImageOps.exif_transpose(image)
            image = _normalized_mode(path, image, channels)
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR, None, REDUCING_GAP)
            pixels = np.asarray(image, dtype=np.uint8)
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt
            raise DataError(
                f"{path}: cannot decode this image ({_reason(exc, path)}); replace or delete the file"
            ) from None
    return pixels[None] if channels == 1 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _normalized_mode(path: Path, image: Image.Image, channels: int) -> Image.Image:
    """L (channels 1) or RGB (channels 3), 8 bits, alpha composited onto black."""
    if image.mode == "F":
        raise DataError(f"{path}: holds floating-point pixels; save it as an 8- or 16-bit image")
    if image.mode == "I" or image.mode.startswith("I;"):  # 16-bit grey (32-bit clipped to it)
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray((wide >> 8).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba)
    return image.convert("L" if channels == 1 else "RGB")
