"""train.sync local_sgd, diloco and parameter_server through real torchrun workers and the
real S3 store.

Each replica steps alone and the replicas agree every train.sync_every updates: the run
reaches the test accuracy of replicas that all-reduce every update, sends a third of their
bytes at sync_every 3 (the record counts them; an epoch's end costs no sync of its own, as
validation scores the weights last agreed on), and a worker killed between syncs
resumes to the very weights of an uninterrupted run (every worker's own weights and
optimizer, DiLoCo's anchors and outer momentum are in the checkpoint). A parameter server's
workers reach it too, and one killed resumes from the servers' committed state: every
update is applied once, none lost, none twice.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainyard.checkpoint.loading import load_checkpoint

from training_jobs import (
    accuracy_on_test,
    committed_mid_epoch,
    final_model_state,
    kill_worker,
    module_store,
    params,
    prepare_project,
    save_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = os.path.dirname(os.path.dirname(__file__))
# 20 ms steps (tests_support:slow_mlp): a kill after the step-49 checkpoint lands with
# seconds of training left on any machine.
SLOW = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.02}}
EVERY = 3  # updates between syncs, across epochs of 20
KILLED_AFTER = 43  # checkpoints every 7 steps: the kill lands after step 49's (between syncs)


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "sync-tests")
    paths = prepare_project(tmp_path_factory.mktemp("sync") / "project", store.settings)
    return paths, store


def _params(sync: str) -> dict:
    return params(model=SLOW, train={"sync": sync, "sync_every": EVERY})


@pytest.fixture(scope="module")
def uninterrupted(env):
    """One uninterrupted run of each mode, on the same data, model and seed."""
    paths, store = env
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", TESTS)  # workers import tests_support
        return {
            sync: train_to_end(paths, store, save_run(store, f"whole-{sync}", _params(sync)))
            for sync in ("allreduce", "local_sgd", "diloco", "parameter_server")
        }


def test_replicas_that_sync_every_3_updates_learn_as_well_on_a_third_of_the_bytes(
    env, uninterrupted
):
    paths, store = env
    allreduce = uninterrupted["allreduce"]
    steps = allreduce["steps"]
    every_update = allreduce["communication"]
    assert every_update["syncs"] == steps == 160  # 8 epochs x 20 updates
    model_bytes = every_update["bytes_sent_per_rank"][0] // steps  # one all-reduced gradient
    assert every_update["bytes_sent_per_rank"] == [model_bytes * steps] * 2
    assert all(0 < wait < 60 for wait in every_update["wait_s_per_rank"])
    expected = accuracy_on_test(paths, store, allreduce)
    for sync in ("local_sgd", "diloco"):
        training = uninterrupted[sync]
        assert training["steps"] == steps
        # A sync every 3 updates across the epochs' ends (none of their own: 56 syncs if
        # there were), and one for the last update (160 = 53 x 3 + 1) before the last
        # validation, so the run's model holds them all.
        communication = training["communication"]
        assert communication["syncs"] == 54
        assert communication["bytes_sent_per_rank"] == [model_bytes * 54] * 2
        # Its checkpoints gather each worker's own weights and momentum besides the RNG
        # state every mode's gather, counted apart: at least 8 such copies (the test's
        # cadence, every 7 steps and every 2 epochs, takes more).
        rng_only = every_update["checkpoint_bytes_per_rank"]
        own_state, rest = divmod(
            communication["checkpoint_bytes_per_rank"][1] - rng_only[1], 2 * model_bytes
        )
        assert rest == 0 and own_state >= 8, communication
        assert (
            communication["checkpoint_bytes_per_rank"]
            == [rng_only[0] + 2 * model_bytes * own_state] * 2
        )
        assert all(0 < wait < 60 for wait in communication["checkpoint_wait_s_per_rank"])
        accuracy = accuracy_on_test(paths, store, training)
        print(f"{sync}: test accuracy {accuracy:.4f} vs allreduce {expected:.4f}")
        # Within 1 point (the bar), and the one of the 270 test rows another CPU's
        # rounding may flip (the runs are exact on one machine, not across instruction sets).
        assert abs(accuracy - expected) <= 0.01 + 1 / 270, (sync, accuracy, expected)


def test_a_parameter_servers_workers_learn_as_well_pushing_every_update(env, uninterrupted):
    paths, store = env
    allreduce, served = uninterrupted["allreduce"], uninterrupted["parameter_server"]
    model_bytes = allreduce["communication"]["bytes_sent_per_rank"][0] // 160
    communication = served["communication"]
    assert served["steps"] == communication["syncs"] == 160  # one push per update
    # Rank 1 pushes its gradients; rank 0 serves: it sends rank 1 the weights after each of
    # its pushes and at each meeting (every epoch's end and checkpoint).
    served_bytes, pushed_bytes = communication["bytes_sent_per_rank"]
    assert pushed_bytes == model_bytes * 160
    meetings, rest = divmod(served_bytes - model_bytes * 160, model_bytes)
    assert rest == 0 and meetings >= 8, (served_bytes, model_bytes)
    assert sum(communication["staleness"].values()) == 2 * 160
    assert _server_counters(store, served) == ([160, 160], 320)
    accuracy = accuracy_on_test(paths, store, served)
    expected = accuracy_on_test(paths, store, allreduce)
    print(f"parameter_server: test accuracy {accuracy:.4f} vs allreduce {expected:.4f}")
    assert abs(accuracy - expected) <= 0.01 + 1 / 270, (accuracy, expected)


def _server_counters(store, training: dict) -> tuple[list[int], int]:
    """The final checkpoint's server: each worker's pushes and the updates it applied."""
    state, _ = load_checkpoint(store, training["final_checkpoint"])
    server = state["replicas"][0]["server"]
    return server["clocks"], server["version"]


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_a_worker_killed_between_syncs_resumes_to_the_same_weights(
    env, uninterrupted, sync, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store, training = _killed(env, sync)
    ours, theirs = final_model_state(store, training), final_model_state(store, uninterrupted[sync])
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_parameter_servers_killed_worker_resumes_losing_no_committed_update(env, monkeypatch):
    """The workers meet at a checkpoint, so it holds every update pushed by then and none
    after; the resumed servers apply each later push once: 2 x 160 in all."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store, training = _killed(env, "parameter_server")
    assert _server_counters(store, training) == ([160, 160], 320)


def _killed(env, sync: str):
    """A run whose rank 1 is killed after a mid-epoch checkpoint, and restarted."""
    paths, store = env
    run_id = f"killed-{sync}"
    record = save_run(store, run_id, _params(sync))
    job, thread = train(paths, store, record, max_restarts=2)
    wait_for(
        lambda: committed_mid_epoch(store, run_id, KILLED_AFTER), what="a mid-epoch checkpoint"
    )
    kill_worker(run_id, rank=1)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    training = store.read_json(f"runs/{run_id}/training.json")
    [event] = training["resumes"]
    # Most often step 49 or 56, one or two updates into an interval.
    assert event["from_step"] >= KILLED_AFTER and training["restarts"] == 1, event
    return store, training
