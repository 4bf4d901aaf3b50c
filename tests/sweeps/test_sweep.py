"""Hyperparameter sweeps, end to end: real trials (torchrun jobs through train_and_evaluate),
a real Optuna journal, the real store, and the CLI a user types."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator

import optuna
import pytest
import torch

from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.cli import main as cli
from trainyard.config import config_from_dict, load_config
from trainyard.engine.jobs import training_key
from trainyard.errors import ConfigError
from trainyard.runs.plan import settings_handed_over
from trainyard.runs.record import load_record
from trainyard.runtime.torchrun import worker_env
from trainyard.sweeps.checks import slot_gpus, trial_slots
from trainyard.util.daemons import free_port

from conftest import BIN, prefect_artifacts, trainyard_cli
from training_jobs import wait_for, worker_pids

TESTS = os.path.dirname(os.path.dirname(__file__))
# Learning rates far apart, so the pruner has slow trials to stop.
GRID = (
    'sweep.space={"train.lr": {"type": "categorical", "choices": [0.0003, 0.003, 0.05]}, '
    '"train.batch_size": {"type": "categorical", "choices": [16, 64]}}'
)
SMALL = ["-S", "train.workers=1", "-S", "train.threads_per_worker=1"]


def sweep(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    done = trainyard_cli("sweep", *args, cwd=cwd)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def show(sweep_id: str, cwd) -> dict:
    return json.loads(sweep("show", sweep_id, "--json", cwd=cwd).stdout)


def sweep_id_of(output: str) -> str:
    return output.splitlines()[0].removeprefix("sweep ").strip()


def journal_storage(path: str) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


def journal_of(project, sweep_id: str):
    """A sweep's own journal file (one per sweep, in the project's journal folder)."""
    return project / ".trainyard/sweeps" / sweep_id / "journal.log"


def local_study(project, sweep_id: str) -> optuna.Study:
    journal = str(journal_of(project, sweep_id))
    return optuna.load_study(study_name=f"trainyard-{sweep_id}", storage=journal_storage(journal))


def trials_with_checkpoints(project, store, proc: subprocess.Popen, sweep_id: str) -> int:
    """How many of the sweep's trials have committed a checkpoint (the sweep still running)."""
    assert proc.poll() is None, (project / "sweep.log").read_text()[-3000:]
    if not journal_of(project, sweep_id).exists():
        return 0
    try:
        study = local_study(project, sweep_id)
    except KeyError:  # the journal file is opened before the study's record is written
        return 0
    run_ids = [t.user_attrs.get("run_id") for t in study.trials]
    return sum(bool(r and committed_checkpoints(store, r)) for r in run_ids)


