"""The bytes trained are the bytes recorded, and what a run reads stays inside data/.

A data file swapped after `dvc add`, a damaged split cache, symlinks out of an image folder,
a line too long to parse and more classes than a split can hold: each is caught before it
reaches training, in one line, and none poisons a later run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard.config import DataConfig, SplitConfig, TrainyardConfig, load_config
from trainyard.data.split import (
    DIGEST_FILE,
    SPLITS,
    SplitSchema,
    prepare_cached_splits,
    prepare_splits,
    read_split_frame,
)
from trainyard.data.tables import check_line_lengths
from trainyard.data.tensors import open_split
from trainyard.datasets.images import write_pgm
from trainyard.errors import ConfigError, DataError
from trainyard.project import ProjectPaths
from trainyard.runs.preflight import preflight
from trainyard.runs.record import load_record
from trainyard.storage import connect
from trainyard.storage.versioning import configure_remote, content_md5, version_dataset

from conftest import trainyard_cli

POINTS = "data/raw/points.csv"


def write_points(path: Path, shift: int = 0) -> dict[int, str]:
    """60 rows of 3 classes, each row traceable by its id; `shift` moves every label one
    class on (the swapped file of the issue). Returns row id -> label."""
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = {i: f"c{(i % 3 + shift) % 3}" for i in range(60)}
    lines = [f"{i},{i % 3 + 0.01 * i},{labels[i]}" for i in range(60)]
    path.write_text("row_id,x,label\n" + "\n".join(lines) + "\n")
    return labels


def split_labels(folder: Path) -> dict[int, str]:
    """Row id -> label over every split of a prepared folder."""
    schema = SplitSchema.read(folder)
    found: dict[int, str] = {}
    for name in SPLITS:
        frame = read_split_frame(folder, name, schema)
        found.update(zip(frame["row_id"].astype(int), frame["label"], strict=True))
    return found


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_file_swapped_after_dvc_add_trains_on_the_recorded_bytes(project):
    """The seam of the issue: the version is determined (`dvc add`, logged as the run's
    md5), then the working file is swapped for one with shifted labels before the split
    reads it. The split copies DVC's cache object of that md5, so it holds the genuine
    labels; with no cache object it refuses in one line; a later run is not poisoned."""
    paths = ProjectPaths(project)
    data = DataConfig(path=POINTS, label_column="label")
    genuine = write_points(project / POINTS)
    configure_remote(project, connect(load_config(paths.params).storage, paths))
    version = version_dataset(project, POINTS)
    shifted = write_points(project / POINTS, shift=1)  # swapped, not added again
    swapped_md5 = content_md5(project / POINTS)

    split = prepare_cached_splits(paths, data, SplitConfig(seed=1), version.dvc_md5)
    assert split_labels(split.folder) == genuine != shifted

    # Without DVC's cache object (a cleared cache, another machine) the working file is all
    # there is: it does not hash to the recorded md5, so the run stops before any split.
    shutil.rmtree(project / ".dvc" / "cache")
    with pytest.raises(DataError) as refused:
        prepare_cached_splits(paths, data, SplitConfig(seed=2), version.dvc_md5)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"{POINTS}: DVC recorded md5 {version.dvc_md5}, but the file read as md5 {swapped_md5}"
    )
    assert f"`dvc add {POINTS}` again" in message and f"`dvc checkout {POINTS}`" in message
    assert os.listdir(split.folder.parent) == [split.key]  # nothing filed, no temporaries

    # The genuine file back: the next run versions it (same md5) and its split is genuine.
    write_points(project / POINTS)
    again = version_dataset(project, POINTS)
    assert again.dvc_md5 == version.dvc_md5
    later = prepare_cached_splits(paths, data, SplitConfig(seed=2), again.dvc_md5)
    assert split_labels(later.folder) == genuine


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_whose_file_is_swapped_after_versioning_trains_as_recorded(project, prefect_api):
    """The same seam in the real flow: the pipeline versions the data, then hands the
    version to `train_and_evaluate`; the file is swapped in between. That run trains on
    the genuine labels, and so does a later `trainyard run`, which reuses its split."""
    from flows.train_and_evaluate import train_and_evaluate

    paths = ProjectPaths(project)
    overrides = [
        f"data.path={POINTS}",
        "data.label_column=label",
        "train.epochs=1",
        "train.workers=1",
        "train.batch_size=8",
        "tracking.backend=none",
    ]
    config = load_config(paths.params, overrides)
    genuine = write_points(project / POINTS)
    preflight(config, project)
    configure_remote(project, connect(config.storage, paths))
    version = version_dataset(project, POINTS)  # the pipeline's version task
    write_points(project / POINTS, shift=1)
    record = train_and_evaluate(
        config=config, dataset=version, project_dir=str(project), run_id="swapped"
    )
    assert record.status == "completed" and record.dataset.dvc_md5 == version.dvc_md5
    assert split_labels(paths.split_cache(record.dataset.split_key)) == genuine

    write_points(project / POINTS)
    args = [a for override in overrides for a in ("-S", override)]
    done = trainyard_cli("run", "--run-id", "later", *args, cwd=project)
    assert done.returncode == 0, done.stderr[-3000:]
    later = load_record(connect(config.storage, paths), "later")
    assert later.dataset.dvc_md5 == version.dvc_md5
    assert later.dataset.split_key == record.dataset.split_key
    assert split_labels(paths.split_cache(later.dataset.split_key)) == genuine


def test_an_image_folder_changed_after_dvc_add_is_read_as_recorded(project):
    """A folder's version lists each file's md5: an image replaced after `dvc add` is read
    from DVC's cache; without the cache the folder's changed file is refused by name."""
    paths = ProjectPaths(project)
    data = DataConfig(path="data/shapes")
    write_image_folder(project / "data/shapes")
    configure_remote(project, connect(load_config(paths.params).storage, paths))
    version = version_dataset(project, "data/shapes", push=False)
    genuine = prepare_splits(data, SplitConfig(seed=1), project / "data/shapes", project / "g")
    np.save(project / "data/shapes/c1/4.npy", np.full((4, 4), 255, np.uint8))

    split = prepare_cached_splits(paths, data, SplitConfig(seed=1), version.dvc_md5)
    assert split.schema == genuine
    for name in SPLITS:
        assert (split.folder / f"{name}_x.npy").read_bytes() == (
            project / "g" / f"{name}_x.npy"
        ).read_bytes()

    shutil.rmtree(project / ".dvc" / "cache")
    with pytest.raises(DataError, match=r"^data/shapes: DVC recorded md5 \w+\.dir, but the"):
        prepare_cached_splits(paths, data, SplitConfig(seed=2), version.dvc_md5)


def test_a_users_dataset_is_read_by_workers_from_the_recorded_bytes(tmp_path):
    """A split of the user's own dataset holds row numbers; workers open the dataset again.
    They open the split's kept copy, not the working file, which changed meanwhile."""
    path = tmp_path / "data/points.jsonl"
    path.parent.mkdir(parents=True)

    def write(shift: int) -> list[int]:
        labels = [(i % 3 + shift) % 3 for i in range(30)]
        path.write_text("".join(f'{{"x": [{i}], "label": {k}}}\n' for i, k in enumerate(labels)))
        return labels

    genuine = write(0)
    md5 = content_md5(path)
    write(1)  # changed after it was versioned; no DVC cache here: refused
    data = DataConfig(path="data/points.jsonl", dataset="tests_support:points")
    with pytest.raises(DataError, match=rf"points\.jsonl: DVC recorded md5 {md5}, but the file"):
        prepare_cached_splits(ProjectPaths(tmp_path), data, SplitConfig(seed=1), md5)

    write(0)
    split = prepare_cached_splits(ProjectPaths(tmp_path), data, SplitConfig(seed=1), md5)
    write(1)  # changed again while the run trains
    read = {}
    for name in SPLITS:
        part = open_split(split.folder, name, split.schema, tmp_path)
        x, y = part.take(torch.arange(len(part)))
        read.update(zip(x[:, 0].int().tolist(), y.tolist(), strict=True))
    assert read == dict(enumerate(genuine))


