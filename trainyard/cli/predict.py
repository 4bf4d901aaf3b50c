"""`trainyard predict`: batch inference from the command line (the `batch_inference` flow)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainyard.cli.options import add_overrides
from trainyard.cli.session import run_flow
from trainyard.config import TrainyardConfig
from trainyard.project import ProjectPaths


def add_predict_command(commands: argparse._SubParsersAction) -> None:
    predict = commands.add_parser(
        "predict",
        help="score a file with a registered model or a run, across inference.workers "
        "processes (Prefect flow batch_inference): a CSV or Parquet table, an image array or "
        "folder, text for a language model, or what the model's data.dataset reads",
    )
    predict.add_argument(
        "--model",
        required=True,
        metavar="NAME[@ALIAS|:VERSION]",
        help="a registry model (NAME alone: NAME@champion; @ALIAS alone: registry.model_name) "
        "or run:RUN_ID, a completed run's final checkpoint",
    )
    predict.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="FILE",
        help="checked against what the model reads before anything is launched",
    )
    predict.add_argument(
        "--output",
        type=Path,
        metavar="LOCAL.parquet",
        help="also write every row in input order here: row, prediction, and prob_<class> "
        "per class; for text, one row per window with the next token and the window's loss",
    )
    predict.add_argument(
        "--prediction-id",
        help="default: derived from the model, the input's bytes and inference.shard_rows, so "
        "running the same command again continues or reuses the same output",
    )
    add_overrides(predict, "override a params.yaml value, e.g. -S inference.workers=1")


def cmd_predict(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.cli.terminal import prediction_progress
    from trainyard.inference.plan import output_target, plan_prediction, resolved_input
    from trainyard.inference.shards import committed_shards
    from trainyard.storage import connect

    output = None
    if args.output:  # the flow checks it again: a deployment or the API may start it too
        output = str(output_target(paths, args.output, "--output").relative_to(paths.root))
    input_file = resolved_input(paths, args.input)
    store = connect(config.storage, paths)
    # Everything checked before Prefect starts: a mistake is one line, nothing is written.
    job = plan_prediction(store, paths, config, args.model, input_file, args.prediction_id)
    print(f"prediction {job.prediction_id}", flush=True)

    def load():
        from flows.inference import batch_inference  # Prefect is imported only here
        from trainyard.runs.plan import settings_handed_over  # with the flow (start-up cost)

        def call():
            # The flow runs with the settings checked here; its parameters show the -S list.
            with settings_handed_over(config, args.overrides):
                return batch_inference(
                    model=args.model,
                    input=input_file,
                    output=output,
                    prediction_id=job.prediction_id,
                    overrides=args.overrides,
                )

        return call

    def committed() -> int:
        return len(committed_shards(store, job.prediction_id))

    record = run_flow(
        paths,
        load,
        interrupted=lambda: (
            f"trainyard: interrupted; prediction {job.prediction_id} keeps its committed "
            "shards; run the same command again to finish it"
        ),
        progress=lambda: prediction_progress(
            committed, job.num_shards, f"prediction {job.prediction_id}"
        ),
    )
    source = record.model
    print(
        f"prediction {record.prediction_id} completed: {record.rows} rows with {source.reference} "
        f"({record.world_size} workers, {record.rows_per_s or 0:,.0f} rows/s, "
        f"{record.shards_reused} of {record.shards} shards reused)\n"
        f"  output  {record.output}" + (f"\n  local   {paths.root / output}" if output else "")
    )
    return 0
