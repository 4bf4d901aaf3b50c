"""The dataset's bytes as DVC recorded them, copied for the split to read.

A run names its data by the md5 `dvc add` recorded, but the file under data/ can change
after that (edited, swapped, restored from a backup) while the run goes on. Had the split
read the working file, its result would be filed under a hash of other bytes, and every
later run with the genuine file would reuse it. So the split reads a private copy, hashed
while it is copied: what the split reads is what was hashed, and a copy that does not hash
to the recorded md5 is refused. The copy is taken from DVC's cache object of that md5 when
the cache holds it (the run then trains on the recorded bytes even if the working file
changed), else from the working file.

DVC's layout, as `dvc add` writes it: `.dvc/cache/files/md5/<2>/<30>` per file, and for a
folder a `<md5>.dir` object listing `{md5, relpath}` per file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainyard.errors import DataError

BLOCK = 1 << 20  # bytes copied at a time: memory stays flat whatever the file's size


def cache_object(root: Path, md5: str) -> Path:
    """Where DVC's cache (at its default place) keeps the object of this md5."""
    return root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def listing_md5(listing: list[dict[str, str]]) -> str:
    """A folder's DVC hash: dvc_data's Tree digest, json.dumps with sorted keys and default
    separators of the `{md5, relpath}` entries sorted by relpath."""
    text = json.dumps(listing, sort_keys=True).encode("utf-8")
    return hashlib.md5(text).hexdigest() + ".dir"


def copy_recorded(root: Path, data_path: str, md5: str, into: Path) -> Path:
    """The dataset `data_path` as of `md5`, copied into the empty folder `into` under its own
    name; raises a DataError naming the file when the bytes read are not the recorded ones."""
    if not _is_dvc_md5(md5):
        raise DataError(f"{data_path}: {md5!r} is not a DVC md5; version the data with `dvc add`")
    target = into / Path(data_path).name
    if md5.endswith(".dir"):
        _copy_folder(root, data_path, md5, target)
    else:
        _copy_checked(root, data_path, data_path, md5, target)
        labels = (root / data_path).with_name(f"{target.stem}.labels.npy")
        if target.suffix == ".npy" and labels.is_file():
            # An .npy image array's labels file beside it: read as it is (DVC versions
            # data.path alone).
            _copy_hashed(labels, target.with_name(labels.name))
    return target


def _is_dvc_md5(md5: str) -> bool:
    digits = md5.removesuffix(".dir")
    return len(digits) == 32 and all(c in "0123456789abcdef" for c in digits)


def _copy_hashed(source: Path, target: Path) -> str:
    """Copy `source` to the new file `target`, returning the md5 of the bytes copied."""
    digest = hashlib.md5()
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as reader, target.open("xb") as writer:
        for block in iter(lambda: reader.read(BLOCK), b""):
            digest.update(block)
            writer.write(block)
    return digest.hexdigest()


def _copy_checked(root: Path, name: str, dataset: str, md5: str, target: Path) -> None:
    """One file of the dataset (`name`, relative to the project): DVC's cache object if
    present, else the working file. `dataset` is data.path, what the fix names."""
    cached = cache_object(root, md5)
    source = cached if cached.is_file() else root / name
    if not source.is_file():
        raise DataError(f"{name}: dataset file not found; restore it with `dvc checkout {dataset}`")
    read = _copy_hashed(source, target)
    if read == md5:
        return
    if source == cached:
        raise DataError(
            f"{name}: DVC's cache object {cached.relative_to(root)} reads as md5 {read}, "
            f"not the recorded {md5}; delete that object and run `dvc add {dataset}` again"
        )
    raise DataError(
        f"{name}: DVC recorded md5 {md5}, but the file read as md5 {read} (it changed after "
        f"`dvc add`); run `dvc add {dataset}` again to train on it, or restore the recorded "
        f"one with `dvc checkout {dataset}`"
    )


def _copy_folder(root: Path, data_path: str, md5: str, target: Path) -> None:
    """Every file the folder's version lists, each checked against its own md5 when DVC's
    `.dir` object gives them; the listing of what was copied must hash to `md5`."""
    working = root / data_path
    recorded = _recorded_listing(root, md5)
    copied = []
    for relpath, file_md5 in recorded or _working_listing(working):
        if Path(relpath).is_absolute() or ".." in Path(relpath).parts:
            raise DataError(f"{data_path}: DVC's listing names {relpath!r}, outside the folder")
        source, destination = working / relpath, target / relpath
        if file_md5 is not None:
            _copy_checked(root, f"{data_path}/{relpath}", data_path, file_md5, destination)
            read = file_md5
        elif source.is_file():
            read = _copy_hashed(source, destination)
        else:
            continue  # gone while the folder was walked: the listing's hash says so below
        copied.append({"md5": read, "relpath": relpath})
    read = listing_md5(sorted(copied, key=lambda entry: entry["relpath"]))
    if read != md5:
        raise DataError(
            f"{data_path}: DVC recorded md5 {md5}, but the folder's files read as md5 {read} "
            f"(they changed after `dvc add`); run `dvc add {data_path}` again to train on "
            f"them, or restore the recorded ones with `dvc checkout {data_path}`"
        )


def _recorded_listing(root: Path, md5: str) -> list[tuple[str, str]] | None:
    """(relpath, md5) per file from DVC's `.dir` object, if the cache holds an intact one."""
    try:
        listing = json.loads(cache_object(root, md5).read_bytes())
        if listing_md5(listing) != md5:
            return None
        return [(entry["relpath"], entry["md5"]) for entry in listing]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # absent or unreadable: the working folder, checked as a whole


def _working_listing(folder: Path) -> list[tuple[str, None]]:
    """The folder's files as DVC walks it (os.walk: file symlinks read, folder ones not)."""
    found = []
    for parent, _, names in os.walk(folder):
        found += [(Path(parent, name).relative_to(folder).as_posix(), None) for name in names]
    return sorted(found)