@contextlib.contextmanager
def background_sweep(project, args: list[str]) -> Iterator[subprocess.Popen]:
    """`trainyard sweep run ARGS` in the background, its output in sweep.log; killed on the
    way out if still running."""
    with open(project / "sweep.log", "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "trainyard"), "sweep", "run", *args],
            cwd=project, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
        )  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def two_trials_training(
    project, store, n_trials: int, epochs: int
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A new sweep (2 trials at a time, no pruning), handed over once two of its trials
    have committed a checkpoint."""
    settings = [
        *SMALL,
        "-S", f"sweep.n_trials={n_trials}",
        "-S", "sweep.max_concurrent_trials=2",
        "-S", "sweep.pruner=none",
        "-S", f"train.epochs={epochs}",
        "-S", "tracking.backend=none",
        # Steps of at least 20 ms: an epoch takes a second or more on any machine, so no
        # trial can finish between a checkpoint seen and the signal that follows it.
        "-S", "model.name=tests_support:slow_mlp",
        "-S", "model.options={seconds: 0.02}",
        "-S", 'sweep.space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": true}}',
    ]  # fmt: skip
    log_path = project / "sweep.log"
    with background_sweep(project, settings) as proc:
        wait_for(
            lambda: log_path.read_text().startswith("sweep ") or proc.poll() is not None,
            120,
            "the sweep's id",
        )
        assert proc.poll() is None, log_path.read_text()[-3000:]
        sweep_id = sweep_id_of(log_path.read_text())
        wait_for(
            lambda: trials_with_checkpoints(project, store, proc, sweep_id) == 2,
            300,
            "two trials with committed checkpoints",
        )
        yield proc, sweep_id


def max_running_at_once(trials: list[optuna.trial.FrozenTrial]) -> int:
    """The most trials whose [start, complete] intervals overlap (Optuna's clock, in
    microseconds: a trial on persistent workers can take well under a second)."""
    events = []
    for t in trials:
        events += [(t.datetime_start, 1), (t.datetime_complete, -1)]
    running = most = 0
    for _, change in sorted(events):  # at a tie, a finish (-1) sorts before a start
        running += change
        most = max(most, running)
    return most


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sweep_packs_prunes_and_finds_the_best_run(project, store):
    done = sweep(
        "run",
        *SMALL,
        "-S", GRID,
        "-S", "sweep.sampler=grid",
        "-S", "sweep.n_trials=6",
        "-S", "sweep.max_concurrent_trials=2",
        "-S", "sweep.min_epochs=1",
        "-S", "train.epochs=4",
        cwd=project,
    )  # fmt: skip
    sweep_id = sweep_id_of(done.stdout)
    shown = show(sweep_id, project)
    trials = shown["trials"]
    assert len(trials) == 6 and {t["state"] for t in trials} <= {"COMPLETE", "PRUNED"}
    pruned = [t for t in trials if t["state"] == "PRUNED"]
    assert pruned, trials
    records = {t["number"]: load_record(store, t["run_id"]) for t in trials}
    for t in trials:
        record = records[t["number"]]
        assert record.sweep.sweep_id == sweep_id and record.sweep.trial == t["number"]
        assert record.params["train"]["lr"] == t["params"]["train.lr"]
        if t["state"] == "PRUNED":  # stopped at the epoch it was pruned, its checkpoint kept
            assert record.status == "pruned" and record.pruned_at_epoch == t["last_epoch"] < 4
            assert len(record.history) == t["last_epoch"] and record.final_checkpoint
            # that epoch was checkpointed, so the job scored its final weights itself
            job = store.read_json(training_key(t["run_id"]))
            assert job["evaluation"]["checkpoint"] == record.final_checkpoint
        else:
            assert record.status == "completed" and len(record.history) == 4
            assert record.metrics["val_accuracy"] == pytest.approx(t["value"])
    completed = [records[t["number"]] for t in trials if t["state"] == "COMPLETE"]
    best = max(completed, key=lambda r: r.metrics["val_accuracy"])
    assert shown["best"]["run_id"] == best.run_id
    assert shown["best"]["value"] == pytest.approx(best.metrics["val_accuracy"])
    assert max_running_at_once(local_study(project, sweep_id).trials) == 2
    # Each trial slot's workers stay up from trial to trial (trainyard.runtime.persistent): six trials ran
    # in two groups of worker processes.
    pids = {tuple(store.read_json(training_key(t["run_id"]))["worker_pids"]) for t in trials}
    assert len(pids) == 2, pids

    # Optuna's own CLI reads the study where the sweep says it is, and agrees.
    optuna_cli = subprocess.run(
        [str(BIN / "optuna"), "best-trial", "--study-name", shown["study_name"],
         "--storage", shown["storage"], "-f", "json"],
        capture_output=True, text=True, cwd=project,
    )  # fmt: skip
    assert optuna_cli.returncode == 0, optuna_cli.stderr
    assert json.loads(optuna_cli.stdout)["value"] == pytest.approx(shown["best"]["value"])
    assert sweep_id in sweep("list", cwd=project).stdout
    assert best.run_id in sweep("best", sweep_id, cwd=project).stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_trial_is_recorded_and_the_sweep_goes_on(
    project, store, monkeypatch, prefect_api
):

    from flows.sweep import hyperparameter_sweep

    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:explodes_if
    overrides = [
        "train.workers=1",
        "model.name=tests_support:explodes_if",
        "model.options={}",
        'sweep.space={"model.options.explode": {"type": "categorical", "choices": [false, true]}}',
        "sweep.sampler=grid",
        "sweep.n_trials=2",
        "sweep.pruner=none",
        "train.epochs=2",
        "train.max_restarts=0",
        "tracking.backend=none",
    ]
    # A factory named by dotted path is the project owner's choice, not a flow run's
    # override (trainyard.config.callers): the settings are handed over in this process.
    with settings_handed_over(load_config(project / "params.yaml", overrides)):
        shown = hyperparameter_sweep()
    trials = {t["params"]["model.options.explode"]: t for t in shown["trials"]}
    assert trials[False]["state"] == "COMPLETE"
    failed = trials[True]
    assert failed["state"] == "FAIL"
    assert failed["error"] == "rank 0: RuntimeError: this trial exploded on purpose"
    assert load_record(store, failed["run_id"]).status == "failed"

    # The trials table, a Prefect artifact with a new version as each trial finished.
    versions = prefect_artifacts(f"sweep-{shown['sweep_id']}")
    assert len(versions) == 2
    latest = versions[0]["data"]
    table = json.loads(latest) if isinstance(latest, str) else latest
    assert sorted(row["state"] for row in table) == ["COMPLETE", "FAIL"]
    (link,) = prefect_artifacts(f"sweep-report-{shown['sweep_id']}")
    assert link["data"].endswith(f"(http://127.0.0.1:8765/#sweep={shown['sweep_id']})")


@pytest.mark.slow
@pytest.mark.distributed
def _assert_shown_stopped(project, sweep_id: str, numbers: list[int]) -> None:
    """The study keeps interrupted trials RUNNING (for the resume); `sweep show` says that
    no sweep runs them and how to resume them."""
    rows = {t["number"]: t for t in show(sweep_id, project)["trials"]}
    assert [rows[n]["run_status"] for n in numbers] == ["interrupted"] * len(numbers)
    text = sweep("show", sweep_id, cwd=project).stdout
    assert "running" not in text.splitlines()[0] and "stopped 2" in text.splitlines()[0], text
    assert (
        f"stopped before finishing: trial {numbers[0]} (interrupted), {numbers[1]} (interrupted); "
        f"`trainyard sweep run --sweep-id {sweep_id}` resumes them from their checkpoints"
    ) in text


def test_an_interrupted_then_killed_sweep_resumes_its_trials_from_their_checkpoints(
    project, store, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    # Ctrl-C: the trials' threads never see the signal; their torchrun jobs are stopped.
    with two_trials_training(project, store, n_trials=3, epochs=12) as (proc, sweep_id):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    log = (project / "sweep.log").read_text()
    assert f"continue with: trainyard sweep run --sweep-id {sweep_id}" in log
    trials = local_study(project, sweep_id).trials
    interrupted = {t.number: t for t in trials if t.state.name == "RUNNING"}
    assert len(interrupted) == 2, [(t.state.name, t.user_attrs) for t in trials]
    run_ids = [t.user_attrs["run_id"] for t in interrupted.values()]
    saved = {}
    for run_id in run_ids:
        assert load_record(store, run_id).status == "interrupted"
        assert worker_pids(run_id) == {}
        saved[run_id] = committed_checkpoints(store, run_id)
    _assert_shown_stopped(project, sweep_id, sorted(interrupted))

    # Resumed, then killed with SIGKILL once both trials committed a checkpoint again.
    with background_sweep(project, ["--sweep-id", sweep_id]) as resumed:

        def both_trained_further() -> bool:
            assert resumed.poll() is None, (project / "sweep.log").read_text()[-3000:]
            return all(
                load_record(store, r).status == "running"
                and committed_checkpoints(store, r)[-1:] != saved[r][-1:]
                for r in run_ids
            )

        wait_for(both_trained_further, 300, "both trials to commit a checkpoint again")
        resumed.send_signal(signal.SIGKILL)
        resumed.wait(timeout=30)

    # A resumed sweep keeps what its trials train; only its budget and packing may change.
    changed = sweep("run", "--sweep-id", sweep_id, "-S", "train.lr=0.2", cwd=project, check=False)
    assert changed.returncode == 2 and "a resumed sweep keeps its settings" in changed.stderr
    sweep("run", "--sweep-id", sweep_id, "-S", "sweep.max_concurrent_trials=2", cwd=project)
    shown = show(sweep_id, project)
    states = [t["state"] for t in shown["trials"]]
    assert states == ["COMPLETE"] * 3, shown["trials"]  # exactly n_trials
    for number, before in interrupted.items():
        trial = shown["trials"][number]
        assert trial["params"] == before.params  # the same parameters, not re-sampled
        record = load_record(store, trial["run_id"])
        assert record.resume_checkpoint, "the trial started over instead of resuming"
        continued = [e["previous_status"] for e in record.resumes if e.get("kind") == "continue"]
        assert continued == ["interrupted", "crashed"]
        assert len(record.history) == 12

    # The sweep's data changed: resuming it is refused in one line, exit code 2.
    digits = project / "data/raw/digits.csv"
    digits.write_text(digits.read_text() + digits.read_text().splitlines()[1] + "\n")
    refused = sweep("run", "--sweep-id", sweep_id, cwd=project, check=False)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "restore that version" in refused.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["-S", "sweep.cores=2", "-S", "sweep.max_concurrent_trials=2", "-S", "train.workers=2"],
            "sweep.max_concurrent_trials=2 x train.workers=2 x train.threads_per_worker=1 "
            "needs 4 cores, and the sweep has 2",
        ),
        (
            ["-S", 'sweep.space={"model.options.widht": {"type": "int", "low": 8, "high": 64}}'],
            "sweep.space.model.options.widht: a trial could get 8: model.options = ",
        ),
        (["--sweep-id", "no-such-sweep"], "no sweep 'no-such-sweep'"),
        (["--sweep-id", "../x"], "run id '../x' is not valid"),
    ],
)
def test_a_sweep_that_cannot_run_is_refused_before_any_trial(project, capsys, args, expected):
    code = cli.main(["sweep", "run", *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert expected in err
    assert not (project / ".trainyard/sweeps").exists(), "no study may be created"


def test_trials_on_gpus_are_packed_onto_gpus_of_their_own():
    """The packing rule for GPUs, read from the settings (train.device=cuda, train.gpus), so it
    holds without one here: each trial slot gets train.workers GPUs that no other slot has
    (its workers see only those: CUDA_VISIBLE_DEVICES), and more slots than the GPUs hold
    are refused before any trial starts."""
    cuda = {"train": {"device": "cuda", "workers": 2, "gpus": [0, 1, 2, 3, 5]}}
    config = config_from_dict(cuda)
    assert trial_slots(config) == 2
    assert slot_gpus(config, 2) == [[0, 1], [2, 3]]
    one = config_from_dict({**cuda, "sweep": {"max_concurrent_trials": 1}})
    assert trial_slots(one) == 1 and slot_gpus(one, 1) == [[0, 1]]
    wider = config_from_dict({**cuda, "sweep": {"max_concurrent_trials": 3}})
    with pytest.raises(ConfigError, match="needs 6 GPUs .* and the sweep has 5"):
        trial_slots(wider)
    env = worker_env({}, threads=1, gpus=slot_gpus(config, 2)[1])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # On CPUs the same settings pack by cores instead, and no slot has GPUs.
    cpu = {"train": {"device": "cpu", "workers": 1}, "sweep": {"cores": 4}}
    assert trial_slots(config_from_dict(cpu)) == 4
    assert slot_gpus(config_from_dict(cpu), 4) == [None] * 4


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_trials_that_overlap_in_time_never_share_a_gpu(project, store):
    """The packing above on real GPUs: 2 trial slots of 1 GPU each, 4 trials."""
    done = sweep(
        "run", *SMALL, "-S", GRID, "-S", "sweep.sampler=grid", "-S", "sweep.n_trials=4",
        "-S", "sweep.max_concurrent_trials=2", "-S", "sweep.pruner=none",
        "-S", "train.epochs=3", "-S", "train.device=cuda",
        cwd=project,
    )  # fmt: skip
    sweep_id = sweep_id_of(done.stdout)
    trials = {t.number: t for t in local_study(project, sweep_id).trials}
    gpus = {
        t["number"]: load_record(store, t["run_id"]).params["train"]["gpus"]
        for t in show(sweep_id, project)["trials"]
    }
    assert sorted(map(tuple, gpus.values())) == [(0,), (0,), (1,), (1,)]
    assert max_running_at_once(list(trials.values())) == 2
    for a in trials.values():
        for b in trials.values():
            overlap = (
                a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete
            )
            if a.number != b.number and overlap:
                assert gpus[a.number] != gpus[b.number], (a.number, b.number, gpus)


def storage_server(project, port: int) -> subprocess.Popen:
    """`trainyard sweep serve-storage`: Optuna's gRPC proxy over the project's journal file,
    which trials on several machines share (a database server would do the same)."""
    server = subprocess.Popen(
        [str(BIN / "trainyard"), "sweep", "serve-storage", "--port", str(port)], cwd=project
    )
    wait_for(lambda: _accepts(port), 60, "the storage server")
    return server


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_trial_whose_run_finished_is_told_from_its_record_not_run_again(project, store):
    """Another sweep process (or a resume) may look between a run's lease going and its
    sweep process telling the study: the outcome comes from the record, once."""
    from flows.sweep import trials_to_resume
    from trainyard.project import ProjectPaths
    from trainyard.runs.lease import RunLease
    from trainyard.runs.record import RunRecord, now, save_record
    from trainyard.sweeps.study import SweepStudy, create_study

    config = load_config(project / "params.yaml")
    url = str(project / "journal.log")
    create_study(url, "trainyard-s", "maximize", {})
    study = SweepStudy(url, "trainyard-s", config.sweep, config.train.epochs)
    runs = {"completed": "r0", "pruned": "r1", "interrupted": "r2", "live": "r3", "new": "r4"}
    numbers = {
        kind: study.ask(config.sweep.space, run_id, None).number for kind, run_id in runs.items()
    }
    for kind in ("completed", "pruned", "interrupted", "live"):
        status = "completed" if kind == "live" else kind
        metrics = {"val_accuracy": 0.75} if status == "completed" else {}
        save_record(
            store,
            RunRecord(
                run_id=runs[kind], status=status, created_at=now(), params={}, metrics=metrics
            ),
        )
    with RunLease(store, runs["live"]):  # its owner is still at work
        for _ in range(2):  # a second look changes nothing
            pending = trials_to_resume(study, config, ProjectPaths(project), "val_accuracy")
            assert [t.number for t in pending] == [numbers["interrupted"]]
    study.failed(numbers["completed"], "told twice")  # a late teller changes nothing either
    trials = {t.number: t for t in local_trials(url, "trainyard-s")}
    assert trials[numbers["completed"]].state == optuna.trial.TrialState.COMPLETE
    assert trials[numbers["completed"]].value == 0.75
    assert trials[numbers["pruned"]].state == optuna.trial.TrialState.PRUNED
    for kind in ("interrupted", "live", "new"):  # resumed, owned, or just starting elsewhere
        assert trials[numbers[kind]].state == optuna.trial.TrialState.RUNNING


def test_a_reading_storage_never_creates_a_databases_tables(tmp_path):
    """The sweep bar reads the study the flow creates; it must not create (or migrate) an
    RDB's tables itself, as a plain RDBStorage does on opening."""
    import sqlite3

    from trainyard.sweeps.study import open_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    with contextlib.suppress(Exception):  # no tables yet: the reader may refuse, never create
        open_storage(url, create_tables=False)
    tables = sqlite3.connect(tmp_path / "study.db").execute("select name from sqlite_master")
    assert tables.fetchall() == []
    open_storage(url)  # the flow's storage creates them
    tables = sqlite3.connect(tmp_path / "study.db").execute("select name from sqlite_master")
    assert ("studies",) in tables.fetchall()


def local_trials(journal: str, study_name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study_name, storage=journal_storage(journal)).trials


@pytest.mark.slow
@pytest.mark.distributed
def test_two_sweep_processes_share_one_study_through_a_storage_server(project, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    port = free_port("127.0.0.1")
    server = storage_server(project, port)
    settings = [
        *SMALL,
        "-S", f"sweep.storage=grpc://127.0.0.1:{port}",
        "-S", "sweep.n_trials=5",
        "-S", "sweep.max_concurrent_trials=1",
        "-S", "sweep.pruner=none",
        "-S", "train.epochs=5",
        "-S", "tracking.backend=none",
        # Trials of at least 5 s (200 steps of 25 ms) whatever the machine's speed: the four
        # left when the second process joins outlast its start (about 10 s here), so it
        # takes some; a trial on persistent workers has almost no start of its own to add.
        "-S", "model.name=tests_support:slow_mlp",
        "-S", "model.options={seconds: 0.025}",
        "-S", 'sweep.space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": true}}',
    ]  # fmt: skip
    logs = [open(project / f"sweep{i}.log", "w") for i in range(2)]  # noqa: SIM115
    first = subprocess.Popen(
        [str(BIN / "trainyard"), "sweep", "run", *settings],
        cwd=project, stdout=logs[0], stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        log = project / "sweep0.log"
        wait_for(
            lambda: "trial 0 (run" in log.read_text() or first.poll() is not None, 300, "trial 0"
        )
        sweep_id = sweep_id_of(log.read_text())
        # The second process (another machine, in real life) joins the same sweep.
        second = subprocess.Popen(
            [str(BIN / "trainyard"), "sweep", "run", "--sweep-id", sweep_id,
             "-S", "sweep.max_concurrent_trials=1"],
            cwd=project, stdout=logs[1], stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert second.wait(timeout=600) == 0, (project / "sweep1.log").read_text()[-3000:]
        assert first.wait(timeout=600) == 0, log.read_text()[-3000:]
        # Through the server, as every process reads it: a storage this command is given.
        shown = json.loads(
            sweep("show", sweep_id, "--json", "-S", f"sweep.storage=grpc://127.0.0.1:{port}",
                  cwd=project).stdout
        )  # fmt: skip
    finally:
        for proc in (first, server):
            proc.kill()
        for handle in logs:
            handle.close()
    assert shown["storage"] == f"grpc://127.0.0.1:{port}"
    states = [t["state"] for t in shown["trials"]]
    # The budget is exact within a process; each extra process may start one more trial.
    assert 5 <= len(states) <= 6 and set(states) == {"COMPLETE"}, shown["trials"]
    ran = [
        {int(n) for n in re.findall(r"trial (\d+) \(run", (project / f"sweep{i}.log").read_text())}
        for i in range(2)
    ]
    assert ran[0] and ran[1] and not ran[0] & ran[1], ran  # both took trials, none twice


@pytest.mark.slow
@pytest.mark.distributed
def test_pruning_stops_every_rank_of_a_two_worker_trial_at_the_same_epoch(project, store):
    # A sweep with no trials yet: its time budget is spent before the first one starts.
    done = sweep(
        "run", "-S", "sweep.n_trials=null", "-S", "sweep.timeout_s=0.001", "-S", "sweep.pruner=median",
        "-S", "sweep.sampler=random", "-S", "train.workers=2", "-S", "train.epochs=4",
        "-S", "tracking.backend=none", cwd=project,
    )  # fmt: skip
    sweep_id = sweep_id_of(done.stdout)
    shown = show(sweep_id, project)
    assert shown["trials"] == []
    # Two trials no real one can match (an accuracy of 2 at every epoch): the next is pruned.
    study = optuna.load_study(
        study_name=shown["study_name"], storage=journal_storage(shown["storage"])
    )
    for _ in range(2):
        study.add_trial(
            optuna.trial.create_trial(value=2.0, intermediate_values={e: 2.0 for e in range(1, 5)})
        )
    sweep(
        "run", "--sweep-id", sweep_id, "-S", "sweep.n_trials=3", "-S", "sweep.timeout_s=null",
        cwd=project,
    )  # fmt: skip
    trial = show(sweep_id, project)["trials"][2]
    assert trial["state"] == "PRUNED" and trial["last_epoch"] == 1
    record = load_record(store, trial["run_id"])
    assert record.world_size == 2 and record.status == "pruned" and record.pruned_at_epoch == 1
    assert len(record.history) == 1  # both ranks stopped after epoch 1: none hung
    manifest = store.read_json(store.key_of(record.final_checkpoint) + "/manifest.json")
    assert manifest["epoch"] == 1  # the pruned epoch's checkpoint stays
