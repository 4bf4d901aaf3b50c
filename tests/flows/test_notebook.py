"""The quickstart notebook, executed top to bottom on a real kernel (nbclient) in a fresh
project: it trains two runs, draws their curves, compares them, loads a model and predicts,
and runs a tiny sweep, against the session's real store."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import REPO

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def test_the_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def outputs_of(cell) -> str:
    """What a cell showed: printed text, a result's text and HTML."""
    parts = []
    for output in cell.outputs:
        parts.append(output.get("text", ""))
        data = output.get("data", {})
        parts += [data.get("text/plain", ""), data.get("text/html", "")]
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_quickstart_notebook_runs_top_to_bottom(project, use_store):
    """Opened from the project's notebooks/ folder, as in Jupyter: the project is its parent."""
    Path(os.environ["HOME"]).mkdir(parents=True, exist_ok=True)  # IPython keeps its profile there
    (project / "notebooks").mkdir()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(project / "notebooks")}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    setup, train, curves, compare, predict, sweep = code

    assert f"project: {project}" in outputs_of(setup)
    store = Store(use_store)
    trained = sorted(r for r in store.list_dirs("runs") if r.startswith("quickstart-"))
    a, b = trained
    assert a.endswith("-a") and b.endswith("-b")
    for run_id in trained:
        assert load_record(store, run_id).status == "completed"
    (figure,) = [o["data"][PLOTLY] for o in curves.outputs if PLOTLY in o.get("data", {})]
    names = {trace["name"] for trace in figure["data"]}
    assert {f"{a} val_loss", f"{b} train_loss"} <= names
    assert "train.lr" in outputs_of(compare) and "test_accuracy" in outputs_of(compare)
    right = re.search(r"quickstart-\S+: (\d) of 8 rows right", outputs_of(predict))
    assert right and int(right[1]) >= 6, outputs_of(predict)
    (trials,) = [
        o["data"]["text/plain"] for o in sweep.outputs if "text/plain" in o.get("data", {})
    ]
    states = re.findall(r"\b(COMPLETE|PRUNED|FAIL)\b", trials)
    assert len(states) == 2 and "FAIL" not in states, trials
