"""The torchrun worker entry point: parse, build, run, clean up. The loop lives elsewhere.

torchrun --standalone --nproc_per_node=2 -m trainyard.worker train --run-id ID --project-dir DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from trainyard.config import config_from_dict
from trainyard.dist import cleanup_distributed, init_distributed
from trainyard.guardian import exit_with_parent
from trainyard.jobs import evaluate_job, train_job
from trainyard.logs import setup_logging
from trainyard.project import ProjectPaths
from trainyard.runs import check_run_id, load_record
from trainyard.storage import Store, StoreSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainyard.worker")
    parser.add_argument("command", choices=["train", "evaluate"])
    parser.add_argument("--run-id", required=True, type=check_run_id)
    parser.add_argument("--project-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="evaluate: checkpoint URI")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    return parser.parse_args(argv)


@record  # writes this rank's traceback to torchrun's error file, so the launcher can show it
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_with_parent()  # no worker outlives its torchrun, even a SIGKILLed one
    setup_logging(int(os.environ.get("RANK", 0)))
    store = Store(StoreSettings.from_worker_env())
    run = load_record(store, args.run_id)
    config = config_from_dict(run.params)
    paths = ProjectPaths(args.project_dir.resolve())
    ctx = init_distributed(config.train.device, timeout_s=config.train.hang_timeout_s)
    try:
        if args.command == "train":
            train_job(ctx, store, run, paths)
        else:
            evaluate_job(ctx, store, run, paths, args.checkpoint, args.split)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
