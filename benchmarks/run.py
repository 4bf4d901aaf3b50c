"""Run the benchmarks, write benchmarks/results/<date>-<host>-<commit>.json, print a markdown table.

python -m benchmarks.run [--quick] [--only throughput,loop,lm_throughput,scaling,data_wait,end_to_end,sweep,inference,report,images,pipeline_bubble,layouts,parameter_server,nodes,host_loss,sync_modes,worker_start]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import bench_project, bench_store, machine

BENCHMARKS = (
    "throughput",
    "loop",
    "lm_throughput",
    "scaling",
    "checkpoint_cost",
    "recovery",
    "data_wait",
    "end_to_end",
    "sweep",
    "inference",
    "report",
    "images",
    "pipeline_bubble",
    "layouts",
)
# Only where CUDA is present (and it needs no store, so it can run on a bare GPU machine).
GPU_BENCHMARKS = ("gpu", "lm_gpu")
# Need a store but no project (DVC, Prefect, the digits split): they run on such a machine too.
STORE_BENCHMARKS = ("checkpoint_cost",)
# Only when named in --only: hosts as network namespaces need root, and minutes (and the
# parameter server's six arms take minutes too); worker_start measures against a launch
# trainyard no longer makes.
NAMED_ONLY_BENCHMARKS = ("nodes", "host_loss", "sync_modes", "parameter_server", "worker_start")
# Need neither: their data is generated in a temporary folder (nodes makes its own project).
LOCAL_BENCHMARKS = ("images", "pipeline_bubble", "nodes", "host_loss", "sync_modes")
RESULTS = Path(__file__).parent / "results"


def _context(selected: list[str]) -> contextlib.AbstractContextManager:
    """The least the selected benchmarks need: a project, a store alone, or nothing."""
    if any(name not in GPU_BENCHMARKS + STORE_BENCHMARKS + LOCAL_BENCHMARKS for name in selected):
        return bench_project()
    if any(name in STORE_BENCHMARKS for name in selected):
        return bench_store()
    return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.run")
    parser.add_argument(
        "--quick", action="store_true", help="each benchmark in under a minute (smoke test)"
    )
    default = BENCHMARKS + (GPU_BENCHMARKS if torch.cuda.is_available() else ())
    parser.add_argument("--only", default=",".join(default), help="comma-separated subset")
    parser.add_argument(
        "--out",
        type=Path,
        help="results file (default: benchmarks/results/<date>-<host>-<commit>.json)",
    )
    args = parser.parse_args(argv)
    selected = [name.strip() for name in args.only.split(",") if name.strip()]
    known = BENCHMARKS + GPU_BENCHMARKS + NAMED_ONLY_BENCHMARKS
    unknown = set(selected) - set(known)
    if unknown:
        parser.error(
            f"unknown benchmark(s) {', '.join(sorted(unknown))}; choose from {', '.join(known)}"
        )
    logging.basicConfig(level=logging.WARNING)

    report = {
        "machine": machine(),
        "quick": args.quick,
        "date": dt.date.today().isoformat(),
        "commit": _commit(),
        "benchmarks": {},
    }
    with _context(selected) as project:
        for name in selected:
            started = time.monotonic()
            print(f"running {name} ...", file=sys.stderr, flush=True)
            result = importlib.import_module(f"benchmarks.{name}").run(project, args.quick)
            result["seconds"] = round(time.monotonic() - started, 1)
            report["benchmarks"][name] = result
    name = f"{report['date']}-{report['machine']['host']}-{report['commit']}.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwritten to {out}", file=sys.stderr)
    return 0


def _commit() -> str:
    """The measured code's short commit, `-dirty` when the tree has changes beside it."""
    repo = Path(__file__).parent
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    )
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo).returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def markdown(report: dict) -> str:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        f"# trainyard benchmarks, {report['date']}{' (quick mode)' if report['quick'] else ''}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}. {versions}.",
        "Figures are medians of interleaved repetitions (min-max, n).",
    ]
    for name, result in report["benchmarks"].items():
        lines += [
            "",
            f"## {name} ({result['seconds']} s)",
            "",
            "| figure | median | min - max | n |",
            "|---|---|---|---|",
        ]
        if result.get("skipped"):
            lines.append(f"skipped: {result['skipped']}")
        for figure, s in result["figures"].items():
            lines.append(
                f"| {figure} | {s['median']:.4g} | {s['min']:.4g} - {s['max']:.4g} | {s['n']} |"
            )
        if result["ratios"]:
            lines += ["", "| ratio | value |", "|---|---|"]
            lines += [f"| {label} | {value:.3f} |" for label, value in result["ratios"].items()]
        if result.get("left_out"):
            lines += ["", f"Left out: {result['left_out']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
