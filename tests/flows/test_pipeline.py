"""The whole pipeline, for real: DVC + SeaweedFS + Prefect + torchrun (gloo) + Comet offline."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import subprocess

import pytest
import torch
import yaml

from trainyard.checkpoint.loading import load_model
from trainyard.config import load_config
from trainyard.data.tensors import load_split
from trainyard.dist import DistContext
from trainyard.engine.training import evaluate_split
from trainyard.errors import ConfigError
from trainyard.project import ProjectPaths
from trainyard.runs.preflight import preflight
from trainyard.runs.record import RunRecord, load_record
from trainyard.storage import Store

from conftest import own_store_project, prefect_artifacts, trainyard_cli
from tests_support import read_comet_archive

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_server, prefect_api):
    """One project, trained with 2 workers and then with 1 worker."""
    from flows.pipeline import training_pipeline

    with (
        own_store_project(tmp_path_factory, s3_server, "pipeline") as (root, settings),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.chdir(root)
        paths = ProjectPaths(root)
        two = load_config(paths.params)
        preflight(two, root)  # materializes the bundled digits dataset, as `trainyard run` does
        record_two = training_pipeline(run_id="two-workers")  # params.yaml, as a deployment
        # The second run as a user starts it: `trainyard run` (what `make run` calls).
        cli = trainyard_cli("run", "--run-id", "one-worker", "-S", "train.workers=1", cwd=root)
        assert cli.returncode == 0, cli.stderr[-3000:]
        record_one = load_record(Store(settings), "one-worker")
        yield {
            "root": root,
            "store": Store(settings),
            "two": record_two,
            "one": record_one,
            "env": dict(os.environ),
            "summary": cli.stdout,
            "output": cli.stdout + cli.stderr,
        }


def test_trainyard_run_prints_the_summary(runs):
    record, summary = runs["one"], runs["summary"]
    accuracy = record.metrics["test_accuracy"]
    completed = re.search(r"trainyard run one-worker completed in ([\d.]+)s \(start-up ", summary)
    assert completed and float(completed[1]) > record.timings_s["total"]  # the command's time
    assert f"  test accuracy  {accuracy:.4f}\n" in summary
    assert f"  checkpoint     {record.final_checkpoint}\n" in summary
    assert record.final_checkpoint.startswith(
        "s3://trainyard/pipeline/runs/one-worker/checkpoints/"
    )
    assert "  run record     s3://trainyard/pipeline/runs/one-worker/run.json" in summary
    assert f"(DVC md5 {record.dataset.dvc_md5})" in summary
    assert "offline archives in .trainyard/comet/one-worker/ (1 worker;" in summary
    assert "upload later with `trainyard tracking upload one-worker`" in summary
    assert "trainyard runs show one-worker" in summary
    # Piped, not a terminal: plain log lines with the rank, no progress bar (test_terminal).
    assert "━" not in runs["output"] and "samples/s  loss" not in runs["output"]
    assert re.search(
        r"\| INFO +\| .* \[rank 0/1\] trainyard\.engine\.training: epoch \d+/\d+", runs["output"]
    )


def test_trainyard_run_trains_on_workers_it_started_before_the_flow(runs):
    """`trainyard run` starts the training workers before Prefect's flow (trainyard.runtime.persistent):
    one group, up and waiting, which the flow found idle (it started none) and handed the
    training job to."""
    output = runs["output"]
    up = re.findall(r"\[rank 0/1\] trainyard\.worker: worker up: (.*)", output)
    assert len(up) == 1 and up[0].endswith("; waiting for jobs"), up
    assert "[rank 0/1] trainyard.worker: job 1: train run one-worker" in output
    assert "training workers ahead of the job" not in output


def test_run_record_is_complete_in_the_store(runs):
    store, root = runs["store"], runs["root"]
    record = load_record(store, "two-workers")
    assert record == runs["two"]
    assert record.status == "completed" and record.error is None
    assert record.world_size == 2 and record.backend == "gloo" and record.device == "cpu"
    dvc_md5 = yaml.safe_load((root / "data/raw/digits.csv.dvc").read_text())["outs"][0]["md5"]
    assert record.dataset.dvc_md5 == dvc_md5 and record.dataset.rows == 1797
    assert record.dataset.split_rows["train"] + record.dataset.split_rows["test"] < 1797
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    assert record.code["git_commit"] == head
    assert record.params == load_config(root / "params.yaml").model_dump(mode="json")
    assert set(record.timings_s) >= {"data", "train", "train_start", "evaluate", "total"}
    assert 0 < record.timings_s["train_start"] < record.timings_s["train"]
    # Scored in the training job (one torchrun launch), with the final checkpoint's weights.
    evaluation = store.read_json("runs/two-workers/training.json")["evaluation"]
    assert evaluation["checkpoint"] == record.final_checkpoint
    assert evaluation["rows"] == record.dataset.split_rows["test"]
    assert evaluation["metrics"]["accuracy"] == record.metrics["test_accuracy"]
    assert len(record.history) == record.params["train"]["epochs"]
    assert record.versions["torch"].startswith("2.13")
    assert record.restarts == 0 and record.steps_redone == 0 and record.resumes == []
    assert record.resume_checkpoint is None and not record.warm_start
    # Both ranks' step times per window, for the comparison page's lanes.
    lanes = record.rank_lanes
    assert lanes.steps and lanes.steps == sorted(set(lanes.steps))
    assert all(step % lanes.window_steps == 0 for step in lanes.steps)
    assert all(len(row) == 2 and min(row) > 0 for row in lanes.own_step_ms)


def test_checkpoints_are_in_the_store_at_predictable_paths(runs):
    record, store = runs["two"], runs["store"]
    epochs = record.params["train"]["epochs"]
    steps_per_epoch = int(record.final_checkpoint.rsplit("-", 1)[1]) // epochs
    # checkpoint.every_n_epochs = 1, retention keeps the last 3 and the best by val_accuracy
    last_three = [steps_per_epoch * e for e in range(epochs - 2, epochs + 1)]
    best_epoch = max(record.history, key=lambda row: row["val_accuracy"])["epoch"]
    kept = sorted({*last_three, steps_per_epoch * best_epoch})
    prefix = store.uri("runs/two-workers/checkpoints/step-")
    assert record.checkpoints == [f"{prefix}{step:08d}" for step in kept]
    assert record.final_checkpoint == record.checkpoints[-1]
    committed = [
        name
        for name in store.list_dirs("runs/two-workers/checkpoints")
        if store.exists(f"runs/two-workers/checkpoints/{name}/manifest.json")
    ]
    assert committed == [uri.rsplit("/", 1)[1] for uri in record.checkpoints]


def test_final_checkpoint_loads_into_a_fresh_model_and_reproduces_test_accuracy(runs):
    record, store, root = runs["two"], runs["store"], runs["root"]
    loaded = load_model(store, record.final_checkpoint, root / "scratch")
    model = loaded.model
    folder = ProjectPaths(root).split_cache(record.dataset.split_key)  # the run's own split
    test = load_split(folder, "test", loaded.schema)
    single = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"
    )
    result = evaluate_split(model, test, single)
    assert result["rows"] == record.dataset.split_rows["test"]
    assert result["accuracy"] == pytest.approx(record.metrics["test_accuracy"], abs=1e-12)


def test_digits_reach_90_percent_and_one_worker_matches_two(runs):
    two, one = runs["two"].metrics["test_accuracy"], runs["one"].metrics["test_accuracy"]
    assert two >= 0.90 and one >= 0.90
    assert abs(two - one) <= 0.02, (one, two)
    assert runs["one"].world_size == 1 and runs["one"].rank_lanes is None  # no ranks to compare


def test_metrics_json_is_left_to_the_dvc_train_stage(runs):
    # A run (flow or `trainyard run`) never overwrites the metrics DVC versions.
    assert not (runs["root"] / "metrics.json").exists()
    train = yaml.safe_load((runs["root"] / "dvc.yaml").read_text())["stages"]["train"]
    assert train["metrics"] == [{"metrics.json": {"cache": False}}]
    assert "--metrics-file metrics.json" in train["cmd"]


def test_a_run_links_its_view_of_the_comparison_page_as_a_prefect_artifact(runs):
    (link,) = prefect_artifacts("run-report-two-workers")
    assert link["data"].endswith("(http://127.0.0.1:8765/#runs=two-workers)")
    (summary, *_) = prefect_artifacts("run-summary")
    assert "trainyard report" in summary["data"] and "#runs=" in summary["data"]


def test_every_worker_has_its_own_comet_offline_archive(runs):
    record, root = runs["two"], runs["root"]
    assert sorted(e.rank for e in record.tracking) == [0, 1]
    archives = sorted((root / ".trainyard/comet/two-workers").glob("*.zip"))
    assert len(archives) == 2
    assert sorted(e.archive for e in record.tracking) == [str(a) for a in archives]
    for experiment in record.tracking:
        assert experiment.mode == "offline" and experiment.key
        tags, others, metrics = read_comet_archive(experiment.archive)
        assert others["Name"] == f"two-workers-rank{experiment.rank}"
        assert {"run:two-workers", f"rank:{experiment.rank}", "trainyard"} <= set(tags)
        assert {"loss", "samples_per_s", "lr", "sys/cpu_percent", "sys/rss_mb"} <= set(metrics)
        assert 0 < metrics["sys/rss_mb"][-1] < 100_000 and metrics["sys/cpu_percent"][-1] >= 0
        # The run's outcome, in every worker's experiment: test metrics, data, code, checkpoints.
        assert metrics["test_accuracy"] == [record.metrics["test_accuracy"]]
        assert metrics["test_loss"] == [pytest.approx(record.metrics["test_loss"])]
        assert others["group"] == "run:two-workers"
        assert others["dataset_md5"] == record.dataset.dvc_md5
        assert (
            others["code_commit"] == record.code["git_commit"] and len(others["code_commit"]) == 40
        )
        checkpoints = [v for k, v in sorted(others.items()) if k.startswith("checkpoint/")]
        assert checkpoints[-1] == record.final_checkpoint.rstrip("/")
        assert set(record.checkpoints) <= set(checkpoints)
        assert others["straggler_ranks"] == "none"


def test_cli_shows_and_lists_the_records(runs):
    root, env = runs["root"], runs["env"]
    shown = trainyard_cli("runs", "show", "two-workers", "--json", cwd=root, env=env)
    assert shown.returncode == 0, shown.stderr
    assert RunRecord.model_validate(json.loads(shown.stdout)) == runs["two"]
    listed = trainyard_cli("runs", "list", "--json", cwd=root, env=env)
    assert {r["run_id"] for r in json.loads(listed.stdout)} >= {"two-workers", "one-worker"}
    table = trainyard_cli("runs", "list", cwd=root, env=env).stdout
    assert "two-workers" in table and "completed" in table


def test_the_record_and_runs_show_list_each_node_and_its_host(runs):
    """Both runs on this machine alone: node 0 on its host with every worker, from the first
    round's start to the job's end; `runs show` prints the node."""
    host = socket.gethostname()
    for name, workers in (("two", 2), ("one", 1)):
        record = runs[name]
        [node] = record.nodes
        assert (node.node_rank, node.host, node.workers) == (0, host, workers)
        assert node.ended_at is not None and node.started_at <= node.ended_at
        assert [(r.hosts, r.node_ranks) for r in record.rank_hosts] == [
            ([host] * workers, [0] * workers)
        ]
        assert record.host_changes == []
    shown = trainyard_cli("runs", "show", "two-workers", cwd=runs["root"], env=runs["env"])
    [node] = runs["two"].nodes
    line = f"node        0 on {host}: 2 workers, {node.started_at} to {node.ended_at}"
    assert line in shown.stdout.splitlines(), shown.stdout
    # Every update all-reduced every gradient once: the record counts each rank's bytes.
    sent = runs["two"].communication
    assert sent is not None and len(sent.bytes_sent_per_rank) == 2 and sent.syncs > 0
    assert sent.bytes_sent_per_rank[0] == sent.bytes_sent_per_rank[1]
    assert sent.bytes_sent_per_rank[0] % sent.syncs == 0
    sync = f"sync        allreduce: {sent.syncs} syncs, "
    assert any(line.startswith(sync) for line in shown.stdout.splitlines()), shown.stdout
    alone = runs["one"].communication  # one worker: nothing crossed to another replica
    assert alone is not None and alone.bytes_sent_per_rank == [0] and alone.syncs == 0


def test_warm_start_takes_another_runs_weights_only(runs, monkeypatch):
    from flows.pipeline import training_pipeline

    source = runs["two"]
    for name, value in runs["store"].settings.worker_env().items():
        monkeypatch.setenv(name, value)  # the autouse fixture cleared them for this test
    record = training_pipeline(
        overrides=["train.epochs=1"],
        run_id="warm",
        resume_from="two-workers",
        warm_start=True,
    )
    assert record.resume_from == "two-workers" and record.warm_start
    assert record.resume_checkpoint == source.final_checkpoint
    assert len(record.history) == 1  # a fresh schedule: one epoch, counted from step 0
    steps_per_epoch = int(source.final_checkpoint.rsplit("-", 1)[1]) // len(source.history)
    assert record.final_checkpoint.endswith(f"step-{steps_per_epoch:08d}")
    # The trained weights show: its first epoch is far better than a cold start's.
    assert record.history[0]["train_loss"] < source.history[0]["train_loss"] / 3
    assert record.metrics["test_accuracy"] >= 0.9


def test_a_deployment_runs_bad_override_fails_it_in_one_line_naming_the_override(runs, monkeypatch):
    """As a deployment's flow run starts it: Prefect's engine logs the error without a
    traceback, naming the override (not params.yaml, which does not hold it)."""
    from flows.pipeline import training_pipeline

    monkeypatch.chdir(runs["root"])
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    engine = logging.getLogger("prefect.flow_runs")
    engine.addHandler(handler)
    try:
        with pytest.raises(ConfigError, match="^override train.epoch=3: unknown key"):
            training_pipeline(overrides=["train.epoch=3"])
    finally:
        engine.removeHandler(handler)
    log = logged.getvalue()
    assert "override train.epoch=3: unknown key 'train.epoch'; did you mean 'epochs'?" in log
    assert "Traceback" not in log, log


def test_resuming_onto_another_dataset_is_refused_in_one_line(runs):
    root, env = runs["root"], runs["env"]
    lines = (root / "data/raw/digits.csv").read_text().splitlines()
    (root / "data/raw/other.csv").write_text("\n".join(lines[:-5]) + "\n")
    done = trainyard_cli(
        "run",
        "--resume-from",
        "two-workers",
        "-S",
        "data.path=data/raw/other.csv",
        cwd=root,
        env=env,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()  # refused before Prefect starts: one line
    assert line.startswith(
        "trainyard: error: checkpoint of run two-workers was trained on dataset md5"
    )


def test_resuming_into_another_model_is_refused_naming_what_differs(runs):
    before = runs["store"].list_dirs("runs")
    done = trainyard_cli(
        "run", "--resume-from", "two-workers", "-S", "model.options.hidden_sizes=[32]",
        cwd=runs["root"], env=runs["env"],
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        "trainyard: error: checkpoint of run two-workers was made for another model (options="
    )
    assert "'hidden_sizes': [128, 64]" in line and "'hidden_sizes': [32]" in line
    assert runs["store"].list_dirs("runs") == before  # no run was recorded
