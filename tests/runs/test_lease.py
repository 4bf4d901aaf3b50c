"""One owner per run id, against the real store: the lease, its takeover, commits that check
it, `trainyard runs delete` and `trainyard runs unlock`. Staleness is judged by the store's
clock alone: claimants whose clocks disagree, and heartbeats stamped in the past or future."""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from trainyard.checkpoint.layout import MANIFEST_FILE, checkpoint_key
from trainyard.checkpoint.writer import CheckpointWriter
from trainyard.errors import CheckpointError
from trainyard.runs import lease as leases
from trainyard.runs.lease import (
    Lease,
    RunLease,
    RunOwned,
    check_not_owned,
    check_owner,
    lease_key,
    read_lease,
)
from trainyard.runs.record import RunRecord, now, save_record

from conftest import trainyard_cli
from tests_support import manifest_fields
from training_jobs import wait_for

YEAR_S = 365 * 24 * 3600


def _foreign_lease(store, run_id: str, claimed_offset_s: float = 0) -> Lease:
    """A lease held by a process on another machine, written now, whose own clock says it is
    `claimed_offset_s` from this one's."""
    beat = time.time() + claimed_offset_s
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


@pytest.mark.parametrize("claimed_offset_s", [-3600, YEAR_S], ids=["hour-old", "year-ahead"])
def test_another_hosts_lease_is_live_until_the_store_has_not_seen_it_for_a_while(
    store, monkeypatch, claimed_offset_s
):
    """Neither a heartbeat stamped an hour ago nor one a year ahead counts: the store wrote
    the lease just now, so it is live, and it goes stale once the store has seen no write
    for STALE_AFTER_S (shortened here, so the test need not wait 30 s)."""
    _foreign_lease(store, "remote", claimed_offset_s)
    with pytest.raises(RunOwned, match="pid 4242 on other-host"):
        check_not_owned(store, "remote")
    monkeypatch.setattr(leases, "STALE_AFTER_S", 2.0)
    wait_for(lambda: not read_lease(store, "remote").is_live(), 60, "the lease to go stale")
    with RunLease(store, "remote") as lease:
        note = lease.takeover_note()
    assert note["pid"] == 4242
    # The record says when the store saw the last heartbeat, not what the lease claimed.
    heard = dt.datetime.fromisoformat(note["last_heartbeat"]).timestamp()
    assert abs(heard - time.time()) < 600 and note["last_heartbeat"] <= note["at"]


@pytest.mark.parametrize(
    "planted",
    [{"since": 1e308}, {"heartbeat_at": float("nan")}, {"host": "evil\x1b]0;owned\x07"}],
    ids=["since-1e308", "heartbeat-nan", "host-with-escapes"],
)
def test_a_planted_lease_that_cannot_be_shown_is_unreadable_and_taken_over(store, planted):
    """Whoever can write the store can write a lease: one whose times no message can print
    (1e308 overflowed the date) or whose host would drive the terminal locks nothing."""
    lease = {"run_id": "odd", "token": "p" * 32, "host": "h", "pid": 1, "since": 1.0}
    store.write_json(lease_key("odd"), lease | {"heartbeat_at": 1.0} | planted)
    assert read_lease(store, "odd") is None
    with RunLease(store, "odd") as taken:
        assert store.read_json(lease_key("odd"))["token"] == taken.token


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


# A claimant on another machine whose clock is `skew` seconds off this one's: time.time is
# shifted and the host renamed before trainyard is imported. It claims the run and says how
# that went; argv: skew, run id, STALE_AFTER_S.
CLAIMANT = textwrap.dedent(
    """
    import socket, sys, time

    skew = float(sys.argv[1])
    real_time = time.time
    time.time = lambda: real_time() + skew
    socket.gethostname = lambda: "claimant-host"

    from trainyard.runs import lease
    from trainyard.storage import Store, StoreSettings

    lease.STALE_AFTER_S = float(sys.argv[3])
    store = Store(StoreSettings.from_worker_env())
    try:
        with lease.RunLease(store, sys.argv[2]) as held:
            print("took over", held.takeover_note()["pid"])
    except lease.RunOwned as exc:
        print("refused:", exc)
    """
)


