"""The benchmarks' quick mode, once, so they cannot rot. Timings are never asserted here."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_benchmarks_run_and_report_every_figure(tmp_path, session_prefect_server):
    out = tmp_path / "results.json"
    # The session's Prefect server: the quick flows report to it instead of starting one.
    env = os.environ | {"PREFECT_API_URL": session_prefect_server()}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", report["commit"]), report["commit"]
    assert set(report["benchmarks"]) == {
        "throughput", "loop", "lm_throughput", "scaling", "checkpoint_cost", "recovery",
        "data_wait", "end_to_end", "sweep", "inference", "report", "images", "pipeline_bubble",
        "layouts",
    }  # fmt: skip
    for name, result in report["benchmarks"].items():
        assert result["figures"], name
        for figure, stats in result["figures"].items():
            assert stats["n"] >= 1 and 0 <= stats["min"] <= stats["median"] <= stats["max"], (
                name,
                figure,
            )
            # A count, and a wait for workers started ahead, may be 0; the rest are rates
            # and times.
            if not figure.startswith("steps redone") and "waiting for the workers" not in figure:
                assert stats["min"] > 0, (name, figure)
    assert "trainyard defaults / raw (target >= 0.97) |" in done.stdout
    assert "same processes: trainyard train() / raw loop |" in done.stdout
    assert "trainyard, checkpoint at the end / raw, tokens/s |" in done.stdout
    assert "asha / no pruning, wall (target <= 0.4) |" in done.stdout
    assert "trainyard 2 workers / plain PyTorch, rows/s |" in done.stdout
    assert "data wait per step: decoding per step / decoded at split time |" in done.stdout
    assert "pipeline 2 (1f1b, 4 micro-batches) / ddp, tokens/s |" in done.stdout
    assert report["machine"]["cores"] >= 1
