"""Sweep storage that loses nothing and opens nothing it should not: a full disk stops the
sweep in one line and a resume finishes it; a torn journal tail is trimmed (a copy kept) and
never appended after; each sweep has its own journal; readers open only the storages the
project configures, read-only, and create nothing. Real Optuna, real CLI, real store."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from test_sweep import (
    SMALL,
    TESTS,
    background_sweep,
    journal_of,
    journal_storage,
    sweep,
    sweep_id_of,
)

from trainyard.config import TrainyardConfig, load_config
from trainyard.data.bundled import BUNDLED
from trainyard.project import ProjectPaths
from trainyard.storage import Store
from trainyard.storage.versioning import content_md5
from trainyard.sweeps.journal import JournalError, repair_journal
from trainyard.sweeps.record import SweepRecord, load_sweep, save_sweep
from trainyard.sweeps.study import (
    SHARED_JOURNAL,
    SweepStudy,
    create_study,
    journal_path,
    storage_url,
)

from conftest import BIN, trainyard_cli
from training_jobs import wait_for

TORN = b'{"op_code":5,"worker_id":"w","trial_id":0,"st'  # half a record: no newline


def plant_sweep(
    store: Store,
    project: Path,
    sweep_id: str,
    config: TrainyardConfig | None = None,
    storage: str | None = None,
    study: bool | None = None,
) -> SweepRecord:
    """A sweep record in the store, of the project's data and `config`; a study with two
    completed trials, written through the sweep's own storage code, in `storage` (default:
    the sweep's own journal; a storage named is left alone unless `study`)."""
    config = config or load_config(project / "params.yaml")
    if storage is None:
        storage, study = str(journal_path(ProjectPaths(project), sweep_id)), True
    if study:
        name = f"trainyard-{sweep_id}"
        create_study(storage, name, "maximize", {})
        trials = SweepStudy(storage, name, config.sweep, config.train.epochs)
        for value in (0.5, 0.7):
            pending = trials.ask(config.sweep.space, None, None)  # type: ignore[arg-type]  # no run
            assert pending is not None  # no budget
            trials.complete(pending.number, value)
    data = project / config.data.path
    if not data.exists():
        BUNDLED[config.data.path](data)  # as a first run does
    record = SweepRecord(
        sweep_id=sweep_id,
        study_name=f"trainyard-{sweep_id}",
        storage=storage,
        direction="maximize",
        objective="val_accuracy",
        created_at="2026-11-20T10:00:00+00:00",
        dataset_path=config.data.path,
        dataset_md5=content_md5(data),
        code={},
        params=config.model_dump(mode="json"),
    )
    save_sweep(store, record)
    return record


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def optuna_trials(journal: Path, study_name: str) -> list[dict]:
    """The study's trials as Optuna's own CLI reads the journal file."""
    done = subprocess.run(
        [str(BIN / "optuna"), "trials", "--study-name", study_name, "--storage", str(journal),
         "-f", "json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_storage_setting_that_names_a_folder_is_refused_in_one_line(project):
    (project / "studies").mkdir()
    for value in ("studies", "not-yet/"):
        done = trainyard_cli("sweep", "run", "-S", f"sweep.storage={value}", cwd=project)
        assert "is a folder; name a journal file in it" in one_line(done)
    assert not (project / "not-yet").exists()


def test_each_sweep_has_its_own_journal_and_damage_to_one_leaves_the_others(project, store):
    paths, sweep = ProjectPaths(project), load_config(project / "params.yaml").sweep
    assert storage_url(sweep, paths, "a-1") != storage_url(sweep, paths, "b-1")
    damaged = Path(plant_sweep(store, project, "a-1").storage)
    plant_sweep(store, project, "b-1")
    # What appending after a torn tail did: a broken record followed by more records.
    last = damaged.read_bytes().splitlines(keepends=True)[-1]
    with damaged.open("ab") as journal:
        journal.write(TORN + last + last)

    listed = trainyard_cli("sweep", "list", "--json", cwd=project)
    assert listed.returncode == 0, listed.stderr
    assert [(r["sweep_id"], r["trials"]) for r in json.loads(listed.stdout)] == [("b-1", 2)]
    (warning,) = listed.stderr.strip().splitlines()
    assert warning.startswith("trainyard: warning: sweep a-1:") and "cannot be read" in warning
    assert trainyard_cli("sweep", "show", "b-1", cwd=project).returncode == 0
    assert "sweep a-1:" in one_line(trainyard_cli("sweep", "show", "a-1", cwd=project))


def test_a_torn_tail_is_read_never_appended_after_and_trimmed_on_resume(project, store):
    # A sweep whose time budget is spent: resuming it opens its study and runs no trial.
    config = load_config(project / "params.yaml", ["sweep.n_trials=null", "sweep.timeout_s=0.001"])
    journal = Path(plant_sweep(store, project, "torn-1", config).storage)
    whole = journal.read_bytes()
    with journal.open("ab") as handle:  # a write cut short by a kill or a full disk
        handle.write(TORN)
    torn = journal.read_bytes()

    # Readers skip the torn record; a writer refuses to append after it.
    listed = trainyard_cli("sweep", "list", "--json", cwd=project)
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["trials"] == 2, listed.stderr
    writer = SweepStudy(str(journal), "trainyard-torn-1", config.sweep, config.train.epochs)
    with pytest.raises(JournalError, match="ends in half a record"):
        writer.ask(config.sweep.space, "r-1", None)
    assert journal.read_bytes() == torn

    # The resume trims it and keeps the file as it was; Optuna's own CLI reads the journal.
    sweep("run", "--sweep-id", "torn-1", cwd=project)
    (copy,) = journal.parent.glob("journal.log.torn-*")
    assert copy.read_bytes() == torn and journal.read_bytes() == whole
    assert [t["value"] for t in optuna_trials(journal, "trainyard-torn-1")] == [0.5, 0.7]


def test_a_sweep_of_the_old_shared_journal_is_read_there_repaired_and_moved_out_on_resume(
    project, store
):
    from flows.sweep import own_journal

    paths = ProjectPaths(project)
    shared = str(paths.state / SHARED_JOURNAL)
    records = {sweep_id: plant_sweep(store, project, sweep_id, storage=shared, study=True)
               for sweep_id in ("old-1", "old-2")}  # fmt: skip
    listed = trainyard_cli("sweep", "list", "--json", cwd=project)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert {(r["sweep_id"], r["trials"]) for r in json.loads(listed.stdout)} == {
        ("old-1", 2),
        ("old-2", 2),
    }

    # What the old shared file became after a full disk: a record cut short, then more
    # records appended after it. Every sweep in it is unreadable, each one warning.
    whole = Path(shared).read_bytes()
    lines = whole.splitlines(keepends=True)
    Path(shared).write_bytes(b"".join(lines[:-2]) + TORN + b"".join(lines[-2:]))
    listed = trainyard_cli("sweep", "list", cwd=project)
    assert listed.returncode == 0 and len(listed.stderr.strip().splitlines()) == 2, listed.stderr

    # The resume repairs it (the damaged file kept) and moves its sweep to its own journal.
    moved = own_journal(store, load_sweep(store, "old-1"), paths)
    assert Path(shared).read_bytes() == whole
    (copy,) = Path(shared).parent.glob("optuna-journal.log.torn-*")
    assert copy.read_bytes().count(TORN) == 1
    assert records["old-1"].storage == shared != moved.storage
    assert moved.storage == str(journal_path(paths, "old-1"))
    assert load_sweep(store, "old-1").storage == moved.storage
    for sweep_id, journal in (("old-1", moved.storage), ("old-2", shared)):
        trials = optuna_trials(Path(journal), f"trainyard-{sweep_id}")
        assert [(t["number"], t["value"]) for t in trials] == [(0, 0.5), (1, 0.7)]
    assert own_journal(store, moved, paths) == moved  # once


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A port that would see any connection a reader made to a planted storage URL."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(0.5)
        yield server


def test_readers_open_nothing_a_planted_record_names_and_create_nothing(
    project, store, tmp_path, listening
):
    port = listening.getsockname()[1]
    elsewhere = tmp_path / "elsewhere"
    planted = {
        "gone-1": str(journal_path(ProjectPaths(project), "gone-1")),
        "sqlite-1": f"sqlite:///{elsewhere}/x.db",
        "pg-1": f"postgresql://user:hunter2@127.0.0.1:{port}/db",
        "grpc-1": f"grpc://127.0.0.1:{port}",
        "outside-1": str(tmp_path / "outside.log"),
    }
    for sweep_id, storage in planted.items():
        plant_sweep(store, project, sweep_id, storage=storage)
    plant_sweep(store, project, "fine-1")
    (tmp_path / "outside.log").write_bytes(Path(journal_of(project, "fine-1")).read_bytes())

    listed = trainyard_cli("sweep", "list", "--json", cwd=project)
    assert listed.returncode == 0, listed.stderr
    assert [r["sweep_id"] for r in json.loads(listed.stdout)] == ["fine-1"]
    warnings = dict(line.split(": ", 3)[2:] for line in listed.stderr.strip().splitlines())
    assert set(warnings) == {f"sweep {sweep_id}" for sweep_id in planted}, listed.stderr
    assert warnings["sweep gone-1"] == f"journal {planted['gone-1']} is gone"
    for sweep_id in ("sqlite-1", "pg-1", "grpc-1", "outside-1"):
        assert "which this project does not configure" in warnings[f"sweep {sweep_id}"]
    assert "hunter2" not in listed.stderr
    assert "is gone" in one_line(trainyard_cli("sweep", "show", "gone-1", cwd=project))
    report = trainyard_cli("report", "-o", str(tmp_path / "page.html"), cwd=project)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "page.html").read_text()
    # The outside journal holds fine-1's trials: the page shows why it was not opened.
    assert page.count("which this project does not configure") == 4, page[-3000:]

    assert not Path(planted["gone-1"]).parent.exists() and not elsewhere.exists()
    with pytest.raises(TimeoutError):
        listening.accept()  # nobody connected


@contextlib.contextmanager
def small_disk(folder: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted at `folder` (the project's journal folder), unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 65536)
    return filler


def epochs_reported(project: Path, proc: subprocess.Popen, sweep_id: str) -> int:
    """How many epochs trial 0 reported to the study (the sweep still running)."""
    assert proc.poll() is None, (project / "sweep.log").read_text()[-3000:]
    journal = journal_of(project, sweep_id)
    if not journal.exists() or not journal.stat().st_size:
        return 0
    study = optuna.load_study(
        study_name=f"trainyard-{sweep_id}", storage=journal_storage(str(journal))
    )
    trials = study.get_trials(deepcopy=False)
    return len(trials[0].intermediate_values) if trials else 0


def test_a_torn_tail_with_no_room_for_its_copy_is_left_untouched_and_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_disk(tmp_path / "disk") as disk:
        journal = disk / "journal.log"
        create_study(str(journal), "trainyard-x", "maximize", {})
        with journal.open("ab") as handle:
            handle.write(TORN)
        torn = journal.read_bytes()
        filler = fill(disk)
        with pytest.raises(JournalError, match="a copy of it cannot be kept"):
            repair_journal(journal)
        assert journal.read_bytes() == torn and sorted(disk.iterdir()) == [filler, journal]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_disk_stops_the_sweep_in_one_line_and_the_resume_finishes_it(
    project, store, monkeypatch
):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    with small_disk(project / ".trainyard/sweeps") as disk:
        plant_sweep(store, project, "other-1")  # another sweep, in the same folder
        settings = [
            *SMALL,
            "-S", "sweep.n_trials=2",
            "-S", "sweep.max_concurrent_trials=1",
            "-S", "sweep.pruner=none",
            # 60 short epochs, each reported to the study by the trial's worker: what it
            # writes after the disk fills (over 5 KB) cannot fit in the page the journal
            # already holds, so the write that meets the full disk is the worker's.
            "-S", "train.epochs=60",
            "-S", "train.batch_size=256",
            "-S", "checkpoint.every_n_epochs=20",
            "-S", "tracking.backend=none",
            "-S", "train.max_restarts=0",  # restarts would meet the same full disk
            "-S", "model.name=tests_support:slow_mlp",
            "-S", "model.options={seconds: 0.02}",
            "-S", 'sweep.space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1}}',
        ]  # fmt: skip
        log = project / "sweep.log"
        with background_sweep(project, settings) as proc:
            wait_for(lambda: log.read_text().startswith("sweep ") or proc.poll() is not None, 120)
            sweep_id = sweep_id_of(log.read_text())
            wait_for(lambda: epochs_reported(project, proc, sweep_id) >= 1, 300, "an epoch")
            assert epochs_reported(project, proc, sweep_id) < 10
            filler = fill(disk)
            assert proc.wait(timeout=300) == 2, log.read_text()[-3000:]
        # One line says why and how to go on (Prefect's own log lines are around it).
        (error,) = [line for line in log.read_text().splitlines() if "trainyard: error" in line]
        assert error.startswith(f"trainyard: error: sweep {sweep_id} stopped by where it runs")
        assert f"continue with: trainyard sweep run --sweep-id {sweep_id}" in error
        assert "trial 0: rank 0: JournalError" in error and "No space left on device" in error
        journal = journal_of(project, sweep_id)
        assert journal.read_bytes().endswith(b"\n")  # nothing half-written kept
        # The other sweep reads as before, the disk still full.
        other = trainyard_cli("sweep", "show", "other-1", "--json", cwd=project)
        assert other.returncode == 0 and len(json.loads(other.stdout)["trials"]) == 2

        (before,) = optuna_trials(journal, f"trainyard-{sweep_id}")
        assert before["state"] == "RUNNING"  # left for the resume, not counted as failed

        filler.unlink()
        sweep("run", "--sweep-id", sweep_id, cwd=project)
        trials = optuna_trials(journal, f"trainyard-{sweep_id}")
        assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], trials
        assert trials[0]["params"] == before["params"]  # run again with the same parameters
