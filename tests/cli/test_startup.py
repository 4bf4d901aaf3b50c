"""Time to first step: what a worker imports, Comet starting beside training without losing a
point, and a data version that the remote holds not being pushed again."""

import json
import subprocess
import sys
import textwrap

import pytest

from trainyard.config import load_config
from trainyard.data.tables import write_digits
from trainyard.project import ProjectPaths
from trainyard.storage import connect, versioning
from trainyard.storage.versioning import configure_remote, version_dataset


def _run_python(code: str, cwd) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_worker_imports_no_sklearn_pandas_comet_or_prefect(tmp_path):
    # What `python -m trainyard.engine.worker train` imports before its first step (Comet comes
    # later, on its own thread), in a fresh interpreter.
    shown = _run_python(
        """
        import sys
        import trainyard.engine.worker, trainyard.engine.jobs, trainyard.runtime.launch
        from torch.distributed.elastic.multiprocessing.errors import record
        heavy = ("sklearn", "pandas", "scipy", "pyarrow", "comet_ml", "prefect")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
        """,
        tmp_path,
    )
    assert shown.strip() == "[]"


def test_a_nodes_flow_run_imports_no_torch_until_it_must(tmp_path):
    # A node's flow run (flows.node, on every host of a multi-node run) launches torchrun and
    # watches it: torch (~2.5 s of CPU) would be paid on each host for nothing. It comes
    # only with a bundled example the host must write (tasks.node_share).
    shown = _run_python(
        """
        import sys
        import flows.node, tasks.node_share
        print("torch" in sys.modules)
        """,
        tmp_path,
    )
    assert shown.strip() == "False"


# Gates Comet's start until the test has logged, so those calls are certainly queued; then
# logs more while the queue is replayed. The same calls go to an experiment started the old
# way (synchronously); both archives must hold the same messages.
COMET_SCRIPT = """
    import json, sys, threading, zipfile
    from pathlib import Path
    from trainyard.engine import tracking
    from trainyard.config import TrackingConfig

    def calls(tracker, steps):
        for step in steps:
            tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)

    def content(archive):
        with zipfile.ZipFile(archive) as z:
            lines = z.read("messages.json").decode().splitlines()
        found = []
        for line in lines:
            message = json.loads(line)
            payload = message["payload"]
            for volatile in ("local_timestamp", "message_id"):
                payload.pop(volatile, None)
            found.append(json.dumps([message["type"], payload], sort_keys=True))
        return found

    gate, start = threading.Event(), tracking._start_experiment
    tracking._start_experiment = lambda *args: gate.wait() and start(*args)
    tracker = tracking.CometTracker(TrackingConfig(), "bg", 0, Path("bg").absolute())
    tracker.log_params({"epochs": 3, "model": "mlp"})
    calls(tracker, range(0, 40))
    queued = tracker._experiment is None
    gate.set()
    calls(tracker, range(40, 120))
    background = tracker.end()
    tracking._start_experiment = start

    Path("sync").mkdir()
    experiment, _ = start(TrackingConfig(), "bg", 0, Path("sync"))
    class Direct:
        def log_metrics(self, metrics, step):
            experiment.log_metrics(metrics, step=step)
    experiment.log_parameters({"epochs": 3, "model": "mlp"})
    calls(Direct(), range(0, 120))
    tracking._end_promptly(experiment)  # as CometTracker.end ends an offline experiment
    experiment.end()
    synchronous = next(Path("sync").glob("*.zip"))
    print(json.dumps({
        "queued": queued,
        "mode": background.mode,
        "archive": background.archive,
        "background": content(background.archive),
        "synchronous": content(synchronous),
    }))
"""


def test_comet_started_in_the_background_keeps_every_logged_point(tmp_path):
    shown = json.loads(_run_python(COMET_SCRIPT, tmp_path).splitlines()[-1])
    assert shown["queued"], "the first calls must have waited for Comet's start"
    assert shown["mode"] == "offline" and shown["archive"].startswith(str(tmp_path / "bg"))
    logged = [json.loads(m)[1]["metric"] for m in shown["background"] if "metric_msg" in m]
    points = [(m["metricName"], m["step"]) for m in logged if m["metricName"] in ("loss", "lr")]
    assert sorted(points) == sorted((name, s) for name in ("loss", "lr") for s in range(120))
    assert shown["background"] == shown["synchronous"]  # same messages, same order


def test_a_comet_that_cannot_start_fails_the_run_at_its_next_call(tmp_path):
    shown = _run_python(
        """
        from pathlib import Path
        from trainyard.engine import tracking
        from trainyard.config import TrackingConfig

        def broken(*args):
            raise ValueError("Comet.ml requires an API key")

        tracking._start_experiment = broken
        tracker = tracking.CometTracker(TrackingConfig(), "r", 0, Path("c"))
        tracker._starter.join()
        for call in (lambda: tracker.log_metrics({"loss": 1.0}, step=1), tracker.end):
            try:
                call()
            except ValueError as exc:
                print(exc)
        """,
        tmp_path,
    )
    assert shown.splitlines() == ["Comet.ml requires an API key"] * 2


@pytest.mark.slow
def test_a_version_the_remote_holds_is_not_pushed_again(project, monkeypatch):
    paths = ProjectPaths(project)
    config = load_config(paths.params)
    write_digits(project / config.data.path)
    store = connect(config.storage, paths)
    configure_remote(project, store)
    calls, real_dvc = [], versioning.dvc

    def counted_dvc(root, *args, **kwargs):
        calls.append(args[0])
        return real_dvc(root, *args, **kwargs)

    monkeypatch.setattr(versioning, "dvc", counted_dvc)

    version = version_dataset(project, config.data.path)
    assert calls == ["add", "push"]
    assert version_dataset(project, config.data.path) == version
    assert calls == ["add", "push"], "an unchanged version the remote holds: no dvc at all"

    pushed = f"dvc/files/md5/{version.dvc_md5[:2]}/{version.dvc_md5[2:]}"
    store.delete(pushed)  # the remote lost it: pushed again
    assert version_dataset(project, config.data.path) == version
    assert calls == ["add", "push", "push"]
    assert store.get_bytes(pushed) == (project / config.data.path).read_bytes()
