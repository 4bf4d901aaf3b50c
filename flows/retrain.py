"""`retrain`: a new dataset version -> a challenger run (from fresh weights, or warm-started
from the champion's with `retrain.init: champion`) -> both it and the champion scored on the
same held-out test split -> the challenger promoted only if it is better.

On the champion's own dataset version it stops at once (the skip is recorded). Every
decision is a Prefect markdown artifact, a record in the registry (`retrains/`), and, when
an alias moves, an entry in the registry's history with the two values and the rule."""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from flows.settings import flow_settings
from flows.train_and_evaluate import train_and_evaluate
from tasks.data import split_dataset_task, version_dataset_task
from tasks.storage import check_store, open_store
from tasks.train import evaluate_task
from trainyard.checkpoint.resume import ResumePlan, plan_warm_start, warm_start_meta
from trainyard.config import TrainyardConfig
from trainyard.data.split import SplitSchema
from trainyard.project import ProjectPaths
from trainyard.registry import Evidence, VersionInfo, promote, read_aliases, read_version, register
from trainyard.registry import version_uri as registry_uri
from trainyard.registry.retraining import (
    RetrainDecision,
    challenger_start,
    decide,
    decision_markdown,
    save_decision,
)
from trainyard.runs.plan import plan_run
from trainyard.runs.record import RunRecord, now
from trainyard.storage.versioning import DatasetVersion


@flow(name="retrain")
def retrain(overrides: list[str] | None = None) -> RetrainDecision:
    """Retrain `registry.model_name` on the project's dataset as it is now: the folder the
    flow runs in, its params.yaml with `overrides` (`section.key=value`, as `-S`)."""
    paths, config = flow_settings(overrides)
    plan_run(config, paths.root)
    check_store(config, paths)
    dataset = version_dataset_task(config, paths)
    champion = champion_task(config, paths)
    base = _decision_base(config, dataset, champion)
    if champion is not None and champion.dataset_md5 == dataset.dvc_md5:
        reason = (
            f"{dataset.path} is still DVC md5 {dataset.dvc_md5}, the version champion "
            f"{champion.version} was trained on: nothing new to learn"
        )
        return publish_task(
            config, paths, base.model_copy(update={"action": "skipped", "reason": reason})
        )
    start = _challenger_start(config, paths, dataset, champion)
    run = train_and_evaluate(
        config=config,
        dataset=dataset,
        project_dir=str(paths.root),
        warm_start_from=start.checkpoint if start else None,
        group=f"retrain:{config.registry.model_name}",  # its challengers, side by side
    )
    challenger = register_task(config, paths, run)
    monitor = run.monitor
    assert monitor is not None, "a completed run records its monitored metric"
    champion_value = None
    if champion is not None:  # scored on the challenger's test split: the same rows
        uri = registry_uri(open_store(config, paths), champion.name, champion.version)
        scored = evaluate_task(run.run_id, uri, config, paths)
        champion_value = scored.metrics[monitor["name"]]
    metric, mode, value = f"test_{monitor['name']}", monitor["mode"], monitor["value"]
    promoted, reason = decide(value, champion_value, metric, mode, config.promote)
    decision = base.model_copy(
        update={
            "action": "promoted" if promoted else "kept",
            "reason": reason,
            "run_id": run.run_id,
            "challenger_version": challenger.version,
            "metric": metric,
            "mode": mode,
            "challenger_value": value,
            "champion_value": champion_value,
            "warm_start_version": champion.version if champion and run.warm_start else None,
            "warm_start_checkpoint": run.resume_checkpoint if run.warm_start else None,
        }
    )
    if promoted:
        promote_task(config, paths, decision)
    return publish_task(config, paths, decision)


def _by() -> str:
    return f"flow-run:{flow_run.get_id()}"


