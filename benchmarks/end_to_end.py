"""2. End-to-end wall time of a short job (launch -> trained, checkpointed, validated) and
time to the first training step, for: the trainyard flow with Prefect's temporary API, the
trainyard flow against an already-running Prefect server, the raw torchrun script, and Ray
Train's TorchTrainer. Same model, data, batch and 2 workers."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from benchmarks.common import BIN, REPO, BenchProject, interleaved, ratio, run_raw_script, summary

WORKERS = 2


def run(project: BenchProject, quick: bool) -> dict:
    epochs, reps = (3, 1) if quick else (5, 3)
    counter = itertools.count()
    first_step: dict[str, list[float]] = {}

    def trainyard(api_url: str | None, label: str):
        def measure() -> float:
            run_id = f"bench-e2e-{next(counter)}"
            env = project.env(**({"PREFECT_API_URL": api_url} if api_url else {}))
            started = time.time()
            subprocess.run(
                [str(BIN / "trainyard"), "run", "--run-id", run_id, "-S", f"train.epochs={epochs}"],
                cwd=project.root, env=env, check=True, capture_output=True,
            )  # fmt: skip
            wall = time.time() - started
            shown = subprocess.run(
                [str(BIN / "trainyard"), "runs", "show", run_id, "--json"],
                cwd=project.root, env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            record = json.loads(shown.stdout)
            first_step.setdefault(label, []).append(record["first_step_at"] - started)
            return wall

        return measure

    def raw() -> float:
        started = time.time()
        result = run_raw_script(
            project,
            WORKERS,
            ["--epochs", str(epochs), "--checkpoint", str(project.root / "raw.pt")],
        )
        first_step.setdefault("raw", []).append(result["first_step_at"] - started)
        return time.time() - started

    def ray_train() -> float:
        out = project.root / "ray.json"
        started = time.time()
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "ray_train.py"), "--data", str(project.processed),
             "--out", str(out), "--workers", str(WORKERS), "--epochs", str(epochs)],
            env=project.env(), check=True, capture_output=True,
        )  # fmt: skip
        first_step.setdefault("ray", []).append(
            json.loads(out.read_text())["first_step_at"] - started
        )
        return time.time() - started

    contenders = {
        "trainyard (temporary Prefect API)": trainyard(None, "trainyard (temporary Prefect API)")
    }
    with prefect_server(project) as api_url:
        contenders["trainyard (running Prefect server)"] = trainyard(
            api_url, "trainyard (running Prefect server)"
        )
        contenders["raw"] = raw
        if _has_ray():
            contenders["ray"] = ray_train
        measured = interleaved(reps, contenders)
    figures = {f"{name}, wall s": summary(values) for name, values in measured.items()}
    figures |= {
        f"{name}, time to first step s": summary(values) for name, values in first_step.items()
    }
    ratios = {
        f"{name} / raw, wall": ratio(values, measured["raw"])
        for name, values in measured.items()
        if name != "raw"
    }
    return {"figures": figures, "ratios": ratios}


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def prefect_server(project: BenchProject) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=project.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
