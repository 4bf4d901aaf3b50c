"""Checkpoints this project did not sign are never loaded, on the real store: a rewrite of
state.pt and manifest.json with matching sha256 values (what write access to the bucket
allows) is refused, as are manifests signed with another key or replayed under another run;
the key lives only in the project's local state. A full staging disk fails a run at once."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import stat
import subprocess
import time
import warnings

import pytest
import torch

from trainyard.checkpoint.layout import MANIFEST_FILE, STATE_FILE, checkpoint_key
from trainyard.checkpoint.reader import latest_committed, load_checkpoint
from trainyard.checkpoint.signing import (
    SIGNING_KEY_ENV,
    check_same_key,
    key_id,
    project_key,
    signed,
)
from trainyard.checkpoint.writer import CheckpointWriter
from trainyard.cli import main as cli
from trainyard.config import CheckpointConfig
from trainyard.errors import CheckpointError
from trainyard.runs.record import RunRecord, now, save_record

from conftest import trainyard_cli
from tests_support import manifest_fields


def commit(store, run_id: str, staging, step: int = 10, value: float = 1.0) -> str:
    writer = CheckpointWriter(store, run_id, staging)
    uri = writer.save(step, {"model": {"w": torch.full((4,), value)}}, manifest_fields())
    writer.close()
    return uri


def plant(store, uri: str, key: bytes | None = None, at: str | None = None) -> None:
    """What someone who can write to the bucket does: new weights in state.pt and a manifest
    with their true size and sha256, unsigned or signed with `key` for the key `at`."""
    location = store.key_of(uri)
    manifest = store.read_json(f"{location}/{MANIFEST_FILE}")
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.full((4,), 666.0)}}, buffer)
    data = buffer.getvalue()
    manifest["files"][STATE_FILE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest.pop("signature")
    if key is not None:
        manifest = signed(key, at or location, manifest)
    store.put_bytes(f"{location}/{STATE_FILE}", data)
    store.write_json(f"{location}/{MANIFEST_FILE}", manifest)


def refusal(store, uri: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(store, uri)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_rewritten_checkpoint_with_matching_sha256_is_refused(store, tmp_path):
    uri = commit(store, "victim", tmp_path / "staging")
    state, manifest = load_checkpoint(store, uri)  # the project's own checkpoint loads
    assert torch.equal(state["model"]["w"], torch.ones(4))
    assert manifest.signature and manifest.signature.startswith("hmac-sha256:")

    plant(store, uri)
    message = refusal(store, uri)
    assert f"checkpoint {uri} is not signed, so it is not loaded" in message
    assert latest_committed(store, "victim") is None  # resume skips it, never loads it


def test_a_manifest_signed_with_another_key_or_for_another_place_is_refused(store, tmp_path):
    uri = commit(store, "victim", tmp_path / "staging")
    plant(store, uri, key=secrets.token_bytes(32))
    message = refusal(store, uri)
    assert f"checkpoint {uri} is not signed by this project's key" in message
    assert "written elsewhere or tampered with" in message

    # The project's own signature, replayed: a signed checkpoint copied under another run.
    source = commit(store, "source", tmp_path / "staging", value=2.0)
    copy = store.uri(checkpoint_key("victim", 20))
    for name in (STATE_FILE, MANIFEST_FILE):
        data = store.get_bytes(f"{store.key_of(source)}/{name}")
        store.put_bytes(f"{store.key_of(copy)}/{name}", data)
    assert "is not signed by this project's key" in refusal(store, copy)
    assert torch.equal(load_checkpoint(store, source)[0]["model"]["w"], torch.full((4,), 2.0))


def test_the_key_is_made_once_private_in_the_projects_state_and_never_stored(
    project, store, monkeypatch, caplog
):
    monkeypatch.delenv(SIGNING_KEY_ENV)
    caplog.set_level("DEBUG")
    path = project / ".trainyard" / "signing.key"
    assert not path.exists()
    uri = commit(store, "mine", project / ".trainyard" / "staging")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = project_key()
    assert len(key) == 32 and project_key(create=True) == key  # made once
    load_checkpoint(store, uri)

    stored = b"".join(store.get_bytes(k) for k in store.list_files(""))
    for form in (key.hex().encode(), key):
        assert form not in stored
    assert key.hex() not in caplog.text

    path.chmod(0o644)
    with pytest.raises(CheckpointError, match=r"can be read or changed by other users .*chmod 600"):
        load_checkpoint(store, uri)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"signing key .* is missing.*copy signing.key"):
        load_checkpoint(store, uri)


def test_register_and_predict_refuse_a_planted_checkpoint_with_exit_2(
    project, store, monkeypatch, capsys
):
    """The commands a user types, in the project, with the project's own key file."""
    monkeypatch.delenv(SIGNING_KEY_ENV)
    uri = commit(store, "planted", project / ".trainyard" / "staging")
    record = RunRecord(
        run_id="planted", status="completed", created_at=now(), params={}, final_checkpoint=uri
    )
    save_record(store, record)
    plant(store, uri)
    (project / "data").mkdir(exist_ok=True)
    (project / "data" / "in.csv").write_text("x\n1.0\n")
    for args in (
        ["models", "register", "planted", "--name", "digits"],
        ["predict", "--model", "run:planted", "--input", "data/in.csv"],
    ):
        code = cli.main(args)
        out, err = capsys.readouterr()
        assert code == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1, err
        assert f"checkpoint {uri} is not signed, so it is not loaded" in err, err
    assert store.list_files("registry") == {}
    assert store.list_files("predictions") == {}


