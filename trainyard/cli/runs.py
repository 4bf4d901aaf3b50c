"""`trainyard runs list | show | delete | unlock`: the recorded runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from trainyard.config import TrainyardConfig
from trainyard.errors import ConfigError
from trainyard.project import ProjectPaths
from trainyard.util.documents import Skipped, printable


def add_runs_commands(commands: argparse._SubParsersAction) -> None:
    runs = commands.add_parser("runs", help="list or show recorded runs")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_commands.add_parser("list", help="all runs, newest first")
    listing.add_argument("--json", action="store_true")
    show = runs_commands.add_parser("show", help="one run's record")
    show.add_argument("run_id")
    show.add_argument("--json", action="store_true")
    delete = runs_commands.add_parser(
        "delete", help="delete a run: its record, checkpoints, staging and Comet archives"
    )
    delete.add_argument("run_id")
    unlock = runs_commands.add_parser(
        "unlock",
        help="break a run's lease when its owner is gone for good: says whose it is; "
        "--yes breaks it",
    )
    unlock.add_argument("run_id")
    unlock.add_argument("--yes", action="store_true", help="break the lease")


def cmd_runs(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import check_run_id, delete_run, load_record, shown_status
    from trainyard.storage import connect

    store = connect(config.storage, paths)
    if args.runs_command == "unlock":
        # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
        from trainyard.runs.lease import unlock

        print(unlock(store, check_run_id(args.run_id), args.yes))
        return 0
    if args.runs_command == "delete":
        run_id = check_run_id(args.run_id)
        local = [paths.staging / run_id, paths.comet / run_id]
        freed = delete_run(store, local, run_id)
        print(
            f"deleted run {run_id}: {freed.objects} objects ({freed.store_bytes / 1e6:.1f} MB) "
            f"from {store.uri('runs/' + run_id)}, {freed.local_bytes / 1e6:.1f} MB of local files"
        )
        return 0
    if args.runs_command == "show":
        record = load_record(store, args.run_id)
        status, heartbeat = shown_status(store, record)
        if status == "running":
            record = _so_far(record, paths.staging / record.run_id)
        if args.json:
            shown = record.model_dump(mode="json") | {"status": status}
            print(
                json.dumps(shown | ({"last_heartbeat": heartbeat} if heartbeat else {}), indent=2)
            )
        else:
            _print_record(record, _status_text(status, heartbeat), _checkpoint(store, record))
        return 0
    return _list_runs(store, args.json, paths.run_summaries)


def _list_runs(store, as_json: bool, cache: Path) -> int:
    """A summary per run (`runs show` has the rest); a damaged record is one warning."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import list_summaries

    skipped = Skipped()
    summaries = list_summaries(store, skipped, cache)
    for line in skipped.lines():
        print(f"trainyard: warning: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in summaries], indent=2))
        return 0
    print(f"{'RUN ID':<26} {'STATUS':<11} {'WORKERS':>7} {'TEST MONITOR':>16}  CREATED")
    for s in summaries:
        m = s.monitor
        score = f"{m['name']} {m['value']:.4f}" if m and m["value"] is not None else "-"
        line = f"{s.run_id:<26} {s.status:<11} {s.world_size or '-':>7} {score:>16}  {s.created_at}"
        print(printable(line))
    return 0


def _so_far(record, folder: Path):
    """A running run's record, with what node 0's machine knows of it so far (the record
    gets it when training ends): its rounds of workers (hosts.json) and its resumes
    (progress.json). Elsewhere `folder` is empty and the record is as stored."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.machines import machines_seen
    from trainyard.runtime.progress import recorded_resumes

    nodes, rounds, changes = machines_seen(folder, None)
    update: dict[str, Any] = {}
    if rounds:
        update = {"nodes": nodes, "rank_hosts": rounds, "host_changes": changes}
        update["world_size"] = record.world_size or len(rounds[-1].hosts)
    record = record.model_copy(update=update)
    if resumes := recorded_resumes(folder):
        record.take_launch_resumes(resumes)
    return record


def _status_text(status: str, heartbeat: str | None) -> str:
    if status != "crashed":
        return status
    return f"crashed (owner gone; last heartbeat {heartbeat or 'never'})"


def _checkpoint(store, record) -> str:
    """The run's final checkpoint; before it has one (running, interrupted, crashed), its
    latest commit so far (a resume starts from the latest that verifies)."""
    if record.final_checkpoint:
        return record.final_checkpoint
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.checkpoint.layout import newest_committed

    newest = newest_committed(store, record.run_id)
    return f"{newest} (latest commit so far)" if newest else "-"


def _print_record(record, status: str, checkpoint: str) -> None:
    dataset = record.dataset
    rows = [
        ("run", f"{record.run_id}  {status}  created {record.created_at}"),
        (
            "dataset",
            f"{dataset.path} md5 {dataset.dvc_md5} ({dataset.rows} rows)" if dataset else "-",
        ),
        (
            "code",
            f"{record.code.get('git_commit') or '-'}{' (dirty)' if record.code.get('git_dirty') else ''}",
        ),
        (
            "workers",
            _workers(record) + _layout(record.layout),
        ),
        ("metrics", "  ".join(f"{k} {v:.4g}" for k, v in sorted(record.metrics.items())) or "-"),
        ("timings", "  ".join(f"{k} {v:.1f}s" for k, v in record.timings_s.items()) or "-"),
        ("checkpoint", checkpoint),
        ("resumed", _resumed(record)),
        ("restarts", _restarts(record)),
        ("comet", _tracking(record)),
        ("sync", _sync(record)),
    ]
    rows += _machines(record)
    if record.error:
        rows.append(("error", record.error.splitlines()[0]))
    if record.error_file:
        rows.append(("traceback", record.error_file))
    for label, value in rows:
        print(f"{label:<11} {printable(value)}")  # a record's text never drives the terminal


def _sync(record) -> str:
    """How the replicas agreed and what it cost the busiest rank: `diloco every 16: 12
    syncs, 8.6 MB sent, 1.2 s waiting (the most of any rank)`."""
    try:
        train = record.config.train
    except ConfigError:  # an old record's params that are no longer valid settings
        return "-"
    shown = {
        "allreduce": train.sync,
        "parameter_server": f"{train.sync} ({max(train.parameter_servers, 1)} server(s), "
        f"max_staleness {train.max_staleness})",
    }.get(train.sync, f"{train.sync} every {train.sync_every}")
    sent = record.communication
    if sent is None:
        return shown
    syncs = "pushes each" if train.sync == "parameter_server" else "syncs"
    text = (
        f"{shown}: {sent.syncs} {syncs}, {max(sent.bytes_sent_per_rank) / 1e6:.1f} MB sent, "
        f"{max(sent.wait_s_per_rank):.1f} s waiting (the most of any rank)"
    )
    if sent.staleness:
        text += "; staleness " + ", ".join(f"{k}: {n}" for k, n in sent.staleness.items())
    if sent.checkpoint_bytes_per_rank:
        text += (
            f"; checkpoints gathered {max(sent.checkpoint_bytes_per_rank) / 1e6:.1f} MB in "
            f"{max(sent.checkpoint_wait_s_per_rank or [0.0]):.1f} s"
        )
    resumed = [entry["from_step"] for entry in record.resumes if "from_step" in entry]
    if resumed:  # each launch counts its own: the figures are the last one's
        text += f" (since the last resume, at step {resumed[-1]})"
    return text


def _tracking(record) -> str:
    """Each rank's Comet experiment (`rank0:offline:KEY`); `-` where tracking was off."""
    tracked = [e for e in record.tracking if e.mode != "none"]
    return "  ".join(f"rank{e.rank}:{e.mode}:{e.key}" for e in tracked) or "-"


def _workers(record) -> str:
    """`2 on cpu (gloo)`; while it trains, the workers of its latest round so far; where
    training never reported (it failed, was cancelled, or has not begun), what was asked."""
    if record.device is None and record.world_size:
        return f"{record.world_size} (the latest round's; device known when training ends)"
    if record.device is None:
        try:
            train = record.config.train
        except ConfigError:  # an old record's params that are no longer valid settings
            return "- (none reported: training did not end)"
        asked = f"asked for {train.workers} per node on {train.nnodes} node(s)"
        return f"- ({asked}; none reported: training did not end)"
    return f"{record.world_size or '-'} on {record.device or '-'} ({record.backend or '-'})"


def _machines(record) -> list[tuple[str, str]]:
    """One line per node's stay on a host, then one per rank that changed host."""
    rows = [
        (
            "node",
            f"{node.node_rank} on {node.host}: {node.workers} worker{'s' * (node.workers != 1)}, "
            f"{node.started_at} to {node.ended_at or '-'}",
        )
        for node in record.nodes
    ]
    for change in record.host_changes:
        moved = f"{change.before or '(none)'} -> {change.after or '(none)'}"
        rows.append(("host moved", f"rank {change.rank}: {moved} at {change.at}"))
    return rows


def _resumed(record) -> str:
    """Another run's checkpoint it started from, then each time it resumed its own:
    `from s3://.../step-00000040; at step 40 (agent lost)`."""
    parts = []
    if record.resume_checkpoint:
        weights = " (weights only)" if record.warm_start else ""
        parts.append(f"from {record.resume_checkpoint}{weights}")
    for event in record.resumes:
        if "from_step" in event:
            after = f" ({event['after']})" if event.get("after") else ""
            parts.append(f"at step {event['from_step']}{after}")
    return "; ".join(parts) or "-"


def _restarts(record) -> str:
    """`2: 1 agent lost, 1 worker failed (14 steps redone)`: the kinds the resumes name."""
    kinds = Counter(event["after"] for event in record.resumes if event.get("after"))
    why = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    # torchrun counts no restart for a node that joined or left: the resumes do.
    count = max(record.restarts, kinds.total())
    return f"{count}{': ' + why if why else ''} ({record.steps_redone} steps redone)"


def _layout(layout: dict[str, int]) -> str:
    """`, 2 replica(s) x tensor 2` where a replica of the model spans several workers."""
    split = {k: v for k, v in layout.items() if k != "data" and v > 1}
    if not split:
        return ""
    parts = " x ".join(f"{name} {degree}" for name, degree in split.items())
    return f", {layout.get('data', 1)} replica(s) x {parts}"
