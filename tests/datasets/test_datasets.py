"""Every dataset kind under the one sampler: disjoint shards, each row once per epoch, exact
resume; memory-mapped kinds never load their file; Parquet reads only the row groups a batch
touches; the stdlib corpus is deterministic real text."""

from __future__ import annotations

import json
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from trainyard.data.sharding import ShardedBatches
from trainyard.data.tensors import TensorSplit
from trainyard.data_spec import DataSpec
from trainyard.datasets import MapDataset, Subset
from trainyard.datasets.images import (
    ChannelStats,
    ImageArray,
    ImageFolder,
    memmap_npz_member,
    open_image_array,
    read_pgm,
    write_digits_images,
    write_npz,
    write_pgm,
)
from trainyard.datasets.parquet import ParquetRows
from trainyard.datasets.tokens import (
    bigram_entropy,
    build_stdlib_corpus,
    open_tokens,
    token_splits,
    tokenize_file,
    unigram_entropy,
)
from trainyard.errors import DataError

from tests_support import write_pictures

ROWS = 37  # odd, so the last global batch is short and one rank's last batch may be empty


class CountingReads(MapDataset):
    """Records every row it is asked for (composer's test_ddp idea), then reads it for real."""

    def __init__(self, base: MapDataset) -> None:
        self.base, self.reads = base, list[int]()

    def __len__(self) -> int:
        return len(self.base)

    def take(self, indices):
        self.reads.extend(indices.tolist())
        return self.base.take(indices)

    @property
    def spec(self) -> DataSpec:
        return self.base.spec


def _images(n: int, channels: int = 1, side: int = 4) -> np.ndarray:
    """Image i has pixel values i, i+1, ... so a read can be traced back to its row."""
    base = np.arange(n, dtype=np.int64)[:, None] + np.arange(channels * side * side)
    return (base % 251).astype(np.uint8).reshape(n, channels, side, side)


def image_npy(tmp: Path) -> MapDataset:
    np.save(tmp / "x.npy", _images(ROWS, channels=3))
    np.save(tmp / "y.npy", np.arange(ROWS) % 5)
    return open_image_array(tmp / "x.npy", tmp / "y.npy", train_rows=np.arange(30))


def image_npz(tmp: Path) -> MapDataset:
    write_npz(tmp / "d.npz", x=_images(ROWS), y=np.array([f"c{i % 3}" for i in range(ROWS)]))
    return open_image_array(tmp / "d.npz", train_rows=np.arange(30))


def image_folder(tmp: Path) -> MapDataset:
    images = _images(ROWS)
    for i in range(ROWS):
        folder = tmp / "root" / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        if i % 2:
            write_pgm(folder / f"{i:03d}.pgm", images[i])
        else:
            np.save(folder / f"{i:03d}.npy", images[i, 0])
    return ImageFolder(tmp / "root", train_rows=np.arange(30))


def _corpus(tmp: Path) -> Path:
    text = "".join(f"line {i}: the quick brown fox — jumps over {i * 7 % 13}\n" for i in range(60))
    (tmp / "c.txt").write_text(text, encoding="utf-8")
    return tmp / "c.txt"


def tokens_byte(tmp: Path) -> MapDataset:
    tokenize_file(_corpus(tmp), tmp / "c.bin", "byte")
    return token_splits(tmp / "c.bin", context=16)["train"]


def tokens_char(tmp: Path) -> MapDataset:
    tokenize_file(_corpus(tmp), tmp / "c.bin", "char")
    return token_splits(tmp / "c.bin", context=16)["train"]


def _table(n: int) -> pa.Table:
    return pa.table(
        {
            "a": np.arange(n, dtype=np.float64),
            "b": np.arange(n, dtype=np.int32) * 2,
            "label": [["cat", "dog", "eel"][i % 3] for i in range(n)],
        }
    )