def _decision_base(
    config: TrainyardConfig, dataset: DatasetVersion, champion: VersionInfo | None
) -> RetrainDecision:
    return RetrainDecision(
        model=config.registry.model_name,
        action="skipped",
        reason="",
        at=now(),
        by=_by(),
        dataset_path=dataset.path,
        dataset_md5=dataset.dvc_md5,
        champion_version=champion.version if champion else None,
        min_delta=config.promote.min_delta,
        min_value=config.promote.min_value,
        init=config.retrain.init,
    )


def _challenger_start(
    config: TrainyardConfig,
    paths: ProjectPaths,
    dataset: DatasetVersion,
    champion: VersionInfo | None,
) -> ResumePlan | None:
    """The champion version's weights for the challenger with `retrain.init: champion`, checked
    against the new data's split before a run is recorded; None: fresh weights (also when
    there is no champion yet)."""
    if config.retrain.init != "champion" or champion is None:
        return None
    # The split is content-addressed: the challenger's run reuses this one.
    split = split_dataset_task(config, paths, dataset.dvc_md5)
    return warm_start_task(config, paths, champion, split.schema, dataset.dvc_md5)


@task(name="read-champion")
def champion_task(config: TrainyardConfig, paths: ProjectPaths) -> VersionInfo | None:
    store, name = open_store(config, paths), config.registry.model_name
    version = read_aliases(store, name).get("champion")
    return read_version(store, name, version) if version is not None else None


@task(name="plan-warm-start")
def warm_start_task(
    config: TrainyardConfig,
    paths: ProjectPaths,
    champion: VersionInfo,
    schema: SplitSchema,
    dataset_md5: str,
) -> ResumePlan:
    """The champion's checkpoint, if its model fits this data (another dataset version is
    fine: that is the point); otherwise one line saying what differs."""
    store = open_store(config, paths)
    plan = plan_warm_start(
        store,
        registry_uri(store, champion.name, champion.version),
        warm_start_meta(config, schema, dataset_md5),
        source=f"champion version {champion.version} of {champion.name} (run {champion.run_id})",
        fix="set retrain.init: scratch to train the challenger from fresh weights",
    )
    get_run_logger().info(
        "the challenger starts from the weights of champion version %d (%s)",
        champion.version,
        plan.checkpoint,
    )
    return plan


@task(name="register-challenger")
def register_task(config: TrainyardConfig, paths: ProjectPaths, run: RunRecord) -> VersionInfo:
    """The challenger's run as the model's next version, with the alias `challenger`."""
    store, name = open_store(config, paths), config.registry.model_name
    info = register(store, run.run_id, name, by=_by(), tracking=config.tracking)
    assert run.monitor is not None, "a completed run records its monitored metric"
    evidence = Evidence(
        rule="retrain: newest challenger",
        metric=run.monitor["name"],
        mode=run.monitor["mode"],
        to_value=run.monitor["value"],
    )
    promote(store, name, info.version, "challenger", by=_by(), evidence=evidence)
    return info


@task(name="promote-challenger")
def promote_task(config: TrainyardConfig, paths: ProjectPaths, decision: RetrainDecision) -> None:
    evidence = Evidence(
        rule=f"retrain: {decision.reason}",
        metric=decision.metric,
        mode=decision.mode,
        from_value=decision.champion_value,
        to_value=decision.challenger_value,
        detail={
            "min_delta": decision.min_delta,
            "min_value": decision.min_value,
            "dataset_md5": decision.dataset_md5,
            "run_id": decision.run_id,
        },
    )
    store = open_store(config, paths)
    assert decision.challenger_version is not None, "a promotion names the challenger's version"
    promote(
        store, decision.model, decision.challenger_version, "champion", by=_by(), evidence=evidence
    )


@task(name="record-retrain-decision")
def publish_task(
    config: TrainyardConfig, paths: ProjectPaths, decision: RetrainDecision
) -> RetrainDecision:
    save_decision(open_store(config, paths), decision)
    create_markdown_artifact(
        key=f"retrain-{decision.model}".lower(), markdown=decision_markdown(decision)
    )
    get_run_logger().info(
        "retrain %s: %s (%s); challenger: %s",
        decision.model,
        decision.action,
        decision.reason,
        challenger_start(decision),
    )
    return decision
