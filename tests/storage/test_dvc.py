"""DVC versions the dataset into the real S3 remote, and `dvc repro` reproduces the split."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from trainyard.config import load_config
from trainyard.data.split import prepare_splits
from trainyard.data.tables import write_digits
from trainyard.datasets.images import write_pgm
from trainyard.errors import DataError
from trainyard.project import ProjectPaths
from trainyard.storage import connect
from trainyard.storage.versioning import REMOTE, configure_remote, content_md5, dvc, version_dataset

DVC = str(Path(sys.executable).parent / "dvc")


def test_dataset_is_versioned_and_pushed_to_the_store(project):
    paths = ProjectPaths(project)
    config = load_config(paths.params)
    write_digits(project / config.data.path)
    store = connect(config.storage, paths)
    configure_remote(project, store)
    assert "secret_access_key" in (project / ".dvc" / "config.local").read_text()
    assert "secret_access_key" not in (project / ".dvc" / "config").read_text()

    version = version_dataset(project, config.data.path)
    tracked = project / f"{config.data.path}.dvc"
    before = [p.stat().st_mtime_ns for p in (tracked, project / config.data.path)]
    again = version_dataset(project, config.data.path)
    assert again == version, "versioning an unchanged file must be a no-op with the same hash"
    # not rewritten: another run may be reading them
    assert [p.stat().st_mtime_ns for p in (tracked, project / config.data.path)] == before
    # under the run store's bucket and prefix (storage.prefix is per test here)
    pushed = f"dvc/files/md5/{version.dvc_md5[:2]}/{version.dvc_md5[2:]}"
    assert (
        store.settings.prefix
        and store.get_bytes(pushed) == (project / config.data.path).read_bytes()
    )
    assert version.dvc_md5 == content_md5(project / config.data.path)  # what preflight computes
    assert (project / ".dvc" / "config.local").stat().st_mode & 0o777 == 0o600

    (project / config.data.path).write_text(
        (project / config.data.path).read_text().replace("\n0,", "\n1,", 1)
    )
    assert version_dataset(project, config.data.path).dvc_md5 != version.dvc_md5


def write_image_folder(folder: Path) -> None:
    """3 classes x 3 images, as .npy arrays and .pgm graymaps (both formats of a folder)."""
    rng = np.random.default_rng(0)
    for i in range(9):
        image = rng.integers(0, 256, (4, 4), dtype=np.uint8)
        (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        if i % 2:
            write_pgm(folder / f"c{i % 3}" / f"{i}.pgm", image)
        else:
            np.save(folder / f"c{i % 3}" / f"{i}.npy", image)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*.*")}


def test_an_image_folder_is_versioned_as_a_dvc_directory_and_pushed(project):
    paths = ProjectPaths(project)
    config = load_config(paths.params)
    folder = project / "data" / "shapes"
    write_image_folder(folder)
    configure_remote(project, connect(config.storage, paths))

    version = version_dataset(project, "data/shapes")
    out = yaml.safe_load((project / "data/shapes.dvc").read_text())["outs"][0]
    # content_md5: what `trainyard run` and `join` compute before (or without) versioning
    assert version.dvc_md5 == out["md5"] == content_md5(folder)
    assert version.dvc_md5.endswith(".dir") and out["nfiles"] == 9
    assert version.size == sum(len(b) for b in folder_bytes(folder).values())
    watched = [project / "data/shapes.dvc", *sorted(folder.rglob("*.*"))]
    before = [p.stat().st_mtime_ns for p in watched]
    assert version_dataset(project, "data/shapes") == version
    assert [p.stat().st_mtime_ns for p in watched] == before, "unchanged: nothing rewritten"

    # Pushed: with the folder and the local cache gone, the remote alone restores it.
    written = folder_bytes(folder)
    shutil.rmtree(folder)
    shutil.rmtree(project / ".dvc" / "cache")
    dvc(project, "pull", "--quiet", "--remote", "store", "data/shapes.dvc")
    assert folder_bytes(folder) == written

    np.save(folder / "c0" / "0.npy", np.zeros((4, 4), np.uint8))  # one image changes
    changed = version_dataset(project, "data/shapes", push=False)
    assert version.dvc_md5 != changed.dvc_md5 == content_md5(folder)
    (folder / "__pycache__").mkdir()  # DVC skips it (.dvcignore), content_md5 does not
    (folder / "__pycache__" / "x.pyc").write_bytes(b"x")
    with pytest.raises(DataError, match=r"data/shapes: DVC versioned .* \.dvcignore pattern"):
        version_dataset(project, "data/shapes", push=False)
    with pytest.raises(DataError, match=r"data/gone: dataset file not found"):
        version_dataset(project, "data/gone")


def test_dvc_repro_reproduces_the_prepare_stage_byte_for_byte(project):
    paths = ProjectPaths(project)
    config = load_config(paths.params)
    write_digits(project / config.data.path)
    prepare_splits(config.data, config.split, project / config.data.path, paths.processed)
    from_engine = {p.name: p.read_bytes() for p in sorted(paths.processed.iterdir())}
    for p in paths.processed.iterdir():
        p.unlink()

    path = (
        f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # the stage runs `trainyard prepare`
    )
    done = subprocess.run(
        [DVC, "repro", "prepare"],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
    )
    assert done.returncode == 0, done.stderr
    from_dvc = {p.name: p.read_bytes() for p in sorted(paths.processed.iterdir())}
    assert from_dvc == from_engine
    arrays = {f"{s}_{part}.npy" for s in ("train", "val", "test") for part in ("x", "y", "order")}
    assert set(from_dvc) == arrays | {"schema.json"}
    assert "data/processed" in (project / "dvc.lock").read_text()


def test_credentials_starting_with_a_dash_reach_config_local(tmp_path):
    """Generated secrets (token_urlsafe) start with '-' one time in 64: not a dvc option."""
    from trainyard.storage import Store, StoreSettings

    from conftest import make_project

    root = make_project(tmp_path / "project")
    # And characters an INI reader could take for a list, a comment or a quote.
    for secret in ("-_starts-with-a-dash", "wJal/rX+U=tn,FE#MI\"K7'x"):
        configure_remote(root, Store(StoreSettings("trainyard", "", None, "-AKIA", secret)))
        shown = subprocess.run(
            [DVC, "config", "--local", f"remote.{REMOTE}.secret_access_key"],
            cwd=root, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert shown.stdout.strip() == secret, "DVC reads back exactly what was written"
    access = subprocess.run(
        [DVC, "config", "--local", f"remote.{REMOTE}.access_key_id"],
        cwd=root, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert access.stdout.strip() == "-AKIA"
