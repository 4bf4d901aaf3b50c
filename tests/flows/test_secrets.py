"""Secrets never leave the environment: run the real pipeline with sentinel secrets, then
search everything it wrote (logs, Prefect's API, the store, .trainyard/, Comet archives)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from trainyard.config import load_config
from trainyard.runs.plan import settings_handed_over
from trainyard.runs.preflight import preflight
from trainyard.storage import Store, StoreSettings

from conftest import make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SENTINELS = {
    "COMET_API_KEY": "sentinel-comet-key-5f1e9c",
    "BILLING_SERVICE_SECRET": "sentinel-service-secret-77ab",
    "PAYMENTS_API_KEY": "sentinel-api-key-c0ffee",
}
# Files whose purpose is to hold credentials, each readable by the owner only.
CREDENTIAL_STORES = {
    ".trainyard/s3/credentials.json",
    ".trainyard/s3/identities.json",
    ".dvc/config.local",
}


def test_no_secret_appears_in_anything_the_pipeline_writes(
    tmp_path, monkeypatch, capfd, s3_server, prefect_api
):
    from flows.pipeline import training_pipeline

    server, state = s3_server
    creds = server.credentials()
    settings = StoreSettings(
        "trainyard", "secrets", state.endpoint, creds.access_key, creds.secret_key
    )
    root = make_project(tmp_path / "project", settings)
    for name, value in {**settings.worker_env(), **SENTINELS}.items():
        monkeypatch.setenv(name, value)
    # A key is set but Comet cannot be reached: trainyard must fall back to offline archives.
    monkeypatch.setenv("COMET_URL_OVERRIDE", "http://127.0.0.1:9/clientlib/")
    monkeypatch.chdir(root)
    config = load_config(root / "params.yaml", ["train.epochs=2"])
    preflight(config, root)
    record = training_pipeline(overrides=["train.epochs=2"], run_id="secret-scan")
    assert record.status == "completed"
    assert {e.mode for e in record.tracking} == {"offline"}, (
        "unreachable Comet must fall back to offline"
    )

    secrets = [*SENTINELS.values(), creds.secret_key, creds.access_key]
    haystacks: dict[str, bytes] = {"console output": "".join(capfd.readouterr()).encode()}
    with get_client(sync_client=True) as client:  # everything Prefect's API holds, raw
        for what, sort in (
            ("logs", "TIMESTAMP_ASC"),
            ("artifacts", "CREATED_DESC"),
            ("flow_runs", "ID_DESC"),
            ("task_runs", "ID_DESC"),
        ):
            haystacks[f"prefect {what}"] = json.dumps(_read_all(client, what, sort)).encode()
    assert (
        b"secret-scan" in haystacks["prefect artifacts"] and len(haystacks["prefect logs"]) > 1000
    )
    haystacks["the store's own log"] = server.log_file.read_bytes()
    store = Store(settings)
    for key in store.fs.find("trainyard/secrets"):
        haystacks[f"s3://{key}"] = store.fs.cat_file(key)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and ".git/" not in p.as_posix()):
        relative = path.relative_to(root).as_posix()
        if relative in CREDENTIAL_STORES:
            assert path.stat().st_mode & 0o077 == 0, f"{relative} must be private"
            continue
        haystacks[relative] = path.read_bytes()
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                for member in archive.namelist():
                    haystacks[f"{relative}!{member}"] = archive.read(member)

    assert any(k.endswith(".zip") for k in haystacks), "the Comet archives must be searched too"
    assert any("run.json" in k for k in haystacks) and len(haystacks) > 20
    leaks = [(where, s) for where, data in haystacks.items() for s in secrets if s.encode() in data]
    assert not leaks, leaks


def _read_all(client, what: str, sort: str, page: int = 200) -> list:
    items: list = []
    while True:
        response = client._client.post(
            f"/{what}/filter", json={"limit": page, "offset": len(items), "sort": sort}
        )
        response.raise_for_status()
        batch = response.json()
        items += batch
        if len(batch) < page:
            return items


def test_a_failed_run_is_recorded_as_failed_with_the_failing_rank(
    tmp_path, monkeypatch, s3_server, prefect_api
):
    from flows.pipeline import training_pipeline
    from trainyard.errors import WorkerFailed
    from trainyard.runs.record import load_record

    server, state = s3_server
    creds = server.credentials()
    settings = StoreSettings(
        "trainyard", "failing", state.endpoint, creds.access_key, creds.secret_key
    )
    root = make_project(tmp_path / "project", settings)
    for name, value in settings.worker_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # workers import tests_support
    monkeypatch.chdir(root)
    config = load_config(
        root / "params.yaml",
        ["model.name=tests_support:exploding_model", "model.options={}", "train.epochs=1"],
    )
    preflight(config, root)
    # A factory named by dotted path is the project owner's choice, not a flow run's
    # override (trainyard.config.callers): handed over in this process instead.
    with pytest.raises(WorkerFailed) as info, settings_handed_over(config):
        training_pipeline(run_id="will-fail")
    assert "rank      : 1" in str(info.value) and "RuntimeError: rank 1 exploded" in str(info.value)
    record = load_record(Store(settings), "will-fail")
    assert record.status == "failed" and record.finished_at
    assert "rank 1 exploded" in record.error