def parquet_rows(tmp: Path) -> MapDataset:
    pq.write_table(_table(ROWS), tmp / "t.parquet", row_group_size=5)
    return ParquetRows(tmp / "t.parquet", ["a", "b"], "label", {"cat": 0, "dog": 1, "eel": 2})


def image_subset(tmp: Path) -> MapDataset:
    """A split of a file-backed dataset: rows renumbered, reads go to the right file rows."""
    np.save(tmp / "x.npy", _images(ROWS + 20))
    np.save(tmp / "y.npy", np.arange(ROWS + 20) % 2)
    full = open_image_array(tmp / "x.npy", tmp / "y.npy", train_rows=np.arange(0, ROWS + 20, 2))
    return Subset(full, np.arange(20, ROWS + 20))


KINDS = {
    f.__name__: f
    for f in (
        image_npy,
        image_npz,
        image_folder,
        tokens_byte,
        tokens_char,
        parquet_rows,
        image_subset,
    )
}


@pytest.fixture(params=sorted(KINDS))
def dataset(request, tmp_path) -> MapDataset:
    return KINDS[request.param](tmp_path)


def _epoch(data: MapDataset, rank: int, epoch: int, start_step: int = 0, world: int = 2):
    sampler = ShardedBatches(len(data), batch_size=3, world_size=world, rank=rank, seed=7)
    return [(b.indices, *data.take(b.indices)) for b in sampler.epoch(epoch, start_step)]


def test_two_ranks_read_disjoint_shards_each_row_once_per_epoch(dataset):
    reference_x, reference_y = dataset.take(torch.arange(len(dataset)))
    assert isinstance(dataset.spec, DataSpec)
    assert tuple(reference_x.shape[1:]) == dataset.spec.input_shape
    for epoch in range(2):
        readers = [CountingReads(dataset) for _ in range(2)]
        per_rank = [_epoch(readers[rank], rank, epoch) for rank in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]), "every rank runs the same number of steps"
        assert not set(readers[0].reads) & set(readers[1].reads), "shards overlap"
        seen = Counter(readers[0].reads + readers[1].reads)
        assert sorted(seen) == list(range(len(dataset))) and set(seen.values()) == {1}
        for batches in per_rank:  # a batch holds exactly the rows it names, in their order
            for indices, x, y in batches:
                assert torch.equal(x, reference_x[indices]) and torch.equal(y, reference_y[indices])


def test_resume_mid_epoch_reads_the_tail_of_the_full_epoch(dataset):
    for rank in range(2):
        full = _epoch(dataset, rank, epoch=3)
        resumed = _epoch(dataset, rank, epoch=3, start_step=4)
        assert len(resumed) == len(full) - 4
        for (i, x, y), (ri, rx, ry) in zip(full[4:], resumed, strict=True):
            assert torch.equal(i, ri) and torch.equal(x, rx) and torch.equal(y, ry)


def _open_by_path(folder: Path) -> dict[str, MapDataset]:
    return {
        "tokens": token_splits(folder / "c.bin", context=16)["train"],
        "parquet": ParquetRows(
            folder / "t.parquet", ["a"], "label", {"cat": 0, "dog": 1, "eel": 2}
        ),
    }


