"""`training_pipeline`: check -> version the data -> `train_and_evaluate` (split, distributed
training, validation, the run record)."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from flows.settings import flow_settings
from flows.train_and_evaluate import train_and_evaluate
from tasks.data import version_dataset_task
from tasks.storage import check_store
from tasks.train import prestart_training_workers
from trainyard.runs.plan import plan_run
from trainyard.runs.record import RunRecord, check_run_id, new_run_id
from trainyard.runtime.guardian import announce_flow_run
from trainyard.runtime.persistent import persistent_workers


@flow(name="training_pipeline")
def training_pipeline(
    overrides: list[str] | None = None,
    run_id: str | None = None,
    resume_from: str | None = None,
    warm_start: bool = False,
) -> RunRecord:
    """Train on the project's dataset across `train.workers` processes and record the run.

    Settings: the project's params.yaml (the folder the flow runs in) with `overrides`,
    `section.key=value` as `trainyard run -S` takes them (`flows.settings`). `run_id`
    defaults to a new timestamped id. See `train_and_evaluate` for continuing a run id,
    `resume_from` and `warm_start`.
    """
    paths, config = flow_settings(overrides)
    run_id = check_run_id(run_id or new_run_id())
    # Fail before anything is launched or written to the store; `trainyard run` hands over
    # the plan it checked, a deployment's run checks here.
    plan_run(config, paths.root)
    if resume_from is not None:
        check_run_id(resume_from)
    check_store(config, paths)
    announce_flow_run(PREFECT_API_URL.value(), flow_run.get_id())
    with persistent_workers():
        # The workers start (Python, torch, the process group) while the data is versioned
        # and split: the largest part of a short run's time to its first step.
        prestart_training_workers(config, paths)
        dataset = version_dataset_task(config, paths)
        return train_and_evaluate(
            config=config,
            dataset=dataset,
            project_dir=str(paths.root),
            run_id=run_id,
            resume_from=resume_from,
            warm_start=warm_start,
        )