def test_a_split_reads_only_a_dvc_md5(tmp_path):
    with pytest.raises(DataError, match=r"'md5-a' is not a DVC md5; version the data"):
        prepare_cached_splits(ProjectPaths(tmp_path), DataConfig(), SplitConfig(), "md5-a")


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete", "no digest"])
def test_a_damaged_cached_split_is_built_again_not_reused(tmp_path, damage):
    paths = ProjectPaths(tmp_path)
    genuine = write_points(tmp_path / POINTS)
    data, md5 = DataConfig(path=POINTS, label_column="label"), content_md5(tmp_path / POINTS)
    first = prepare_cached_splits(paths, data, SplitConfig(seed=1), md5)
    written = folder_bytes(first.folder)
    assert DIGEST_FILE in written

    labels = first.folder / "train_y.npy"
    if damage == "truncate":
        os.truncate(labels, labels.stat().st_size - 8)
    elif damage == "alter":  # the last class id, same size: a label moved to another class
        body = bytearray(labels.read_bytes())
        body[-8] = (body[-8] + 1) % 3
        labels.write_bytes(bytes(body))
    elif damage == "delete":
        labels.unlink()
    else:  # a folder without its digest: half-built by hand, or left by older code
        (first.folder / DIGEST_FILE).unlink()
    assert folder_bytes(first.folder) != written

    again = prepare_cached_splits(paths, data, SplitConfig(seed=1), md5)
    assert again.folder == first.folder and folder_bytes(again.folder) == written
    assert split_labels(again.folder) == genuine
    assert os.listdir(first.folder.parent) == [first.key]  # the damaged copy is gone


