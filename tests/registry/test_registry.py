"""The model registry on the real store: versions are verified copies that outlive their run,
aliases move through an append-only history that two racing writers cannot corrupt, and the
`trainyard models` commands a user types."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import threading
import time

import pytest
import torch
from fake_runs import fake_run

from trainyard import registry
from trainyard.cli import main as cli
from trainyard.errors import CheckpointError, TrainyardError
from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import own_store_project, trainyard_cli


@pytest.fixture
def versions(store) -> Store:
    """Model "digits" with versions 1, 2, 3 (accuracy 0.90, 0.92, 0.95)."""
    for n, accuracy in enumerate((0.90, 0.92, 0.95), start=1):
        fake_run(store, f"run-{n}", accuracy)
        assert registry.register(store, f"run-{n}", "digits").version == n
    return store


def test_a_version_is_a_verified_copy_that_outlives_its_run(store):
    fake_run(store, "run-a", 0.9)
    info = registry.register(store, "run-a", "digits", by="tester")
    assert (info.version, info.run_id, info.step) == (1, "run-a", 10)
    assert info.dataset_md5 == "md5-digits"
    assert info.code["git_commit"] == "c0ffee" and info.monitor["value"] == 0.9
    assert info.data["classes"] == ["0", "1"] and info.model["name"] == "mlp"
    assert info.task["name"] == "classification" and info.registered_by == "tester"
    source = store.get_bytes("runs/run-a/checkpoints/step-00000010/state.pt")
    store.delete("runs/run-a", recursive=True)  # the run, its record and checkpoints: gone

    from trainyard.checkpoint.reader import load_checkpoint

    state, manifest = load_checkpoint(store, registry.version_uri(store, "digits", 1))
    assert manifest.files["state.pt"].sha256 == hashlib.sha256(source).hexdigest()
    assert torch.equal(state["model"]["w"], torch.full((3,), 0.9))
    assert registry.read_version(store, "digits", 1) == info
    assert registry.list_models(store) == ["digits"]


def test_a_tampered_checkpoint_is_not_registered_and_takes_no_version(store):
    fake_run(store, "run-a", 0.9)
    store.put_bytes("runs/run-a/checkpoints/step-00000010/state.pt", b"not the weights")
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        registry.register(store, "run-a", "digits")
    assert registry.version_numbers(store, "digits") == []  # claimed, never committed
    fake_run(store, "run-b", 0.9)
    assert registry.register(store, "run-b", "digits").version == 2  # 1 stays claimed


@pytest.mark.parametrize(
    ("make", "name", "message"),
    [
        (None, "digits", "no run 'nope'"),
        ("failed", "digits", "run nope is failed: only a completed run"),
        ("completed", "bad/name", "model name 'bad/name' is not valid"),
        ("completed", "..", "model name '..' is not valid"),
    ],
)
def test_register_refuses_what_it_cannot_copy(store, make, name, message):
    if make:
        fake_run(store, "nope", 0.9, status=make)
    with pytest.raises(TrainyardError, match=message):
        registry.register(store, "nope", name)


def test_registering_the_same_run_twice_is_refused(versions):
    with pytest.raises(TrainyardError, match="run run-2 is already version 2 of model 'digits'"):
        registry.register(versions, "run-2", "digits")


def test_two_registers_at_once_get_different_versions(store):
    for n in range(4):
        fake_run(store, f"race-{n}", 0.5)
    got = run_together(
        [lambda n=n: registry.register(Store(store.settings), f"race-{n}", "m").version
         for n in range(4)]
    )  # fmt: skip
    assert sorted(got) == [1, 2, 3, 4]
    assert registry.version_numbers(store, "m") == [1, 2, 3, 4]


def test_promote_and_rollback_walk_the_alias_back_with_evidence(versions):
    store = versions
    first = registry.promote(store, "digits", 1, by="flow-run:abc")
    assert (first.seq, first.from_version, first.to_version) == (1, None, 1)
    assert first.by == "flow-run:abc"
    second = registry.promote(store, "digits", 3)
    assert second.evidence.model_dump() == {
        "rule": "manual", "metric": "test_accuracy", "mode": "max",
        "from_value": 0.90, "to_value": 0.95, "detail": {},
    }  # fmt: skip
    registry.promote(store, "digits", 2, alias="challenger")
    assert registry.read_aliases(store, "digits") == {"champion": 3, "challenger": 2}

    back = registry.rollback(store, "digits")
    assert (back.action, back.from_version, back.to_version, back.reverts) == ("rollback", 3, 1, 2)
    assert (back.evidence.rule, back.evidence.from_value, back.evidence.to_value) == (
        "rollback", 0.95, 0.90,
    )  # fmt: skip
    assert registry.read_aliases(store, "digits") == {"champion": 1, "challenger": 2}
    with pytest.raises(TrainyardError, match="digits:champion points at version 1 and has no"):
        registry.rollback(store, "digits")
    with pytest.raises(TrainyardError, match="already points at version 2"):
        registry.promote(store, "digits", 2, alias="challenger")
    with pytest.raises(TrainyardError, match="has no version 7"):
        registry.promote(store, "digits", 7)
    entries = registry.read_history(store, "digits")
    assert [(e.seq, e.alias, e.action) for e in entries] == [
        (1, "champion", "promote"), (2, "champion", "promote"),
        (3, "challenger", "promote"), (4, "champion", "rollback"),
    ]  # fmt: skip


def test_history_answers_who_was_champion_at_a_time(versions):
    store = versions
    registry.promote(store, "digits", 1)
    time.sleep(0.05)
    middle = dt.datetime.now(dt.UTC).isoformat()
    time.sleep(0.05)
    registry.promote(store, "digits", 2)
    entries = registry.read_history(store, "digits")
    assert registry.alias_at(entries, "champion", middle).to_version == 1
    assert registry.alias_at(entries, "champion", registry.now()).to_version == 2
    assert registry.alias_at(entries, "champion", "2000-01-01T00:00:00") is None
    with pytest.raises(TrainyardError, match="not an ISO time"):
        registry.alias_at(entries, "champion", "yesterday")


def test_two_promotions_racing_leave_one_alias_and_two_history_entries(versions):
    settings = versions.settings
    run_together(
        [lambda v=v: registry.promote(Store(settings), "digits", v, by=f"w{v}") for v in (2, 3)]
    )
    entries = registry.read_history(versions, "digits")
    assert len(entries) == 2
    assert entries[0].from_version is None
    assert entries[1].from_version == entries[0].to_version  # the loser decided again
    assert {e.to_version for e in entries} == {2, 3}
    winner = entries[1].to_version
    assert registry.read_aliases(versions, "digits") == {"champion": winner}
    cached = versions.read_json("registry/digits/aliases.json")
    assert (cached["aliases"], cached["seq"]) == ({"champion": winner}, 2)


def test_a_writer_that_loses_the_race_re_reads_and_decides_again(versions):
    """The race made certain: a second writer appends while the first is deciding."""
    store = versions
    decided = []

    def plan(entries):
        decided.append(len(entries))
        if len(decided) == 1:  # between this writer's read and its write
            registry.promote(Store(store.settings), "digits", 1, by="other")
        current = registry.aliases_of(entries).get("champion")
        return {"action": "promote", "from_version": current, "to_version": 3,
                "evidence": registry.Evidence(rule="test")}  # fmt: skip

    change = registry.aliases._append(store, "digits", "champion", plan, "me")
    assert decided == [0, 1]
    assert (change.seq, change.from_version, change.to_version) == (2, 1, 3)
    assert registry.read_aliases(store, "digits") == {"champion": 3}


def test_a_stale_aliases_cache_is_not_believed(versions):
    store = versions
    registry.promote(store, "digits", 1)
    stale = store.read_json("registry/digits/aliases.json")
    registry.promote(store, "digits", 2)
    store.write_json("registry/digits/aliases.json", stale)  # a slow writer's old cache
    assert registry.read_aliases(store, "digits") == {"champion": 2}


def test_conditional_writes_create_only_once(store):
    assert store.create_json("x/one.json", {"a": 1})
    assert not store.create_json("x/one.json", {"a": 2})
    assert store.read_json("x/one.json") == {"a": 1}


def run_together(calls):
    """Start every call at the same moment, each in its own thread; their results, in order."""
    barrier = threading.Barrier(len(calls))
    results, errors = [None] * len(calls), []

    def go(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


# --- the command line ---------------------------------------------------------------------


def models(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["models", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_models_commands_register_promote_rollback_and_show(project, store, capsys):
    for n, accuracy in enumerate((0.90, 0.95), start=1):
        fake_run(store, f"run-{n}", accuracy)
        code, out, _ = models(capsys, "register", f"run-{n}")
        assert code == 0 and f"run run-{n} registered as trainyard version {n}" in out
    assert models(capsys, "promote", "trainyard", "1")[0] == 0
    code, out, _ = models(capsys, "promote", "trainyard", "2")
    assert code == 0 and "trainyard:champion v1 -> v2" in out and "0.9 -> 0.95" in out
    code, out, _ = models(capsys, "rollback")
    assert code == 0 and "trainyard:champion v2 -> v1 (rollback" in out

    shown = json.loads(models(capsys, "show", "--json")[1])
    assert set(shown) >= {"name", "versions", "aliases", "history"}
    assert shown["name"] == "trainyard" and shown["aliases"] == {"champion": 1}
    first = shown["versions"][0]
    assert set(first) >= {"version", "run_id", "dataset_md5", "metrics", "created_at"}
    assert (first["version"], first["run_id"], first["dataset_md5"]) == (1, "run-1", "md5-digits")
    assert [h["action"] for h in shown["history"]] == ["promote", "promote", "rollback"]
    assert all(h["by"].startswith("cli:") for h in shown["history"])

    listed = json.loads(models(capsys, "list", "--json")[1])
    assert listed == [{"name": "trainyard", "versions": [1, 2], "aliases": {"champion": 1}}]
    history = json.loads(models(capsys, "history", "--json")[1])
    assert [(h["from_version"], h["to_version"]) for h in history] == [(None, 1), (1, 2), (2, 1)]
    code, out, _ = models(capsys, "history", "--at", history[1]["at"])
    assert code == 0 and out.count("\n") == 1 and "v1 -> v2" in out
    assert "trainyard" in models(capsys, "list")[1] and "champion" in models(capsys, "show")[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["register", "no-such-run"], "no run 'no-such-run'"),
        (["register", "run-1", "--name", "a/b"], "model name 'a/b' is not valid"),
        (["promote", "trainyard", "9"], "model 'trainyard' has no version 9"),
        (["promote", "trainyard", "1", "--alias", "../x"], "alias '../x' is not valid"),
        (["rollback"], "trainyard:champion points at no version and has no earlier"),
        (["show", "ghost"], "no model 'ghost'"),
        (["history", "--at", "noon"], "'noon' is not an ISO time"),
    ],
)
def test_models_mistakes_exit_2_with_one_line(project, store, capsys, args, message):
    fake_run(store, "run-1", 0.9)
    code, out, err = models(capsys, *args)
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, s3_server):
    """One real run, trained by `trainyard run` (1 worker, 1 epoch), shared by the tests below."""
    with own_store_project(tmp_path_factory, s3_server, "registry-run") as (root, settings):
        env = dict(os.environ)
        done = trainyard_cli(
            "run", "--run-id", "real-run", "-S", "train.workers=1", "-S", "train.epochs=1",
            "-S", "tracking.backend=none", cwd=root, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        yield {"root": root, "env": env, "store": Store(settings)}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_real_run_registers_loads_and_survives_its_deletion(trained):
    root, env, store = trained["root"], trained["env"], trained["store"]
    record = load_record(store, "real-run")
    started = time.monotonic()
    done = trainyard_cli("models", "register", "real-run", "--name", "digits", cwd=root, env=env)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert "registered as digits version 1" in done.stdout, done.stdout
    print(f"register (CLI, whole process): {took:.1f}s")

    info = registry.read_version(store, "digits", 1)
    assert info.run_id == "real-run" and info.monitor == record.monitor
    assert info.dataset_md5 == record.dataset.dvc_md5 and info.metrics == record.metrics
    assert info.code["git_commit"] == record.code["git_commit"]
    assert info.data["classes"] and info.model["name"] == record.params["model"]["name"]
    source = store.key_of(record.final_checkpoint)
    for name, entry in info.files.items():
        assert hashlib.sha256(store.get_bytes(f"{source}/{name}")).hexdigest() == entry.sha256

    deleted = trainyard_cli("runs", "delete", "real-run", cwd=root, env=env)
    assert deleted.returncode == 0, deleted.stderr[-3000:]
    assert not store.exists(f"{source}/manifest.json")

    # The version alone reproduces the run's test accuracy: weights and data description.
    from trainyard.checkpoint.loading import load_model
    from trainyard.data.tensors import load_split
    from trainyard.dist import DistContext
    from trainyard.engine.training import evaluate_split
    from trainyard.project import ProjectPaths

    loaded = load_model(store, registry.version_uri(store, "digits", 1), root / "scratch")
    folder = ProjectPaths(root).split_cache(record.dataset.split_key)
    single = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"
    )
    result = evaluate_split(loaded.model, load_split(folder, "test", loaded.schema), single)
    assert result["accuracy"] == pytest.approx(record.metrics["test_accuracy"], abs=1e-12)
    shown = trainyard_cli("models", "show", "digits", "--json", cwd=root, env=env)
    assert json.loads(shown.stdout)["versions"][0]["run_id"] == "real-run"