def _claim_from_a_skewed_host(store, run_id: str, skew_s: float, stale_after_s: float) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CLAIMANT, str(skew_s), run_id, str(stale_after_s)],
        env=os.environ | store.settings.worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_claimant_whose_clock_runs_45_s_ahead_cannot_take_a_live_lease(store):
    with RunLease(store, "skewed") as owner:
        outcome = _claim_from_a_skewed_host(store, "skewed", 45, leases.STALE_AFTER_S)
        assert outcome.startswith(
            f"refused: run skewed is in use by pid {os.getpid()} on {socket.gethostname()}"
        )
        check_owner(store, "skewed", owner.token)  # the owner's commits still go through


def test_a_claimant_whose_clock_runs_45_s_behind_takes_a_stale_lease(store, monkeypatch):
    _foreign_lease(store, "behind")
    monkeypatch.setattr(leases, "STALE_AFTER_S", 2.0)
    wait_for(lambda: not read_lease(store, "behind").is_live(), 60, "the lease to go stale")
    assert _claim_from_a_skewed_host(store, "behind", -45, 2.0) == "took over 4242"


def test_an_owner_whose_lease_was_broken_stops_heartbeating_and_cannot_commit(store, monkeypatch):
    monkeypatch.setattr(leases, "HEARTBEAT_S", 0.5)
    with RunLease(store, "broken") as owner:
        planted = store.get_bytes(lease_key("broken"))
        with pytest.raises(leases.UnlockNeedsYes, match=rf"leased by pid {os.getpid()} on "):
            leases.unlock(store, "broken", yes=False)
        wait_for(lambda: store.get_bytes(lease_key("broken")) != planted, 30, "a heartbeat")
        said = leases.unlock(store, "broken", yes=True)
        assert said.startswith(f"unlocked run broken, which was leased by pid {os.getpid()}")
        wait_for(lambda: not owner._thread.is_alive(), 30, "the heartbeat to stop")
        assert not store.exists(lease_key("broken"))  # not written back
        with pytest.raises(RunOwned, match="run broken is no longer owned by this trainer"):
            check_owner(store, "broken", owner.token)
    save_record(store, RunRecord(run_id="broken", created_at=now(), params={}))
    assert leases.unlock(store, "broken", yes=True) == "run broken has no lease: nothing to unlock"


def test_runs_unlock_names_the_owner_and_breaks_the_lease_only_with_yes(project, store):
    save_record(store, RunRecord(run_id="stuck", created_at=now(), params={}))
    _foreign_lease(store, "stuck", claimed_offset_s=YEAR_S)  # by its own clock, never stale
    planted = store.get_bytes(lease_key("stuck"))

    asked = trainyard_cli("runs", "unlock", "stuck", cwd=project)
    assert asked.returncode == 2 and asked.stdout == "", asked.stderr
    line = asked.stderr.strip()
    assert "\n" not in line and line.endswith("then add --yes")
    assert line.startswith(
        "trainyard: error: run stuck is leased by pid 4242 on other-host, since "
    )
    assert re.search(r"last heartbeat \d+ s ago by the store's clock \(live\)", line), line
    assert store.get_bytes(lease_key("stuck")) == planted  # asking changed nothing

    broken = trainyard_cli("runs", "unlock", "stuck", "--yes", cwd=project)
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.startswith("unlocked run stuck, which was leased by pid 4242 on ")
    assert not store.exists(lease_key("stuck"))
    deleted = trainyard_cli("runs", "delete", "stuck", cwd=project)
    assert deleted.returncode == 0, deleted.stderr

    unknown = trainyard_cli("runs", "unlock", "nosuch", "--yes", cwd=project)
    assert unknown.returncode == 2
    assert (
        unknown.stderr
        == f"trainyard: error: no run 'nosuch' in {store.uri('runs')}; see `trainyard runs list`\n"
    )
