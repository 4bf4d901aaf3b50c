"""`data.augment: flip_crop`: the CIFAR recipe, on the training split only, in the worker.

Each training sample is padded by PAD pixels (zeros after normalization: the channel mean),
cropped back to its size at a random offset, and flipped horizontally with probability 1/2.
The draws of a sample are a hash of (train.seed, epoch, row), not a stream of random numbers
consumed in reading order: a sample is augmented alike whichever rank reads it, in whichever
batch, at any worker count, and a resumed run sees exactly what it would have seen.
"""

from __future__ import annotations

import numpy as np
import torch

from trainyard.data_spec import DataSpec
from trainyard.datasets.base import MapDataset, as_rows

PAD = 4  # pixels, as in the CIFAR-10 ResNet recipe
_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping multiplications)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draws(seed: int, epoch: int, rows: np.ndarray) -> np.ndarray:
    """64 random bits per row, a function of (seed, epoch, row) alone."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed & _MASK], dtype=np.uint64))
        key = _mix(key ^ np.uint64(epoch & _MASK))
        return _mix(key ^ (rows.astype(np.uint64) * _GOLDEN))


def flip_crop(images: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """(n, C, H, W) images padded, cropped at each one's offset and maybe flipped: one
    gather, the flip being the crop's columns read right to left."""
    n, channels, height, width = images.shape
    span = 2 * PAD + 1
    dy = torch.from_numpy((bits % np.uint64(span)).astype(np.int64))
    dx = torch.from_numpy(((bits >> np.uint64(8)) % np.uint64(span)).astype(np.int64))
    flip = torch.from_numpy(((bits >> np.uint64(16)) & np.uint64(1)).astype(bool))
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    ys = dy[:, None] + torch.arange(height)
    xs = dx[:, None] + torch.arange(width)
    xs = torch.where(flip[:, None], xs.flip(1), xs)
    samples = torch.arange(n)[:, None, None, None]
    planes = torch.arange(channels)[None, :, None, None]
    return padded[samples, planes, ys[:, None, :, None], xs[:, None, None, :]]


class FlipCrop(MapDataset):
    """`base`'s images, augmented per row for the epoch the training loop sets."""

    def __init__(self, base: MapDataset, seed: int) -> None:
        self.base, self.seed, self.epoch = base, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the training loop before it reads the epoch's first batch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.base.take(indices)
        rows = as_rows(indices, len(self))
        return flip_crop(inputs, draws(self.seed, self.epoch, rows)), targets

    @property
    def spec(self) -> DataSpec:
        return self.base.spec


def augmented(split: MapDataset, augment: str, seed: int) -> MapDataset:
    """The training split as `data.augment` says."""
    return FlipCrop(split, seed) if augment == "flip_crop" else split
