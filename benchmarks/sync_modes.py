"""16. Sync modes: replicas that all-reduce every update against replicas that agree every
few (train.sync local_sgd and diloco) and against an asynchronous parameter server (each
host holds half the parameters, train.parameter_servers 2), on two hosts joined by a slow
link.

Two hosts (network namespaces, tests/hosts.py) x 1 worker; host B's link shaped both ways
with `tc tbf` to each rate (netem is not available here, so the link has a rate and no added
delay). Each model trains under every mode with the same data, seed and epochs; sync_every
is EVERY, and at the slowest rate LONG_EVERY too. Per arm: the training seconds to the target validation loss (the allreduce arm's
final one, plus 1%; "not reached" where the arm never got there), the bytes each rank handed
to the syncs (the record's `communication` entry) and the final validation loss. Ratios:
each mode's time and bytes over allreduce's at the same rate.

The hosts share this machine's cores: the ratios show what the link costs, not what a second
machine's cores would add. Needs root and `ip netns`, and many minutes (the allreduce arm at
20 Mbit/s all-reduces every gradient through it): run it by name, `python -m benchmarks.run
--only sync_modes`; quick mode trains smaller models for fewer epochs on two rates.
TRAINYARD_BENCH_SYNC_MODES (comma-separated, allreduce always kept as the baseline) runs
fewer modes, e.g. `allreduce,parameter_server`; TRAINYARD_BENCH_SYNC_MODELS other models
(MODEL_NAMES), e.g. `mlp10m` with `allreduce,local_sgd,diloco` (a parameter server's
pushes and replies one after the other would outlast a run's deadline at 20 Mbit/s).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import summary
from benchmarks.nodes import Cluster, hosts_env, hosts_project, hosts_unavailable, namespace_hosts

MODES = ("allreduce", "local_sgd", "diloco", "parameter_server")
LOCAL_MODES = ("local_sgd", "diloco")  # the modes sync_every spaces out
# Each host holds half the parameters, so each pushes and pulls half over the link.
MODE_SETTINGS = {"parameter_server": ["train.parameter_servers=2"]}
EVERY = 16  # updates between syncs: 1/16 of the syncs, each of weights instead of gradients
# At the slowest rate the local modes also run with syncs this far apart: 1/20 of the bytes,
# the goal, needs sync_every 20 or more.
LONG_EVERY = 32
CORPUS = "data/raw/sync-corpus.txt"
CORPUS_BYTES = 120_000


# TRAINYARD_BENCH_SYNC_MODELS names the models to run (comma-separated), by these names.
MODEL_NAMES = {
    "mlp": "mlp 1024x1024",
    "transformer": "char transformer 2x64",
    "mlp10m": "mlp 3136x3136",
}
DEFAULT_MODELS = "mlp,transformer"


def _models(quick: bool) -> dict[str, list[str]]:
    """Each model's settings: an MLP on digits (1.1M parameters, 4.5 MB of gradients a step),
    the char transformer on the bundled standard-library text, and, named only, the issue's
    ~10M-parameter MLP (64-3136-3136-10: 39 MB of gradients a step, 16 s all-reduced through
    20 Mbit/s), for two epochs (44 updates) where the others train the run's epochs: six
    took over the 15 minutes a run is given at 20 Mbit/s on this machine."""
    width, wide = 1024, 3136
    settings = {
        f"mlp {width}x{width}": [f"model.options={{hidden_sizes: [{width}, {width}]}}"],
        "char transformer 2x64": [
            "task.name=language_model",
            f"data.path={CORPUS}",
            "data.context=32",
            "model.name=transformer",
            "model.options={layers: 2, heads: 4, width: 64}",
            "train.optimizer=adamw",
            "train.lr=0.003",
            "train.weight_decay=0.01",
            "train.warmup_epochs=0.05",
        ],
        f"mlp {wide}x{wide}": [
            f"model.options={{hidden_sizes: [{wide}, {wide}]}}",
            "train.epochs=2",
        ],
    }
    named = os.environ.get("TRAINYARD_BENCH_SYNC_MODELS", DEFAULT_MODELS).split(",")
    unknown = set(named) - set(MODEL_NAMES)
    if unknown:
        raise SystemExit(
            f"TRAINYARD_BENCH_SYNC_MODELS: unknown {sorted(unknown)}; from {sorted(MODEL_NAMES)}"
        )
    return {MODEL_NAMES[name]: settings[MODEL_NAMES[name]] for name in named}


def run(project: object, quick: bool) -> dict:
    """`project` is unused: the hosts need a project of their own, copied to each."""
    missing = hosts_unavailable()
    if missing:
        return {"figures": {}, "ratios": {}, "skipped": missing}
    epochs, rates = (2, ("100mbit", "20mbit")) if quick else (6, ("1gbit", "100mbit", "20mbit"))
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-sync-") as tmp:
        root = hosts_project(Path(tmp) / "project")
        _write_corpus(root)
        with namespace_hosts().hosts(
            2, own_copy=root, shared=(), workdir=Path(tmp) / "copies"
        ) as net:
            cluster = Cluster(net, root, hosts_env(Path(tmp)), epochs)
            cluster.start_store()
            try:
                return _measure(cluster, _models(quick), rates, _modes())
            finally:
                cluster.stop_store()


def _write_corpus(root: Path) -> None:
    from trainyard.datasets.tokens import build_stdlib_corpus

    build_stdlib_corpus(root / CORPUS, CORPUS_BYTES)


def _modes() -> tuple[str, ...]:
    named = os.environ.get("TRAINYARD_BENCH_SYNC_MODES", ",".join(MODES)).split(",")
    unknown = set(named) - set(MODES)
    if unknown:
        raise SystemExit(f"TRAINYARD_BENCH_SYNC_MODES: unknown {sorted(unknown)}; from {MODES}")
    return tuple(mode for mode in MODES if mode == "allreduce" or mode in named)


def _measure(
    cluster: Cluster, models: dict[str, list[str]], rates: tuple[str, ...], modes: tuple[str, ...]
) -> dict:
    """Every mode once per model and rate (each arm is minutes; the ratios are large)."""
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    not_reached: list[str] = []
    staleness: dict[str, dict[str, int]] = {}
    for model, settings in models.items():
        for rate in rates:
            arms = {mode: _arm(cluster, rate, settings, mode, EVERY) for mode in modes}
            if rate == rates[-1]:
                arms.update(
                    (f"{mode} every {LONG_EVERY}", _arm(cluster, rate, settings, mode, LONG_EVERY))
                    for mode in modes
                    if mode in LOCAL_MODES
                )
            target = arms["allreduce"]["final val loss"] * 1.01
            for mode, arm in arms.items():
                label = f"{model}, {rate}, {mode}"
                if pushes := arm.pop("pushes by staleness", None):
                    staleness[label] = pushes
                reached = _seconds_to(arm.pop("curve"), target)
                if reached is None:
                    not_reached.append(label)
                else:
                    arm["s to target"] = reached
                figures.update({f"{label}, {k}": summary([v]) for k, v in arm.items()})
            base = arms["allreduce"]
            for mode in list(arms)[1:]:
                arm, name = arms[mode], f"{model}, {rate}, {mode} / allreduce"
                ratios[f"{name}, bytes per rank"] = arm["bytes per rank"] / base["bytes per rank"]
                if "s to target" in arm:
                    ratios[f"{name}, s to target"] = arm["s to target"] / base["s to target"]
    result: dict[str, Any] = {
        "figures": figures,
        "ratios": ratios,
        "sync_every": EVERY,
        "long_sync_every": LONG_EVERY,
        "pushes_by_staleness": staleness,
    }
    if not_reached:
        result["left_out"] = "s to target of " + "; ".join(not_reached) + " (never reached)"
    return result


def _arm(cluster: Cluster, rate: str, settings: list[str], mode: str, every: int) -> dict[str, Any]:
    extra = [*settings, *MODE_SETTINGS.get(mode, []), f"train.sync={mode}"]
    cluster.slow_two_hosts(rate, *extra, f"train.sync_every={every}")
    record = cluster.record(cluster.last_run_id)
    history = record["history"]
    communication = record["communication"]
    elapsed, curve = 0.0, []
    for row in history:  # training and validation seconds of each epoch, cumulated
        elapsed += row["epoch_s"]
        curve.append((elapsed, row["val_loss"]))
    arm = {
        "curve": curve,
        "final val loss": history[-1]["val_loss"],
        "training s": elapsed,
        "bytes per rank": max(communication["bytes_sent_per_rank"]),
        "wait s per rank": max(communication["wait_s_per_rank"]),
        "syncs": communication["syncs"],
        # each worker's own state, gathered at every checkpoint (none under allreduce)
        "checkpoint bytes per rank": max(communication.get("checkpoint_bytes_per_rank") or [0]),
    }
    if communication.get("staleness"):  # the parameter server's pushes by staleness
        arm["pushes by staleness"] = communication["staleness"]
    return arm


def _seconds_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first epoch's end at which the validation loss was at or below `target`."""
    return next((seconds for seconds, loss in curve if loss <= target), None)