def _gloo_worker(rank, world, init_file, folder):
    """A real worker opens the files itself (nothing mapped is pickled) and reads its shard."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reads = {}
    for name, data in _open_by_path(folder).items():
        counting = CountingReads(data)
        for batch in ShardedBatches(len(data), 4, world, rank, seed=3).epoch(1):
            counting.take(batch.indices)
            dist.barrier()  # lock-step, as DDP's all-reduce would force
        reads[name] = counting.reads
    gathered = [None] * world
    dist.all_gather_object(gathered, reads)
    if rank == 0:
        (folder / "reads.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_real_gloo_workers_read_disjoint_shards_of_mapped_files(tmp_path):
    tokenize_file(_corpus(tmp_path), tmp_path / "c.bin", "char")
    pq.write_table(_table(ROWS), tmp_path / "t.parquet", row_group_size=5)
    mp.start_processes(
        _gloo_worker, args=(2, tmp_path / "init", tmp_path), nprocs=2, start_method="spawn"
    )
    reads = json.loads((tmp_path / "reads.json").read_text())  # [rank][kind] -> rows read
    for name, data in _open_by_path(tmp_path).items():
        rank0, rank1 = reads[0][name], reads[1][name]
        assert not set(rank0) & set(rank1)
        assert sorted(rank0 + rank1) == list(range(len(data)))


# --- images ----------------------------------------------------------------------------------


def test_image_array_is_memory_mapped_and_normalized_with_training_statistics(tmp_path):
    images = _images(ROWS, channels=3).astype(np.float32)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.arange(ROWS) % 5)
    train = np.arange(10, 30)
    data = open_image_array(tmp_path / "x.npy", tmp_path / "y.npy", train_rows=train)
    assert isinstance(data.images, np.memmap) and isinstance(data.labels, np.memmap)
    mean = images[train].mean(axis=(0, 2, 3))
    std = images[train].std(axis=(0, 2, 3))
    np.testing.assert_allclose(data.stats.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(data.stats.std, std, rtol=1e-5)
    x, y = data.take(torch.tensor([36, 0]))
    expected = (images[[36, 0]] - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert y.tolist() == [1, 0] and data.spec == DataSpec("image", (3, 4, 4), 5)
    again = open_image_array(tmp_path / "x.npy", tmp_path / "y.npy", stats=data.stats)
    assert torch.equal(again.take(torch.tensor([5]))[0], data.take(torch.tensor([5]))[0])
    with pytest.raises(ValueError, match="train_rows"):
        open_image_array(tmp_path / "x.npy", tmp_path / "y.npy")
    with pytest.raises(IndexError, match="out of range"):
        data.take(torch.tensor([ROWS]))
    with pytest.raises(IndexError, match="out of range"):
        data.take(torch.tensor([-1]))


def test_a_20_mb_image_file_is_never_loaded_whole(tmp_path):
    n = 5000  # 5000 x 1 x 64 x 64 uint8 = 20.5 MB
    x = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.uint8, (n, 1, 64, 64))
    for start in range(0, n, 500):
        x[start : start + 500] = (np.arange(start, start + 500) % 256).astype(np.uint8)[
            :, None, None, None
        ]
    x.flush()
    del x
    np.save(tmp_path / "y.npy", np.arange(n) % 10)
    size = (tmp_path / "x.npy").stat().st_size
    assert size > 20_000_000
    open_image_array(tmp_path / "x.npy", tmp_path / "y.npy", train_rows=[0])  # imports done
    tracemalloc.start()
    try:
        data = open_image_array(tmp_path / "x.npy", tmp_path / "y.npy", train_rows=np.arange(4000))
        batch, _ = data.take(torch.randperm(n)[:64])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(data.images, np.memmap) and batch.shape == (64, 1, 64, 64)
    assert peak < size / 5, f"peak {peak / 1e6:.1f} MB while reading a {size / 1e6:.1f} MB file"


def test_npz_members_are_mapped_in_place_and_compressed_ones_refused(tmp_path):
    images, labels = _images(9, channels=2), np.arange(9)
    write_npz(tmp_path / "d.npz", x=images, y=labels)
    mapped = memmap_npz_member(tmp_path / "d.npz", "x")
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, images)
    with np.load(tmp_path / "d.npz") as plain:  # still an ordinary .npz for numpy
        assert np.array_equal(plain["y"], labels)
    np.savez_compressed(tmp_path / "z.npz", x=images, y=labels)
    with pytest.raises(DataError, match="compressed.*np.savez"):
        open_image_array(tmp_path / "z.npz", train_rows=[0])
    write_npz(tmp_path / "n.npz", x=images)
    with pytest.raises(DataError, match="no array 'y'.*found \\['x'\\]"):
        open_image_array(tmp_path / "n.npz", train_rows=[0])


def test_bundled_digits_are_byte_stable_1x8x8_images(tmp_path):
    write_digits_images(tmp_path / "a.npz")
    write_digits_images(tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    data = open_image_array(tmp_path / "a.npz", train_rows=np.arange(1000))
    assert len(data) == 1797 and data.spec == DataSpec("image", (1, 8, 8), 10)
    assert data.classes == list(range(10)) and data.images.max() == 16


def test_image_folder_reads_pgm_and_npy_and_names_a_file_pillow_cannot_read(tmp_path):
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    write_pgm(tmp_path / "a.pgm", image)
    assert np.array_equal(read_pgm(tmp_path / "a.pgm"), image[None])
    (tmp_path / "t.pgm").write_bytes(b"P2\n# a comment\n2 2\n300\n0 1\n299 300\n")
    text = read_pgm(tmp_path / "t.pgm")
    assert text.dtype == np.uint16 and text.tolist() == [[[0, 1], [299, 300]]]
    data = image_folder(tmp_path)
    assert data.classes == ["class0", "class1", "class2", "class3"]
    assert len(data) == ROWS and data.spec == DataSpec("image", (1, 4, 4), 4)
    (tmp_path / "root" / "class0" / "photo.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match=r"photo\.png: not an image Pillow can read \(cannot"):
        ImageFolder(tmp_path / "root", train_rows=[0])
    (tmp_path / "root" / "class0" / "photo.png").unlink()
    np.save(tmp_path / "root" / "class1" / "999.npy", np.zeros((5, 5), np.uint8))
    with pytest.raises(DataError, match=r"999\.npy: image of shape \(1, 5, 5\); the model reads"):
        ImageFolder(tmp_path / "root", train_rows=np.arange(ROWS + 1))


def test_pillow_images_of_mixed_modes_and_sizes_are_normalized_to_one_shape(tmp_path):
    files = write_pictures(tmp_path / "png", "png", per_class=8)
    folder = ImageFolder(tmp_path / "png", train_rows=np.arange(24))
    # Most files are colour and the first size ties with the others: 3 x 12 x 12, uint8.
    assert folder.image_shape == (3, 12, 12) and folder.dtype == np.uint8
    pixels = folder.read(np.arange(24))
    # Every mode keeps its class's look: channel k brightest for colour modes, and each
    # grey or 16-bit file is one grey level repeated in 3 channels, the class's own.
    means = pixels.reshape(24, 3, -1).mean(axis=2)
    modes = [Image.open(file).mode for file in files]
    grey = np.array([mode in ("L", "I;16", "LA") for mode in modes])
    assert (means[~grey].argmax(axis=1) == folder.labels[~grey]).all()
    assert (pixels[grey, 0] == pixels[grey, 2]).all()
    levels = means[grey, 0]
    assert np.ptp(levels[folder.labels[grey] == 0]) < 10 < abs(levels[0] - levels[-1])
    # An RGBA file's transparent pixels are black, whatever colour the file keeps there.
    with Image.open(files[2]) as image:
        clear = image.copy()
    clear.putalpha(0)
    clear.save(files[2])
    assert folder.read(np.array([2])).max() == 0
    # Overrides: grey, any size; a 16-bit file keeps its top 8 bits.
    small = ImageFolder(tmp_path / "png", stats=folder.stats, image_size=(7, 9), channels=1)
    assert small.image_shape == (1, 7, 9) and small.read(np.arange(24)).shape == (24, 1, 7, 9)
    big = ImageFolder(tmp_path / "png", stats=folder.stats, image_size=(20, 20), channels=1)
    with Image.open(files[5]) as image:  # I;16, 20 x 20 already: not resized
        assert image.mode == "I;16" and image.size == (20, 20)
        expected = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
    assert np.array_equal(big.read(np.array([5]))[0, 0], expected)


def test_an_image_array_file_is_read_as_stored_so_other_sizes_are_refused(tmp_path):
    from trainyard.config import DataConfig
    from trainyard.data.prepared import open_image_source

    write_npz(tmp_path / "d.npz", x=np.zeros((9, 1, 8, 8), np.uint8), y=np.arange(9) % 3)
    same = DataConfig(path="data/d.npz", image_size=[8, 8], channels=1)
    assert open_image_source(tmp_path / "d.npz", same).image_shape == (1, 8, 8)
    with pytest.raises(DataError, match=r"d\.npz: holds images of shape \(1, 8, 8\), which "):
        open_image_source(tmp_path / "d.npz", DataConfig(path="data/d.npz", image_size=[16, 16]))


def test_a_photo_is_turned_upright_and_a_bad_image_is_one_line_naming_it(tmp_path, monkeypatch):
    from trainyard.datasets.decode import decode, read_header

    photo = Image.fromarray(np.zeros((10, 30, 3), np.uint8))  # wide as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: shown 10 wide and 30 high
    photo.save(tmp_path / "p.jpg", exif=exif)
    assert read_header(tmp_path / "p.jpg").height == 30
    assert decode(tmp_path / "p.jpg", (3, 30, 10)).shape == (3, 30, 10)
    # Truncated files: a PNG's header check finds it; a JPEG's header reads, its pixels not.
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64), np.uint8))
    for name in ("cut.png", "cut.jpg"):
        noise.save(tmp_path / name)
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.png: cannot decode this image \(.*\); replace or"):
        read_header(tmp_path / "cut.png")
    assert read_header(tmp_path / "cut.jpg").height == 64
    with pytest.raises(DataError, match=r"cut\.jpg: cannot decode this image \(.*\); replace or"):
        decode(tmp_path / "cut.jpg", (1, 64, 64))
    # A decompression bomb: over Pillow's limit (here lowered) is refused, not decoded.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 100):  # over the limit (Pillow warns), over twice it (Pillow raises)
        Image.new("L", (side, side)).save(tmp_path / "bomb.png")
        with pytest.raises(DataError, match=r"bomb\.png: .*MAX_IMAGE_PIXELS \(1,000 pixels\)"):
            read_header(tmp_path / "bomb.png")


def test_flip_crop_depends_on_seed_epoch_and_row_only():
    from trainyard.datasets.augment import PAD, FlipCrop

    images = np.arange(10 * 2 * 6 * 5, dtype=np.uint8).reshape(10, 2, 6, 5)
    base = ImageArray(images, np.arange(10) % 2, stats=ChannelStats((0.0, 0.0), (1.0, 1.0)))
    plain = base.take(torch.arange(10))[0]
    data = FlipCrop(base, seed=3)
    whole = data.take(torch.arange(10))[0]
    # Any batching of the rows (other worker counts, a resumed epoch) sees the same samples.
    order = torch.tensor([7, 1, 4, 0, 2, 3, 5, 6, 8, 9])
    parts = [data.take(rows)[0] for rows in (order[:3], order[3:])]
    assert torch.equal(torch.cat(parts)[order.argsort()], whole)
    assert torch.equal(FlipCrop(base, seed=3).take(torch.arange(10))[0], whole)
    data.set_epoch(1)
    assert not torch.equal(data.take(torch.arange(10))[0], whole)
    assert not torch.equal(FlipCrop(base, seed=4).take(torch.arange(10))[0], whole)
    # Each sample is its image shifted by at most PAD pixels (zeros coming in), maybe flipped.
    padded = torch.nn.functional.pad(plain, (PAD, PAD, PAD, PAD))
    for sample, source in zip(whole, padded, strict=True):
        crops = [
            crop
            for dy in range(2 * PAD + 1)
            for dx in range(2 * PAD + 1)
            for crop in (source[:, dy : dy + 6, dx : dx + 5],)
        ]
        assert any(torch.equal(sample, c) or torch.equal(sample, c.flip(-1)) for c in crops)
    assert not torch.equal(whole, plain)


# --- tokens ----------------------------------------------------------------------------------


def test_token_windows_do_not_overlap_and_splits_are_contiguous_ranges(tmp_path):
    tokenize_file(_corpus(tmp_path), tmp_path / "c.bin", "char")
    tokens, meta = open_tokens(tmp_path / "c.bin")
    text = (tmp_path / "c.txt").read_text(encoding="utf-8")
    assert meta.decode(tokens) == text and meta.chars == tuple(sorted(set(text)))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8
    splits = token_splits(tmp_path / "c.bin", context=16, fractions=(0.8, 0.1, 0.1))
    assert splits["train"].spec == DataSpec("tokens", (16,), meta.vocab_size, meta.vocab_size, 16)
    previous_stop = 0
    for split in splits.values():
        assert split.start == previous_stop  # contiguous, in order, no token shared
        previous_stop = split.stop
        x, y = split.take(torch.arange(len(split)))
        assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        flat = x.reshape(-1).numpy()  # windows tile the range without overlap
        assert np.array_equal(flat, tokens[split.start : split.start + flat.size])
        assert split.start + flat.size + 1 <= split.stop  # the last target stays inside
    assert previous_stop == len(tokens)
    with pytest.raises(DataError, match="fewer than one window"):
        token_splits(tmp_path / "c.bin", context=1000)


@pytest.mark.parametrize("labels", [torch.arange(6), torch.rand(6), torch.rand(6, 2).half()])
def test_tensor_split_take_gathers_rows_of_any_rank_and_label_dtype(labels):
    features = torch.randn(6, 3, 2, 2)
    rows = torch.tensor([5, 0, 5, 2])
    x, y = TensorSplit(features, labels).take(rows)
    assert torch.equal(x, features[rows]) and torch.equal(y, labels[rows])
    assert TensorSplit(features, labels).take(rows[:0])[0].shape == (0, 3, 2, 2)
    with pytest.raises(IndexError):  # refused, not wrapped round to the last row
        TensorSplit(features, labels).take(torch.tensor([-1]))


def test_a_20_mb_token_file_is_tokenized_and_read_without_loading_it(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 20_000_000, dtype=np.uint8).tofile(tmp_path / "big.txt")
    tracemalloc.start()
    try:
        meta = tokenize_file(tmp_path / "big.txt", tmp_path / "big.bin", "byte")
        train = token_splits(tmp_path / "big.bin", context=256)["train"]
        x, _ = train.take(torch.randperm(len(train))[:32])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta.num_tokens == 20_000_000 and isinstance(train.tokens, np.memmap)
    assert x.shape == (32, 256)
    assert peak < 4_000_000, f"peak {peak / 1e6:.1f} MB for a 20 MB corpus"


def test_stdlib_corpus_is_deterministic_real_text_with_plausible_entropies(tmp_path):
    size = build_stdlib_corpus(tmp_path / "a.txt", 2_000_000)
    build_stdlib_corpus(tmp_path / "b.txt", 2_000_000)
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    assert 1_990_000 <= size <= 2_000_000
    text = (tmp_path / "a.txt").read_text(encoding="utf-8")  # valid UTF-8, cut included
    assert "def " in text and "import " in text and "site-packages" not in text[:100]
    meta = tokenize_file(tmp_path / "a.txt", tmp_path / "a.bin", "char")
    tokens, _ = open_tokens(tmp_path / "a.bin")
    unigram, bigram = unigram_entropy(tokens), bigram_entropy(tokens)
    assert meta.vocab_size < 256 and 3.0 < unigram < 3.7 and 2.0 < bigram < 2.8, (unigram, bigram)


def test_entropies_match_hand_computed_values():
    assert unigram_entropy(np.array([0, 1, 0, 1])) == pytest.approx(np.log(2))
    assert bigram_entropy(np.array([0, 1] * 50)) == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 4, 200_000)
    assert bigram_entropy(noise) == pytest.approx(np.log(4), abs=0.01)


# --- parquet ---------------------------------------------------------------------------------


@pytest.fixture
def counted_parquet(tmp_path, monkeypatch):
    """A 10-row-group file; every decode of a row group is counted, whole-file reads fail."""
    pq.write_table(_table(100), tmp_path / "t.parquet", row_group_size=10)
    calls: list[int] = []
    real = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        calls.append(i)
        return real(self, i, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    monkeypatch.setattr(pq.ParquetFile, "read", refused)
    monkeypatch.setattr(pq, "read_table", refused)
    return tmp_path / "t.parquet", calls


def test_parquet_take_reads_only_the_row_groups_it_needs(counted_parquet):
    path, calls = counted_parquet
    data = ParquetRows(
        path, ["a", "b"], "label", {"cat": 0, "dog": 1, "eel": 2}, cache_row_groups=2
    )
    assert len(data) == 100 and data.num_row_groups == 10 and calls == []
    x, y = data.take(torch.tensor([57, 21, 55, 29]))
    assert sorted(calls) == [2, 5], "only row groups 2 and 5 hold these rows"
    assert x[:, 0].tolist() == [57, 21, 55, 29] and x[:, 1].tolist() == [114, 42, 110, 58]
    assert y.tolist() == [0, 0, 1, 2] and data.spec == DataSpec("table", (2,), 3)
    data.take(torch.tensor([50, 20]))
    assert len(calls) == 2, "cached row groups are not read again"
    data.take(torch.tensor([99]))  # group 9 evicts the least recently used (2)
    data.take(torch.tensor([20]))
    assert calls == [2, 5, 9, 2] and data.row_groups_read == 4


def test_parquet_labels_map_through_the_callers_classes(counted_parquet):
    path, _ = counted_parquet
    standardized = ParquetRows(
        path, ["a"], "label", {"eel": 0, "dog": 1, "cat": 0}, mean=[50.0], std=[10.0]
    )
    x, y = standardized.take(torch.tensor([70, 1, 2]))
    assert x[:, 0].tolist() == pytest.approx([2.0, -4.9, -4.8]) and y.tolist() == [1, 1, 0]
    with pytest.raises(DataError, match="label 'eel'.*row 3.*not among the 2 classes"):
        ParquetRows(path, ["a"], "label", {"cat": 0, "dog": 1}).take(torch.tensor([2]))
    with pytest.raises(DataError, match="no column 'c'"):
        ParquetRows(path, ["c"], "label", {"cat": 0})
    with pytest.raises(ValueError, match="0..K-1"):
        ParquetRows(path, ["a"], "label", {"cat": 1})


def test_an_image_in_a_subfolder_of_its_class_is_that_class_and_hidden_ones_are_skipped(tmp_path):
    """As torchvision's ImageFolder reads a folder: `cat/indoor/1.png` is a cat."""
    root = tmp_path / "pets"
    where = {
        "cat/1.png": 10,
        "cat/indoor/2.png": 20,
        "cat/indoor/sofa/3.png": 30,
        "dog/4.png": 200,
        "dog/.ipynb_checkpoints/5.png": 0,  # a notebook's copy: not a sixth image
        ".cache/6.png": 0,  # a hidden folder is no class
    }
    for name, grey in where.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("L", (4, 4), grey).save(root / name)
    folder = ImageFolder(root, train_rows=np.arange(4))
    assert folder.classes == ["cat", "dog"]
    assert [f.relative_to(root).as_posix() for f in folder.files] == [
        "cat/1.png",
        "cat/indoor/2.png",
        "cat/indoor/sofa/3.png",
        "dog/4.png",
    ]
    assert folder.labels.tolist() == [0, 0, 0, 1]
    assert folder.read(np.arange(4))[:, 0, 0, 0].tolist() == [10, 20, 30, 200]
