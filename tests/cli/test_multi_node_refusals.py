"""A multi-node run (train.nnodes > 1, no train.rdzv_endpoint) that could only fail once
started is refused on node 0's command line: one line, exit code 2, before any run record,
staging or flow run exists. No second node is started here: each refusal comes first."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.storage import Store

from conftest import trainyard_cli

TESTS = str(Path(__file__).parents[1])


def refused(project: Path, store_settings, *args: str) -> str:
    """The one stderr line of a `trainyard run` refused with exit code 2, nothing left."""
    done = trainyard_cli("run", *args, cwd=project)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert Store(store_settings).list_dirs("runs") == [], "no run record may be written"
    assert not (project / ".trainyard" / "staging").exists(), "no staging may be left"
    return lines[0]


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("storage.prefix=elsewhere", "storage", "where the project's credentials go"),
        ("model.name=tests_support:slow_mlp", "model.name", "code to import"),
    ],
)
def test_a_setting_the_other_nodes_flow_runs_may_not_take_is_refused_up_front(
    project, store_settings, monkeypatch, override, key, why
):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # the model's module imports: only nodes refuse it
    # model.options: the mlp's own, which tests_support:slow_mlp does not take
    nodes = ["-S", "train.nnodes=2", "-S", "model.options={}"]
    line = refused(project, store_settings, *nodes, "-S", override)
    assert line == (
        "trainyard: error: train.nnodes=2 hands -S to the other nodes' flow runs as their "
        f"overrides: {override!r}: {key} chooses {why}, which a flow run's overrides may "
        "not; put it in the project's params.yaml"
    )


def test_a_prefect_server_without_the_node_deployment_is_one_line_before_the_run_starts(
    project, store_settings, session_prefect_server
):
    api_url = session_prefect_server()  # the server this project's commands report to
    line = refused(project, store_settings, "-S", "train.nnodes=2", "-S", "train.workers=1")
    assert line == (
        "trainyard: error: train.nnodes > 1 starts the other nodes as the deployment "
        f"training_node/manual, which the Prefect server at {api_url} does not have: run "
        "`trainyard deploy` with PREFECT_API_URL set to a server every machine reaches "
        "(docs/multi-node.md), or give -S train.rdzv_endpoint=HOST:PORT and start the other "
        "nodes with `trainyard join`"
    )