# --- what preflight refuses before anything starts -----------------------------------------


def write_image_folder(folder: Path, classes: int = 3) -> None:
    """`classes` classes x 10 tiny grayscale images, as .pgm graymaps and .npy arrays (a
    class folder each; with classes=0, 10 images in `folder` itself)."""
    rng = np.random.default_rng(0)
    for i in range(10 * max(classes, 1)):
        place = folder / f"c{i % classes}" if classes else folder
        place.mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 256, (4, 4), dtype=np.uint8)
        if i % 2:
            write_pgm(place / f"{i}.pgm", image)
        else:
            np.save(place / f"{i}.npy", image)


def image_config() -> TrainyardConfig:
    return TrainyardConfig.model_validate(
        {
            "data": {"path": "data/shapes"},
            "model": {"name": "linear", "options": {}},
            "train": {"batch_size": 2, "workers": 1},
        }
    )


def test_symlinks_out_of_data_inside_an_image_folder_are_refused(tmp_path):
    root = tmp_path / "project"
    write_image_folder(root / "data/shapes")
    outside = tmp_path / "elsewhere"
    write_image_folder(outside)
    preflight(image_config(), root)  # the folder as it is: fine

    # a link inside data/ (to a file or a class folder) is data/'s own
    os.symlink(root / "data/shapes/c0/0.npy", root / "data/shapes/c1/copy.npy")
    write_image_folder(root / "data/more", classes=0)
    os.symlink(root / "data/more", root / "data/shapes/c3")
    preflight(image_config(), root)

    for link, target in [
        ("data/shapes/c0/stolen.npy", outside / "c0/0.npy"),  # an image out of data/
        ("data/shapes/c4", outside / "c1"),  # a whole class folder out of data/
        ("data/more/x.pgm", outside / "c2/5.pgm"),  # out, through a folder link inside
    ]:
        os.symlink(target, root / link)
        with pytest.raises(ConfigError) as refused:
            preflight(image_config(), root)
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"{link}: a symlink to {target}, outside {root / 'data'}")
        (root / link).unlink()


