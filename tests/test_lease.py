"""One owner per run id, against the real store: the lease, its takeover, commits that check
it, and `trainyard runs delete`."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import torch

from trainyard.checkpoint import MANIFEST_FILE, CheckpointWriter, checkpoint_key
from trainyard.errors import CheckpointError
from trainyard.lease import STALE_AFTER_S, Lease, RunLease, RunOwned, check_not_owned, lease_key
from trainyard.runs import RunRecord, now, save_record

from conftest import trainyard_cli
from tests_support import manifest_fields


def _foreign_lease(store, run_id: str, heartbeat_age_s: float) -> Lease:
    """A lease held by a process on another machine, last renewed `heartbeat_age_s` ago."""
    beat = time.time() - heartbeat_age_s
    lease = Lease(
        run_id=run_id, token="t" * 32, host="other-host", pid=4242, since=beat, heartbeat_at=beat
    )
    store.write_json(lease_key(run_id), lease.model_dump())
    return lease


def test_a_live_lease_refuses_a_second_owner_and_is_released_on_exit(store):
    with RunLease(store, "solo") as lease:
        assert store.read_json(lease_key("solo"))["token"] == lease.token
        with pytest.raises(RunOwned, match=rf"run solo is in use by pid {os.getpid()} on "):
            RunLease(store, "solo").__enter__()
    assert not store.exists(lease_key("solo"))


def test_another_hosts_lease_is_live_until_its_heartbeat_is_stale(store):
    _foreign_lease(store, "remote", heartbeat_age_s=1)
    with pytest.raises(RunOwned, match="pid 4242 on other-host"):
        check_not_owned(store, "remote")
    stale = _foreign_lease(store, "remote", heartbeat_age_s=STALE_AFTER_S + 1)
    with RunLease(store, "remote") as lease:
        assert lease.takeover_note()["pid"] == stale.pid == 4242


def test_a_dead_local_owner_is_taken_over_at_once(store):
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    lease = Lease(
        run_id="orphaned",
        token="d" * 32,
        host=socket.gethostname(),
        pid=dead.pid,
        pid_started="1",  # whatever started there now is not that process
        since=time.time(),
        heartbeat_at=time.time(),  # fresh: only the pid check can tell it is dead
    )
    store.write_json(lease_key("orphaned"), lease.model_dump())
    with RunLease(store, "orphaned") as taken:
        assert taken.takeover_note()["pid"] == dead.pid


def test_a_trainer_that_lost_its_run_cannot_commit(store, tmp_path):
    with RunLease(store, "taken") as lease:
        writer = CheckpointWriter(
            store, "taken", tmp_path / "staging", lease_token="not-" + lease.token
        )
        writer.save(5, {"model": {"w": torch.zeros(2)}}, manifest_fields())
        with pytest.raises(CheckpointError, match="run taken is no longer owned by this trainer"):
            writer.close()
    assert not store.exists(f"{checkpoint_key('taken', 5)}/{MANIFEST_FILE}")


def test_runs_delete_frees_a_run_and_refuses_a_live_one(project, store):
    record = RunRecord(run_id="gone", created_at=now(), params={})
    save_record(store, record)
    with RunLease(store, "gone"):
        refused = trainyard_cli("runs", "delete", "gone", cwd=project)
    assert refused.returncode == 2 and "run gone is in use by pid" in refused.stderr
    writer = CheckpointWriter(store, "gone", project / ".trainyard" / "staging")
    writer.save(3, {"model": {"w": torch.zeros(1000)}}, manifest_fields())
    writer.close()
    staging = project / ".trainyard" / "staging" / "gone"
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "progress.json").write_text("{}")

    deleted = trainyard_cli("runs", "delete", "gone", cwd=project)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.startswith("deleted run gone: 3 objects (")
    assert store.list_files("runs/gone") == {} and not staging.exists()
    again = trainyard_cli("runs", "delete", "gone", cwd=project)
    assert again.returncode == 2 and "no run 'gone'" in again.stderr
