"""`trainyard tracking upload`: a run's real offline Comet archive is refused in one line
without a key, and kept when the server cannot be reached, to be sent on a later try."""

from __future__ import annotations

import os

import comet_ml

from conftest import trainyard_cli


def offline_archive(project, run_id: str):
    folder = project / ".trainyard/comet" / run_id
    folder.mkdir(parents=True)  # as the tracker makes it
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
