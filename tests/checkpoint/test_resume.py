"""Exact resume and elastic restarts with real torchrun workers and the real S3 store.

One uninterrupted run is the reference; a run interrupted mid-epoch and launched again, and
a run whose worker is SIGKILLed (torchrun restarts the group), must both end with the very
same weights, because model, optimizer, scheduler, every rank's RNG and the position in the
epoch are restored from the latest committed checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainyard.checkpoint.layout import step_of
from trainyard.config import config_from_dict
from trainyard.runtime.launch import run_worker

from tests_support import loopback_endpoint
from training_jobs import (
    accuracy_on_test,
    committed_mid_epoch,
    final_model_state,
    kill_worker,
    learning,
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


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "resume-tests")
    paths = prepare_project(tmp_path_factory.mktemp("resume") / "project", store.settings)
    return paths, store


@pytest.fixture(scope="module")
def reference(env):
    paths, store = env
    record = save_run(store, "reference", params())
    return train_to_end(paths, store, record)


# The runs that are interrupted, and the one whose checkpoints are counted, train 20 ms steps
# (tests_support:slow_mlp): a kill after their step-40 or step-60 checkpoint then lands with
# seconds of training left on any machine (at digits' millisecond steps the job could end
# first), and uploads keep up with a checkpoint every 7 steps. Each is compared with an
# uninterrupted run of the same settings.
SLOW = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.02}}


@pytest.fixture(scope="module")
def slow_reference(env):
    paths, store = env
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", TESTS)  # workers import tests_support
        return train_to_end(paths, store, save_run(store, "slow-reference", params(model=SLOW)))


def test_uninterrupted_run_checkpoints_mid_epoch_with_full_manifest(env, slow_reference):
    """20 ms steps: at digits' millisecond ones a checkpoint every 7 steps outpaces the
    uploads, and staged checkpoints are dropped (checkpoint.max_staged)."""
    reference = slow_reference
    _, store = env
    assert reference["restarts"] == 0 and reference["steps_redone"] == 0
    assert reference["resumed_from"] is None and reference["steps"] == 160
    manifests = [
        store.read_json(f"{store.key_of(uri)}/manifest.json") for uri in reference["checkpoints"]
    ]
    # Retention: the last 3 (147, 154, 160) and the best end-of-epoch one.
    assert [m["step"] for m in manifests][-3:] == [147, 154, 160] and len(manifests) <= 4
    mid = manifests[-2]
    assert mid["epoch"] == 7 and mid["step_in_epoch"] == 14 and mid["metrics"] == {}
    final = manifests[-1]
    assert final["epoch"] == 8 and final["step_in_epoch"] == 0
    assert final["metrics"]["val_accuracy"] == reference["history"][-1]["val_accuracy"]
    for manifest in manifests:
        assert manifest["world_size"] == 2 and manifest["strategy"] == "ddp"
        assert manifest["dataset_md5"] == "md5-a" and len(manifest["params_hash"]) == 16
        assert manifest["model"]["name"] == SLOW["name"]
        assert manifest["torch_version"].startswith("2.13")


def test_epochs_shorter_than_a_checkpoints_trip_to_the_store_skip_theirs(env):
    """The default cadence, every epoch within checkpoint.max_overhead (0.01 by default; 0.03
    here): a digits epoch takes a fraction of a second, well under 1/0.03 of a checkpoint's
    serialize-and-upload time, so after the first epochs' checkpoints (the second measures
    the steady cost; the first's holds one-time work) the next epochs skip theirs until one
    would fit; the last epoch's is always taken. With max_overhead null, every epoch has
    one."""
    paths, store = env
    saved, skipped = {}, {}
    for run_id, share in (("every-epoch", None), ("within-budget", 0.03)):
        cadence = {"every_n_epochs": 1, "every_n_steps": None, "keep_last": 100}
        run_params = params(train={"epochs": 6}, checkpoint={**cadence, "max_overhead": share})
        training = train_to_end(paths, store, save_run(store, run_id, run_params))
        saved[run_id] = [step_of(uri) for uri in training["checkpoints"]]
        skipped[run_id] = training["skipped_checkpoint_epochs"]
    assert saved["every-epoch"] == [20, 40, 60, 80, 100, 120] and skipped["every-epoch"] == []
    assert saved["within-budget"][0] == 20 and saved["within-budget"][-1] == 120
    assert len(saved["within-budget"]) < 6, saved
    # The record says which epochs skipped theirs: every epoch is either saved or listed.
    epochs_saved = [step // 20 for step in saved["within-budget"]]
    assert sorted(epochs_saved + skipped["within-budget"]) == [1, 2, 3, 4, 5, 6]


def test_interrupted_then_resumed_equals_uninterrupted(env, slow_reference, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    reference = slow_reference
    paths, store = env
    record = save_run(store, "interrupted", params(model=SLOW))
    job, thread = train(paths, store, record, max_restarts=0)
    wait_for(lambda: committed_mid_epoch(store, "interrupted", 60), what="a mid-epoch checkpoint")
    kill_worker("interrupted", rank=1)
    thread.join(timeout=120)
    assert job.error is not None, "the job should have failed when its worker was killed"

    resumed = train_to_end(paths, store, record)  # checkpoint.resume: auto
    assert resumed["resumed_from"] is not None
    resumed_step = resumed["resumes"][-1]["from_step"]
    assert 60 <= resumed_step < 160
    assert resumed["steps"] == 160
    ours, theirs = final_model_state(store, resumed), final_model_state(store, reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert learning(resumed["history"]) == learning(reference["history"])


def test_killed_worker_restarts_and_resumes_from_latest_committed(env, slow_reference, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    reference = slow_reference
    paths, store = env
    record = save_run(store, "killed", params(model=SLOW))
    job, thread = train(paths, store, record, max_restarts=2)
    wait_for(lambda: committed_mid_epoch(store, "killed", 40), what="a mid-epoch checkpoint")
    killed_at = kill_worker("killed", rank=1)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    training = store.read_json("runs/killed/training.json")
    assert training["restarts"] == 1
    [event] = training["resumes"]
    assert event["attempt"] == 1 and event["from_step"] >= 40
    assert event["after"] == "worker failed"  # torchrun's restart, not a lost agent
    assert event["checkpoint"].endswith(f"step-{event['from_step']:08d}")
    assert event["steps_redone"] == event["last_step_before"] - event["from_step"] >= 0
    assert training["steps_redone"] == event["steps_redone"]
    # The job's first step, the first attempt's: not the restart's, which would count the
    # first attempt's training as start-up.
    assert training["first_step_at"] < killed_at < event["resumed_at"]
    accuracy, expected = (
        accuracy_on_test(paths, store, training),
        accuracy_on_test(paths, store, reference),
    )
    assert abs(accuracy - expected) <= 0.01
    # Exact resume makes it more than close: the same weights.
    ours, theirs = final_model_state(store, training), final_model_state(store, reference)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    print(
        f"kill -> resumed {event['resumed_at'] - killed_at:.1f}s, "
        f"steps redone {event['steps_redone']}"
    )


def test_two_nodes_on_loopback_match_one_node_with_two_workers(env, reference):
    """Two torchrun launchers (2 nodes x 1 worker) meet at a c10d rendezvous on loopback."""
    paths, store = env
    endpoint = loopback_endpoint()
    nodes = {"workers": 1, "nnodes": 2, "rdzv_endpoint": endpoint}
    record = save_run(store, "two-nodes", params(train=nodes))
    launchers = [train(paths, store, record, node_rank=rank) for rank in (0, 1)]
    for job, thread in launchers:
        thread.join(timeout=600)
        assert job.error is None, "\n".join(job.lines[-60:])
    training = store.read_json("runs/two-nodes/training.json")
    assert training["world_size"] == 2 and training["steps"] == reference["steps"]
    ours, theirs = final_model_state(store, training), final_model_state(store, reference)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert learning(training["history"]) == learning(reference["history"])


def test_node_0_is_global_rank_0_and_commits_when_node_1_joins_first(env):
    """torchrun's c10d rendezvous ignores --node-rank and ranked the node that was waiting
    first as 0; trainyard's ranks the nodes by train.node_rank, whatever order they join in."""
    paths, store = env
    endpoint = loopback_endpoint()
    nodes = {"workers": 1, "nnodes": 2, "rdzv_endpoint": endpoint, "epochs": 2}
    record = save_run(store, "node-1-first", params(train=nodes))
    node_1, thread_1 = train(paths, store, record, node_rank=1)
    # Node 1's agent hosts the rendezvous store on loopback once it waits for the others.
    port = int(endpoint.rsplit(":", 1)[1])
    wait_for(lambda: _listening(port), timeout_s=300, what="node 1 at the rendezvous")
    node_0, thread_0 = train(paths, store, record, node_rank=0)
    for job, thread in ((node_0, thread_0), (node_1, thread_1)):
        thread.join(timeout=600)
        assert job.error is None, "\n".join(job.lines[-60:])
    training = store.read_json("runs/node-1-first/training.json")
    assert training["world_size"] == 2 and training["checkpoints"]
    commits = [line for line in node_0.lines if " committed to " in line]
    assert commits and all("[rank 0/2]" in line for line in commits)
    final = f"checkpoint step {step_of(training['final_checkpoint'])} committed to"
    assert any(final in line for line in commits)
    assert not any(" committed to " in line or "[rank 0/" in line for line in node_1.lines)


