"""One bad document is one warning: damaged run records and registry documents in the real
store are skipped, named, by `runs list/show`, `report`, `models list/show/history` and the
UI's data endpoint, which keep working; a record from a newer trainyard is read."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from fake_runs import fake_run

from trainyard import registry
from trainyard.cli import main as cli
from trainyard.report.data import RecordCache, build_report_data
from trainyard.report.server import make_server
from trainyard.runs.record import RunRecord, now, record_key, save_record

from conftest import trainyard_cli

# Six ways a run.json can be damaged: cut short, emptied, not JSON at all, JSON that is not
# an object, an object that is not a record, and a record with a field of the wrong type.
DAMAGED = {
    "cut-short": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "not-json": lambda good: b"\x00\xff\x1b[2Jgarbage",
    "a-list": lambda good: b"[1, 2, 3]",
    "no-fields": lambda good: b'{"run_id": "no-fields"}',
    "wrong-type": lambda good: good.replace(b'"created_at": "', b'"created_at": 1, "x": "'),
}


def plain_record(run_id: str, **extra) -> RunRecord:
    fields = {"status": "completed", "created_at": now(), "params": {"task": {"name": "x"}}}
    return RunRecord(run_id=run_id, **(fields | extra))


@pytest.fixture
def damaged_runs(store) -> dict[str, str]:
    """Two good runs (one written by a newer trainyard, with a field this one lacks) and
    one damaged record per DAMAGED variant, each written first by the product's own writer.
    Returns variant -> the damaged record's URI."""
    save_record(store, plain_record("good-1", metrics={"test_accuracy": 0.9}))
    newer = plain_record("good-newer").model_dump(mode="json")
    newer["added_by_a_newer_version"] = {"anything": [1, 2]}
    store.write_json(record_key("good-newer"), newer)
    uris = {}
    for variant, damage in DAMAGED.items():
        save_record(store, plain_record(variant))
        good = store.get_bytes(record_key(variant))
        store.put_bytes(record_key(variant), damage(good))
        uris[variant] = store.uri(record_key(variant))
    return uris


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_warning_each(err: str, uris: dict[str, str]) -> None:
    warnings = [line for line in err.splitlines() if line.startswith("trainyard: warning: ")]
    assert len(warnings) == len(uris), err
    for uri in uris.values():
        assert sum(uri in line for line in warnings) == 1, (uri, err)
    assert "\x1b" not in err and "Traceback" not in err


def test_runs_list_and_show_skip_each_damaged_record_with_one_warning(
    project, store, damaged_runs, capsys
):
    code, out, err = run_cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    assert {r["run_id"] for r in json.loads(out)} == {"good-1", "good-newer"}
    assert_one_warning_each(err, damaged_runs)

    code, out, err = run_cli(capsys, "runs", "list")
    assert code == 0 and "good-newer" in out and "good-1" in out, err
    assert_one_warning_each(err, damaged_runs)

    code, out, err = run_cli(capsys, "runs", "show", "good-newer")
    assert code == 0 and "good-newer" in out, err
    for variant, uri in damaged_runs.items():
        code, out, err = run_cli(capsys, "runs", "show", variant)
        assert code == 2 and out == "", err
        assert len(err.strip().splitlines()) == 1 and uri in err and "cannot be read" in err
        assert f"`trainyard runs delete {variant}` removes the run" in err


def test_report_and_the_ui_data_skip_each_damaged_record_and_count_them(
    project, store, damaged_runs, capsys, tmp_path
):
    code, out, err = run_cli(capsys, "report", "-o", str(tmp_path / "r.html"))
    assert code == 0 and "wrote" in out and "2 runs" in out, err
    assert_one_warning_each(err, damaged_runs)
    assert "unreadable document" in (tmp_path / "r.html").read_text()

    cache = RecordCache(store)
    server = make_server("127.0.0.1", 0, lambda: build_report_data(store, cache=cache))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/data.json"
        for _ in range(2):  # the second request goes through the cache of the first
            with urllib.request.urlopen(url, timeout=60) as reply:
                data = json.loads(reply.read())
            assert {r["run_id"] for r in data["runs"]} == {"good-1", "good-newer"}
            assert sorted(d["uri"] for d in data["skipped"]) == sorted(damaged_runs.values())
    finally:
        server.shutdown()
        server.server_close()


