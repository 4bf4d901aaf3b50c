"""Retraining's decision: whether a challenger replaces the champion, and its record,
`registry/<model>/retrains/<at>-<what>.json` in the store (skips included), which the
flow `retrain` also publishes as a Prefect artifact. No Prefect here."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel

from trainyard.config import PromoteConfig
from trainyard.storage import Store


class RetrainDecision(BaseModel):
    model: str
    action: Literal["skipped", "promoted", "kept"]
    reason: str
    at: str
    by: str
    dataset_path: str
    dataset_md5: str
    run_id: str | None = None  # the challenger's run
    challenger_version: int | None = None
    champion_version: int | None = None  # the champion before this retrain
    metric: str | None = None  # test_<monitored metric>, both scored on the same test split
    mode: str | None = None  # "max" | "min"
    challenger_value: float | None = None
    champion_value: float | None = None
    min_delta: float | None = None
    min_value: float | None = None
    init: str | None = None  # retrain.init: "scratch" | "champion" (None in older records)
    # The champion version whose weights the challenger started from, and its checkpoint;
    # None: fresh weights (init scratch, or no champion yet).
    warm_start_version: int | None = None
    warm_start_checkpoint: str | None = None


def decide(
    challenger: float, champion: float | None, metric: str, mode: str, rules: PromoteConfig
) -> tuple[bool, str]:
    """(promote?, why): the challenger must clear `min_value`, then beat the champion by more
    than `min_delta` in the metric's direction. With no champion, the floor alone decides."""
    sign = 1.0 if mode == "max" else -1.0
    if rules.min_value is not None and sign * (challenger - rules.min_value) < 0:
        bound = "floor" if mode == "max" else "ceiling"
        return False, (
            f"the challenger's {metric} {challenger:.4f} misses the promote.min_value "
            f"{bound} {rules.min_value:g}"
        )
    if champion is None:
        return True, f"no champion yet, and the challenger's {metric} is {challenger:.4f}"
    gain = sign * (challenger - champion)
    verdict = "beats" if gain > rules.min_delta else "does not beat"
    return gain > rules.min_delta, (
        f"the challenger's {metric} {challenger:.4f} {verdict} the champion's {champion:.4f} "
        f"on the same test split by more than promote.min_delta {rules.min_delta:g} "
        f"({'+' if gain >= 0 else ''}{gain:.4f})"
    )


def save_decision(store: Store, decision: RetrainDecision) -> str:
    stamp = dt.datetime.fromisoformat(decision.at).strftime("%Y%m%dT%H%M%S")
    key = f"registry/{decision.model}/retrains/{stamp}-{decision.run_id or 'skip'}.json"
    return store.write_json(key, decision.model_dump(mode="json"))


def list_decisions(store: Store, model: str) -> list[RetrainDecision]:
    prefix = f"registry/{model}/retrains"
    keys = sorted(store.list_files(prefix))
    return [RetrainDecision.model_validate(store.read_json(k)) for k in keys]


def challenger_start(d: RetrainDecision) -> str:
    """Where the challenger's weights came from, in words."""
    if d.run_id is None:
        return "-"
    if d.warm_start_version is not None:
        return (
            f"warm start from champion version {d.warm_start_version} "
            f"({d.warm_start_checkpoint}): its weights, a new optimizer and schedule"
        )
    if d.init == "champion":
        return "fresh weights: retrain.init is champion, but there was no champion yet"
    return "fresh weights (retrain.init: scratch)"


def decision_markdown(d: RetrainDecision) -> str:
    rows = [
        ("action", d.action),
        ("why", d.reason),
        ("dataset", f"{d.dataset_path} (DVC md5 {d.dataset_md5})"),
        ("challenger", f"run {d.run_id}, version {d.challenger_version}" if d.run_id else "-"),
        ("champion before", f"version {d.champion_version}" if d.champion_version else "none"),
        ("challenger start", challenger_start(d)),
        ("metric", f"{d.metric} ({d.mode})" if d.metric else "-"),
        ("values", f"challenger {d.challenger_value}, champion {d.champion_value}"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"# Retrain `{d.model}`: {d.action}\n\n| | |\n|---|---|\n{table}\n"
