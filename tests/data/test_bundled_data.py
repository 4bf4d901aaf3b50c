"""The bundled example datasets leave a clone as clean as they found it: their `.dvc` files
and ignore entries are committed, and what `dvc add` writes for them on first use is exactly
what is committed, so the README's commands never make later runs `(dirty)`."""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
from pathlib import Path

import yaml

from trainyard.data.bundled import BUNDLED
from trainyard.storage.versioning import version_dataset

REPO = Path(__file__).resolve().parents[2]
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
# Built from the installed Python's own sources: the committed hash is CPython 3.11.7's (the
# version the Makefile's python3.11 is here); another build writes another corpus.
BUILT_BY = {"data/raw/stdlib.txt": "3.11.7"}


def _comparable(path: str) -> bool:
    return BUILT_BY.get(path, platform.python_version()) == platform.python_version()


def _tracked_checkout(root: Path) -> Path:
    """The repo's tracked files outside the package and tests, as a fresh clone has them."""
    listed = subprocess.run(
        [
            "git",
            "ls-files",
            "-z",
            "--",
            ".dvc",
            ".dvcignore",
            ".gitignore",
            "data",
            "dvc.yaml",
            "params.yaml",
        ],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    subprocess.run([*GIT, "init", "-q"], cwd=root, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=root, check=True)
    subprocess.run([*GIT, "commit", "-qm", "clone"], cwd=root, check=True)
    return root


def test_every_bundled_dataset_is_committed_with_the_hash_it_is_written_with(tmp_path):
    for path, write in BUNDLED.items():
        if not _comparable(path) or not path.endswith((".csv", ".npz", ".txt")):
            continue  # a folder's listing is checked by the clean-status test below
        committed = yaml.safe_load((REPO / f"{path}.dvc").read_text())["outs"][0]
        write(tmp_path / path)
        data = (tmp_path / path).read_bytes()
        assert (hashlib.md5(data).hexdigest(), len(data)) == (committed["md5"], committed["size"])


def test_the_bundled_datasets_first_use_leaves_git_status_clean(tmp_path):
    root = _tracked_checkout(tmp_path / "clone")
    for path, write in filter(lambda item: _comparable(item[0]), BUNDLED.items()):
        write(root / path)  # what the first run naming it does (trainyard.runs.preflight)
        version_dataset(root, path, push=False)  # and then its flow's `dvc add`
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert status.stdout == ""