def _listening(port: int) -> bool:
    """A socket of this machine listens on `port`, any address (read from /proc: connecting
    would make a client of the store)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            rows += [line.split() for line in list(lines)[1:]]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows)


def test_fsdp_trains_into_the_ddp_band_checkpoints_per_rank_and_resumes(env, reference):
    paths, store = env
    record = save_run(store, "fsdp", params(train={"strategy": "fsdp"}))
    job, thread = train(paths, store, record, max_restarts=2)
    wait_for(lambda: committed_mid_epoch(store, "fsdp", 40), what="a mid-epoch checkpoint")
    kill_worker("fsdp", rank=1)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    training = store.read_json("runs/fsdp/training.json")
    assert training["restarts"] == 1 and training["resumes"][0]["from_step"] >= 40
    manifest = store.read_json(f"{store.key_of(training['final_checkpoint'])}/manifest.json")
    assert manifest["strategy"] == "fsdp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"} == set(manifest["files"])
    accuracy = accuracy_on_test(paths, store, training)
    expected = accuracy_on_test(paths, store, reference)
    assert accuracy >= 0.9 and abs(accuracy - expected) <= 0.02, (accuracy, expected)
    # The pipeline's evaluation job reads the sharded checkpoint too (resharded to full).
    config = config_from_dict(record.params)
    args = ["evaluate", "--run-id", "fsdp", "--checkpoint", training["final_checkpoint"]]
    run_worker(paths.root, config.train, store.settings.worker_env(), args, lambda _: None)
    evaluation = store.read_json("runs/fsdp/evaluation.json")
    assert evaluation["metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    # The training job scored the test split itself, with the sharded model it ended on.
    in_job = training["evaluation"]
    assert (
        in_job["checkpoint"] == training["final_checkpoint"]
        and in_job["rows"] == evaluation["rows"]
    )
    assert in_job["metrics"] == pytest.approx(evaluation["metrics"], rel=1e-9)