def test_a_record_damaged_after_it_was_shown_leaves_the_ui(store):
    save_record(store, plain_record("run-a"))
    save_record(store, plain_record("run-b"))
    cache = RecordCache(store)
    assert len(build_report_data(store, cache=cache).runs) == 2
    store.put_bytes(record_key("run-b"), b'{"run_id": "run-b", "stat')
    data = build_report_data(store, cache=cache)
    assert [r.run_id for r in data.runs] == ["run-a"]
    assert [d.uri for d in data.skipped] == [store.uri(record_key("run-b"))]


@pytest.fixture
def damaged_registry(store) -> dict[str, str]:
    """Model "digits": three versions, champion promoted three times; then version 2's
    version.json, history entry 2 and aliases.json cut short, and a field from a newer
    trainyard added to version 3's version.json. Returns doc -> URI."""
    for n in (1, 2, 3):
        fake_run(store, f"run-{n}", 0.9 + n / 100)
        registry.register(store, f"run-{n}", "digits", by="tester")
        registry.promote(store, "digits", n, by="tester")
    root = "registry/digits"
    newer = store.read_json(f"{root}/versions/3/version.json") | {"added_later": 1}
    store.write_json(f"{root}/versions/3/version.json", newer)
    keys = {
        "version": f"{root}/versions/2/version.json",
        "history": f"{root}/history/00000002.json",
        "aliases": f"{root}/aliases.json",
    }
    for key in keys.values():
        good = store.get_bytes(key)
        store.put_bytes(key, good[: len(good) // 2])
    return {doc: store.uri(key) for doc, key in keys.items()}


def test_models_commands_and_the_ui_skip_damaged_registry_documents(
    project, store, damaged_registry, capsys
):
    expected = {k: v for k, v in damaged_registry.items() if k != "version"}
    code, out, err = run_cli(capsys, "models", "list", "--json")
    assert code == 0, err
    assert json.loads(out) == [
        {"name": "digits", "versions": [1, 2, 3], "aliases": {"champion": 3}}
    ]
    assert_one_warning_each(err, expected)  # the list reads no version.json

    code, out, err = run_cli(capsys, "models", "show", "digits", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert [v["version"] for v in shown["versions"]] == [1, 3]  # v3 has an unknown field
    assert [h["seq"] for h in shown["history"]] == [1, 3]
    assert_one_warning_each(err, {k: damaged_registry[k] for k in ("version", "history")})

    code, out, err = run_cli(capsys, "models", "history", "digits")
    assert code == 0 and "#1 " in out and "#3 " in out and "#2 " not in out, err
    assert_one_warning_each(err, {"history": damaged_registry["history"]})

    data = build_report_data(store)
    assert {d.uri for d in data.skipped} == {damaged_registry[k] for k in ("version", "history")}
    (model,) = data.models
    assert [v.version for v in model.versions] == [1, 3] and model.aliases == {"champion": 3}


def test_a_writer_refuses_a_damaged_history_in_one_line(project, store, damaged_registry, capsys):
    """A promotion decided on a partial history could undo someone's change: it stops."""
    code, out, err = run_cli(capsys, "models", "promote", "digits", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert damaged_registry["history"] in err


def test_the_command_line_names_a_damaged_record_and_exits_0(project, store):
    save_record(store, plain_record("good-1"))
    store.put_bytes(record_key("cut"), b'{"run_id": "cut", "crea')
    done = trainyard_cli("runs", "list", cwd=project)
    assert done.returncode == 0 and "good-1" in done.stdout, done.stderr
    assert done.stderr.startswith(
        f"trainyard: warning: skipped {store.uri(record_key('cut'))}: not JSON: EOF while parsing"
    )
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_runs_list_json_is_a_summary_per_run_and_show_has_the_rest(project, store, capsys):
    history = [{"epoch": e, "train_loss": 1 / e, "val_loss": 1 / e} for e in range(1, 51)]
    record = plain_record(
        "summed",
        history=history,
        world_size=2,
        timings_s={"total": 12.5},
        monitor={"name": "accuracy", "mode": "max", "value": 0.93},
        error="first line\nsecond line",
    )
    save_record(store, record)
    code, out, err = run_cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    (summary,) = json.loads(out)
    assert summary["run_id"] == "summed" and summary["status"] == "completed"
    assert summary["monitor"] == {"name": "accuracy", "mode": "max", "value": 0.93}
    assert (summary["world_size"], summary["duration_s"], summary["task"]) == (2, 12.5, "x")
    assert summary["created_at"] == record.created_at and summary["error"] == "first line"
    assert not {"history", "params", "rank_lanes", "checkpoints"} & set(summary)
    code, out, err = run_cli(capsys, "runs", "show", "summed", "--json")
    assert code == 0 and len(json.loads(out)["history"]) == 50, err


def listed(capsys) -> dict[str, dict]:
    code, out, err = run_cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    return {summary["run_id"]: summary for summary in json.loads(out)}


def test_runs_list_reads_a_finished_record_again_only_once_it_changes(project, store, capsys):
    """Finished runs' summaries are kept beside their records' ETags in the project's private
    state: a record rewritten since shows as it is now, a running one is always read, and
    summaries kept for another store are never shown."""
    score = {"name": "accuracy", "mode": "max", "value": 0.5}
    save_record(store, plain_record("done-1", monitor=score))
    save_record(store, plain_record("live-1", status="running"))
    assert listed(capsys)["done-1"]["monitor"]["value"] == 0.5
    cache = project / ".trainyard/cache/run-summaries.json"
    assert cache.stat().st_mode & 0o077 == 0
    kept = json.loads(cache.read_text())
    assert set(kept["runs"]) == {"done-1"}  # a running run's status is its heartbeat's

    kept["runs"]["done-1"][1]["model"] = "as-kept"  # what a listing shows unless re-read
    cache.write_text(json.dumps(kept))
    assert listed(capsys)["done-1"]["model"] == "as-kept"
    save_record(store, plain_record("done-1", monitor=score | {"value": 0.75}))
    shown = listed(capsys)["done-1"]
    assert shown["monitor"]["value"] == 0.75 and shown["model"] is None

    elsewhere = json.loads(cache.read_text())
    elsewhere["where"] = "s3://another-bucket/runs"
    elsewhere["runs"]["ghost-1"] = elsewhere["runs"]["done-1"]
    cache.write_text(json.dumps(elsewhere))
    assert set(listed(capsys)) == {"done-1", "live-1"}
    cache.write_text("{")  # damaged: read as empty, and written anew
    assert set(listed(capsys)) == {"done-1", "live-1"}
    assert set(json.loads(cache.read_text())["runs"]) == {"done-1"}


def test_text_from_documents_never_drives_the_terminal(project, store, capsys):
    """A planted record's and sweep's escape sequences are printed as text (\\x1b...)."""
    import optuna

    from trainyard.project import ProjectPaths
    from trainyard.sweeps.record import SweepRecord, save_sweep, sweep_key
    from trainyard.sweeps.study import JOURNALS

    evil = "\x1b]0;owned\x07\x1b[2J\r\u202e"
    save_record(store, plain_record("loud", created_at=f"2026-11-26 {evil}"))
    journal = ProjectPaths(project).state.resolve() / JOURNALS / "sw1" / "journal.log"
    journal.parent.mkdir(parents=True)
    backend = optuna.storages.journal.JournalFileBackend(str(journal))
    study = optuna.create_study(
        study_name="s", storage=optuna.storages.JournalStorage(backend), direction="maximize"
    )
    study.enqueue_trial({})
    study.optimize(lambda trial: 0.5, n_trials=1)
    fields = {"storage": str(journal), "direction": "maximize", "dataset_path": "d"}
    save_sweep(
        store,
        SweepRecord(
            sweep_id="sw1", study_name="s", objective=f"acc{evil}", created_at=evil,
            dataset_md5="m", code={}, params={}, **fields,
        ),
    )  # fmt: skip
    store.put_bytes(sweep_key("sw2"), b'{"sweep_id": "sw2", "stu')
    for args in (("runs", "list"), ("runs", "show", "loud"), ("sweep", "list")):
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        assert not any(c in out + err for c in "\x1b\x07\r\u202e"), (args, out + err)
        assert "\\x1b]0;owned\\x07\\x1b[2J\\r\\u202e" in out, (args, out)
    assert err.count("trainyard: warning: ") == 1 and store.uri(sweep_key("sw2")) in err
