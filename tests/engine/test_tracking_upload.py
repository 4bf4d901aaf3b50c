"""Comet when its server is not there: `trainyard tracking upload` refuses a run's real
offline archive in one line without a key and keeps it when the server cannot be reached;
a server that goes away mid-run loses no point (they end up in an offline archive, which
the command sends once the server is back); a key with no server to reach goes offline at
once, in one line."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from fake_comet import QUICK_GIVE_UP, FakeCometServer

from trainyard.config import TrackingConfig, load_config
from trainyard.engine.tracking import start_tracker
from trainyard.util.comet import quiet_comet

from conftest import trainyard_cli
from tests_support import read_comet_archive
from training_jobs import wait_for


def offline_archive(project, run_id: str):
    folder = project / ".trainyard/comet" / run_id
    folder.mkdir(parents=True)  # as the tracker makes it
    quiet_comet()  # as trainyard's processes: nothing reported to Comet's Sentry from here
    import comet_ml

    settings = comet_ml.ExperimentConfig(
        offline_directory=str(folder), name=f"{run_id}-rank0", display_summary_level=0
    )
    experiment = comet_ml.start(online=False, project_name="trainyard", experiment_config=settings)
    experiment.log_metrics({"loss": 1.0}, step=1)
    experiment.end()
    (archive,) = folder.glob("*.zip")
    return archive


def test_upload_needs_a_key_and_keeps_what_it_could_not_send(project, monkeypatch):
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    archive = offline_archive(project, "r1")
    env = {k: v for k, v in os.environ.items() if k != "COMET_API_KEY"}

    keyless = trainyard_cli("tracking", "upload", "r1", cwd=project, env=env)
    assert keyless.returncode == 2 and keyless.stderr.count("\n") == 1, keyless.stderr
    assert "COMET_API_KEY is not set: set it to upload the 1 offline archive(s)" in keyless.stderr
    unknown = trainyard_cli("tracking", "upload", "r2", cwd=project, env=env)
    assert unknown.returncode == 2 and "no offline Comet archives of run r2" in unknown.stderr

    # A key, and a server that is not there (nothing listens on the discard port).
    away = {
        **env,
        "COMET_API_KEY": "k" * 20,
        "COMET_URL_OVERRIDE": "http://127.0.0.1:9/clientlib/",
        # Comet's own retries with back-off take ~19 s to give up; the outcome is the same.
        "COMET_HTTP_SESSION_RETRY_TOTAL": "0",
        "COMET_GET_OR_ADD_EXPERIMENT_RETRY_TOTAL": "0",
    }
    failed = trainyard_cli("tracking", "upload", cwd=project, env=away)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"not uploaded r1/{archive.name}: ConnectionError" in failed.stderr
    assert "0 of 1 archive(s) uploaded" in failed.stdout
    assert "k" * 20 not in failed.stdout + failed.stderr
    assert archive.is_file() and not (archive.parent / "uploaded").exists()


def test_a_server_gone_mid_run_loses_no_point_and_the_archive_uploads_when_back(
    project, monkeypatch
):
    server = FakeCometServer()
    key = "fake-key-" + "k" * 20
    env = {"COMET_API_KEY": key, "COMET_URL_OVERRIDE": server.url, **QUICK_GIVE_UP}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    folder = project / ".trainyard/comet/r1"  # where a run's rank keeps its archives
    try:
        tracker = start_tracker(load_config(project / "params.yaml").tracking, "r1", 0, folder)
        for step in range(10):
            tracker.log_metrics({"loss": 1 / (step + 1)}, step=step)
        wait_for(lambda: server.steps("loss") == list(range(10)), 60, "the first points online")
        server.go_away()  # connections are accepted and never answered
        for step in range(10, 20):
            tracker.log_metrics({"loss": 1 / (step + 1)}, step=step)
        ref = tracker.end()

        assert server.steps("loss") == list(range(10))  # nothing got through after
        assert ref.mode == "offline" and ref.archive is not None, ref
        assert Path(ref.archive).parent == folder
        _, _, metrics = read_comet_archive(ref.archive)
        assert metrics["loss"] == [1 / (step + 1) for step in range(20)]  # every point, in order

        server.come_back()
        server.metrics.clear()
        done = trainyard_cli("tracking", "upload", "r1", cwd=project, env=dict(os.environ))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"uploaded r1/{Path(ref.archive).name}" in done.stdout
        assert sorted(server.steps("loss")) == list(range(20))
        assert (folder / "uploaded" / Path(ref.archive).name).is_file()
        assert key not in done.stdout + done.stderr
    finally:
        server.close()


def test_a_key_and_no_server_to_reach_go_offline_at_once_in_one_line(tmp_path, caplog):
    """Nothing listens on port 9. Asked anyway, Comet retried with back-off for about 30 s,
    with some 15 warnings (urllib3's retries among them) before trainyard's own."""
    env = {"COMET_API_KEY": "k" * 20, "COMET_URL_OVERRIDE": "http://127.0.0.1:9/clientlib/"}
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        for name, value in env.items():
            mp.setenv(name, value)
        started = time.monotonic()
        tracker = start_tracker(TrackingConfig(), "r1", 0, tmp_path / "comet")
        tracker.log_metrics({"loss": 0.5}, step=1)
        ref = tracker.end()
        took = time.monotonic() - started
    assert ref.mode == "offline" and read_comet_archive(ref.archive)[2]["loss"] == [0.5]
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("Comet server unreachable; logging offline to ")
    assert took < 20, took  # Comet's own start and end: a few seconds