def test_trainyard_run_refuses_a_linked_image_in_one_line_and_pushes_nothing(project, tmp_path):
    write_image_folder(project / "data/shapes")
    (tmp_path / "secret.npy").parent.mkdir(exist_ok=True)
    np.save(tmp_path / "secret.npy", np.zeros((4, 4), np.uint8))
    os.symlink(tmp_path / "secret.npy", project / "data/shapes/c0/secret.npy")
    done = trainyard_cli("run", "-S", "data.path=data/shapes", cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "data/shapes/c0/secret.npy: a symlink to" in done.stderr
    # refused before DVC saw it: nothing versioned, cached or pushed, nothing started
    assert not (project / "data/shapes.dvc").exists() and not (project / ".dvc/cache").exists()
    assert not (project / ".trainyard").exists()


def test_trainyard_run_refuses_a_line_too_long_to_parse_before_launch(project):
    body = "a,b,label\n1,2,x\n" + "3," * (4 << 20) + "y\n" + "5,6,x\n"  # line 3: 8 MiB + 2
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    (project / "data/raw/long.csv").write_text(body)
    done = trainyard_cli("run", "-S", "data.path=data/raw/long.csv", cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "long.csv: line 3 runs past 8 MiB without a line break" in done.stderr
    assert not (project / ".trainyard").exists()


def test_line_lengths_are_measured_by_record_and_named_by_line(tmp_path):
    path = tmp_path / "t.csv"
    quoted = 'a,label\n"1\n' + "2\n" * 10 + '",x\n'  # one record over 12 lines, 25 bytes
    path.write_text(quoted + "3,y\n")
    check_line_lengths(path, limit=40)
    path.write_text("a,label\r1,x\r" + "9" * 39 + ",y\r")  # carriage returns end lines too
    with pytest.raises(DataError, match=r"t\.csv: line 1 runs past 40 bytes"):
        check_line_lengths(path, limit=40)  # (lines are counted by \n: a \r file is line 1)
    path.write_text(quoted + "3," * 20 + "y\n")  # line 14: after the quoted record's lines
    with pytest.raises(DataError, match=r"t\.csv: line 14 runs past 30 bytes"):
        check_line_lengths(path, limit=30)
    path.write_text('a,label\n1,x\n"never closed,\n' + "4,x\n" * 10)
    with pytest.raises(DataError, match=r"t\.csv: line 3 runs past 30 bytes"):
        check_line_lengths(path, limit=30)


def records_of(data: bytes) -> list[tuple[int, int]]:
    """(length, line it starts on) of each record, byte by byte: a record ends at a line
    break outside double quotes; lines are counted by \\n."""
    records, line, start_line, length, quoted = [], 1, 1, 0, False
    for byte in data:
        if byte in b"\r\n" and not quoted:
            records.append((length, start_line))
            line += byte == ord("\n")
            start_line, length = line, 0
            continue
        quoted ^= byte == ord('"')
        line += byte == ord("\n")
        length += 1
    return [*records, (length, start_line)]


def test_line_lengths_agree_with_a_byte_by_byte_reading(tmp_path):
    """Random quoted, multi-line and carriage-return records, read in blocks of the limit's
    size: the check refuses exactly when some record is longer, naming the first such."""
    rng = np.random.default_rng(0)
    path = tmp_path / "r.csv"
    for _ in range(300):
        data = bytes(rng.choice(list(b'ab,"\n\r'), size=int(rng.integers(1, 400))).tolist())
        path.write_bytes(data)
        limit = int(rng.integers(5, 60))
        first_too_long = next((line for length, line in records_of(data) if length > limit), None)
        if first_too_long is None:
            check_line_lengths(path, limit=limit)
        else:
            with pytest.raises(DataError, match=rf": line {first_too_long} runs past"):
                check_line_lengths(path, limit=limit)


def classes_table(path: Path, classes: int, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{i % classes + 0.01 * i},c{i % classes}" for i in range(rows)]
    path.write_text("x,label\n" + "\n".join(lines) + "\n")


def test_trainyard_run_refuses_more_classes_than_a_split_holds_before_launch(project):
    classes_table(project / "data/raw/many.csv", 100, 300)  # val and test get 45 rows each
    done = trainyard_cli("run", "-S", "data.path=data/raw/many.csv", cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "many.csv: 100 classes, but the val split gets 45 of the 300 rows" in done.stderr
    assert "raise split.val_fraction" in done.stderr
    assert not (project / ".trainyard").exists()  # no store, no Prefect, no torchrun


@pytest.mark.parametrize(
    ("rows", "val", "test"), [(60, 0.15, 0.15), (60, 0.1, 0.3), (97, 0.2, 0.1)]
)
def test_the_class_check_draws_the_line_where_the_split_does(tmp_path, rows, val, test):
    """With the most classes preflight allows, the real split succeeds; with one more,
    both refuse (the split with sklearn's own words). 60 x 0.4 is 24.000000000000004 in
    floating point, which sklearn rounds up to 25 held-out rows: the check must too."""
    data = tmp_path / "data/t.csv"
    allowed = None
    for classes in range(2, rows // 3 + 1):  # at least 3 rows per class
        classes_table(data, classes, rows)
        config = TrainyardConfig.model_validate(
            {
                "data": {"path": "data/t.csv", "label_column": "label"},
                "split": {"val_fraction": val, "test_fraction": test},
                "train": {"batch_size": 1, "workers": 1},
            }
        )
        try:
            preflight(config, tmp_path)
        except DataError as exc:
            assert f"{classes} classes, but the" in str(exc)
            with pytest.raises(DataError, match="cannot split with these fractions"):
                prepare_splits(config.data, config.split, data, tmp_path / "refused")
            break
        prepare_splits(config.data, config.split, data, tmp_path / f"ok{classes}")
        allowed = classes
    assert allowed is not None and allowed + 1 == classes