@contextlib.contextmanager
def tmpfs(folder, size: str):
    """A tmpfs of `size` at `folder`: writes past it fail with ENOSPC, as on a full disk."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as folder:
        yield folder


def test_a_full_staging_disk_fails_the_run_at_once_saying_so(store, small_disk):
    timeout_s = 120.0
    config = CheckpointConfig(upload_timeout_s=timeout_s, upload_backoff_s=0.5)
    writer = CheckpointWriter(store, "full", small_disk, config)
    started = time.monotonic()
    writer.save(1, {"model": {"w": torch.zeros(1_000_000)}}, manifest_fields())  # 4 MB
    with pytest.raises(CheckpointError) as caught:
        writer.close()
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("disk full: checkpoint step 1 cannot be staged in "), message
    assert str(small_disk / "full") in message and "free space there" in message
    assert "upload" not in message and "wait for the store" not in message
    assert elapsed < timeout_s / 4, f"took {elapsed:.1f}s"
    assert not os.listdir(small_disk / "full")  # the partial file is gone, space freed
    assert not store.exists(f"{checkpoint_key('full', 1)}/{MANIFEST_FILE}")


def test_a_full_staging_disk_fails_a_sharded_save_saying_so(store, small_disk):
    from trainyard.checkpoint.sharded import ShardStager

    model = torch.nn.Linear(1000, 500)  # 2 MB of weights, as much again of momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 1000)).sum().backward()
    optimizer.step()
    stager = ShardStager(store, "full", small_disk, CheckpointConfig(), rank=0)
    with warnings.catch_warnings(), pytest.raises(CheckpointError) as caught:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        stager.stage(3, model, optimizer)
    message = str(caught.value)
    assert message == (
        f"disk full: checkpoint step 3 cannot be staged in {small_disk / 'full'} (no space "
        "left on its disk); free space there, then run again with the same --run-id to resume"
    )


@pytest.mark.slow
def test_a_run_whose_staging_disk_is_full_ends_in_one_line_with_exit_2(project, monkeypatch):
    """The digits model's first checkpoint does not fit in 64 KiB of staging; the run's
    small files (progress, the workers' inbox) do."""
    monkeypatch.delenv(SIGNING_KEY_ENV)  # the workers find the project's own key
    with tmpfs(project / ".trainyard" / "staging", "64k") as staging:
        done = trainyard_cli(
            "run", "--run-id", "full", "-S", "train.workers=1", "-S", "train.epochs=2",
            "-S", "train.max_restarts=0", "-S", "tracking.backend=none", cwd=project,
        )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainyard: error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert errors == [
        f"trainyard: error: disk full: checkpoint step 40 cannot be staged in {staging / 'full'} "
        "(no space left on its disk); free space there, then run again with the same --run-id "
        "to resume"
    ], done.stderr[-3000:]
    assert "upload of step" not in done.stderr and "wait for the store" not in done.stderr
    key = project / ".trainyard" / "signing.key"  # made by rank 0's checkpoint writer
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_a_node_holding_another_key_or_none_is_refused_in_one_line(tmp_path, monkeypatch):
    """A multi-node run's nodes check they hold node 0's key by its id (trainyard.checkpoint.
    signing.key_id), which tells nothing of the key; a missing key is not made."""
    node_0, other = tmp_path / "node-0.key", tmp_path / "other.key"
    monkeypatch.setenv(SIGNING_KEY_ENV, str(node_0))
    theirs = key_id(project_key(create=True))
    assert len(theirs) == 16 and theirs not in node_0.read_text()
    check_same_key(theirs)  # node 0's own key passes
    monkeypatch.setenv(SIGNING_KEY_ENV, str(other))
    with pytest.raises(CheckpointError) as missing:
        check_same_key(theirs)
    assert f"this machine has no checkpoint signing key ({other})" in str(missing.value)
    assert "copy .trainyard/signing.key from node 0's machine" in str(missing.value)
    assert not other.exists()
    project_key(create=True)  # a key of this machine's own
    with pytest.raises(CheckpointError) as differs:
        check_same_key(theirs)
    line = str(differs.value)
    assert f"is not node 0's (key id {theirs})" in line and "\n" not in line, line
    assert other.read_text().strip() not in line and node_0.read_text().strip() not in line
