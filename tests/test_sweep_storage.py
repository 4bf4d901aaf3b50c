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

from trainyard.config import load_config
from trainyard.project import ProjectPaths
from trainyard.storage import Store
from trainyard.sweeps.journal import JournalError
from trainyard.sweeps.record import SweepRecord, save_sweep
from trainyard.sweeps.study import SweepStudy, create_study, journal_path, storage_url

from conftest import BIN, trainyard_cli
from training_jobs import wait_for

TORN = b'{"op_code":5,"worker_id":"w","trial_id":0,"st'  # half a record: no newline


def plant_sweep(store: Store, project: Path, sweep_id: str, storage: str | None = None) -> str:
    """A sweep record in the store; unless `storage` names one, a study with two completed
    trials in the sweep's own journal (written through the sweep's own storage code)."""
    if storage is None:
        storage = str(journal_path(ProjectPaths(project), sweep_id))
        create_study(storage, f"trainyard-{sweep_id}", "maximize", {})
        config = load_config(project / "params.yaml")
        study = SweepStudy(storage, f"trainyard-{sweep_id}", config.sweep, config.train.epochs)
        for value in (0.5, 0.7):
            study.complete(study.ask(config.sweep.space, None, None).number, value)
    save_sweep(
        store,
        SweepRecord(
            sweep_id=sweep_id,
            study_name=f"trainyard-{sweep_id}",
            storage=storage,
            direction="maximize",
            objective="val_accuracy",
            created_at="2026-11-20T10:00:00+00:00",
            dataset_path="data/raw/digits.csv",
            dataset_md5="md5",
            code={},
            params={},
        ),
    )
    return storage


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
    damaged = Path(plant_sweep(store, project, "a-1"))
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
    # A real sweep with no trial yet (its time budget is spent before the first one).
    done = sweep(
        "run", "-S", "sweep.n_trials=null", "-S", "sweep.timeout_s=0.001",
        "-S", "tracking.backend=none", cwd=project,
    )  # fmt: skip
    sweep_id = sweep_id_of(done.stdout)
    journal, name = journal_of(project, sweep_id), f"trainyard-{sweep_id}"
    study = optuna.load_study(study_name=name, storage=journal_storage(str(journal)))
    for value in (0.5, 0.6):
        study.add_trial(optuna.trial.create_trial(value=value))
    whole = journal.read_bytes()
    with journal.open("ab") as handle:  # a write cut short by a kill or a full disk
        handle.write(TORN)
    torn = journal.read_bytes()

    # Readers skip the torn record; a writer refuses to append after it.
    listed = trainyard_cli("sweep", "list", "--json", cwd=project)
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["trials"] == 2, listed.stderr
    config = load_config(project / "params.yaml")
    writer = SweepStudy(str(journal), name, config.sweep, config.train.epochs)
    with pytest.raises(JournalError, match="ends in half a record"):
        writer.ask(config.sweep.space, "r-1", None)
    assert journal.read_bytes() == torn

    # The resume trims it and keeps the file as it was; Optuna's own CLI reads the journal.
    sweep("run", "--sweep-id", sweep_id, cwd=project)
    (copy,) = journal.parent.glob("journal.log.torn-*")
    assert copy.read_bytes() == torn and journal.read_bytes() == whole
    assert [t["value"] for t in optuna_trials(journal, name)] == [0.5, 0.6]


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
        plant_sweep(store, project, sweep_id, storage)
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
