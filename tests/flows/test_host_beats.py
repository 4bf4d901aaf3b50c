"""Node 0's launcher judges a host lost by its worker's heartbeats, against the session's real
Prefect server: a worker that stops beating is dead to it after 3 missed beats, as the server
would call it offline, but without waiting for the server's foreman pass (15 s apart), and it
is alive again on its next beat (a host back with a new worker). A run started after a host
died does not pick it, while the server still calls its worker online."""

from __future__ import annotations

import time
import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import WorkerStatus

from tasks.nodes import HostBeats, wait_for_hosts
from trainyard.errors import TrainyardError

INTERVAL_S = 1.0
MISSED = 3


def test_a_host_is_dead_after_three_missed_heartbeats_and_alive_on_its_next(prefect_api):
    pool = f"beats-{uuid.uuid4().hex[:8]}"
    beats = HostBeats()
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        try:

            def beat(host: str) -> None:
                client.send_worker_heartbeat(pool, host, heartbeat_interval_seconds=INTERVAL_S)

            started = time.monotonic()
            beat("host-a")
            beat("host-b")
            assert beats.alive(client, pool) == ["host-a", "host-b"]
            stopped = time.monotonic()  # host-b beats no more; host-a beats on
            while not beats.late("host-b"):
                beat("host-a")
                before = time.monotonic()
                alive = beats.alive(client, pool)
                if time.monotonic() - started < MISSED * INTERVAL_S:
                    assert alive == ["host-a", "host-b"], alive
                if before - stopped > MISSED * INTERVAL_S:
                    assert alive == ["host-a"], alive
                assert before - stopped < 60, "host-b never counted as late"
                assert not beats.late("host-a")
                time.sleep(INTERVAL_S / 4)
            assert beats.alive(client, pool) == ["host-a"]
            # A later run's first look, while the server still calls host-b's worker online:
            # host-b's beat is 3 of its heartbeats behind host-a's. (The server's pass, every
            # 15 s, may call it offline first: then host-b beats once more, and again.)
            deadline = time.monotonic() + 120
            while True:
                beat("host-a")
                first_look = HostBeats().alive(client, pool)
                online = {w.name: w.status == WorkerStatus.ONLINE
                          for w in client.read_workers_for_work_pool(pool)}  # fmt: skip
                if online["host-b"] and first_look == ["host-a"]:
                    break
                if not online["host-b"]:
                    beat("host-b")
                assert time.monotonic() < deadline, "a first look never left host-b out"
                time.sleep(INTERVAL_S / 4)
            assert wait_for_hosts(client, pool, 1, timeout_s=0) == ["host-a"]
            with pytest.raises(TrainyardError, match=r"workers on 1 host\(s\) \(host-a\)"):
                wait_for_hosts(client, pool, 2, timeout_s=0)
            beat("host-b")  # the host is back, with a new worker
            assert beats.alive(client, pool) == ["host-a", "host-b"]
            assert not beats.late("host-b")
        finally:
            client.delete_work_pool(pool)
