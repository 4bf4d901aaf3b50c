"""What a training job hands back when its loop ends: every rank's experiment learns the
test scores, checkpoints and stragglers; rank 0 writes the TrainingResult (and the final
checkpoint's in-job evaluation) to the store, where the flow reads them."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from typing import Any

from trainyard.checkpoint.layout import checkpoint_key, step_of
from trainyard.dist import DistContext, all_gather_objects
from trainyard.engine.job_setup import Writers
from trainyard.engine.tracking import ExperimentRef, Tracker
from trainyard.engine.training import TrainOutcome
from trainyard.objectives import Objective
from trainyard.runs.contracts import (
    EvaluationResult,
    TrainingResult,
    evaluation_key,
    training_key,
)
from trainyard.runs.record import CommunicationRecord
from trainyard.runtime.progress import peak_rss_mb
from trainyard.storage import Store
from trainyard.sync.communication import Communication

log = logging.getLogger(__name__)


def track_outcome(
    tracker: Tracker,
    store: Store,
    run_id: str,
    outcome: TrainOutcome,
    scores: dict[str, float],
    objective: Objective,
) -> None:
    """What every rank's experiment learns at the end: the test metrics (exact, all-reduced),
    the checkpoints taken (their URIs; retention may delete older ones) and the stragglers."""
    tracker.log_metrics({f"test_{k}": scores[k] for k in objective.metrics}, step=outcome.steps)
    # One value per key: Comet cuts a logged value at about 1,000 characters.
    others = {
        f"checkpoint/step-{step:08d}": store.uri(checkpoint_key(run_id, step))
        for step in outcome.checkpoint_steps
    }
    ranks = sorted({found.rank for found in outcome.stragglers})
    others["straggler_ranks"] = ",".join(map(str, ranks)) or "none"
    for episode, found in enumerate(outcome.stragglers):  # a rank may be slow more than once
        others[f"straggler/{episode}/rank{found.rank}"] = (
            f"steps {found.first_step}-{found.last_step}: {found.slowdown:.2f}x the other "
            f"ranks' median step ({found.median_step_ms:.1f} ms vs {found.ranks_median_step_ms:.1f} ms)"
        )
    tracker.log_others(others)


def finish(
    ctx: DistContext,
    store: Store,
    run_id: str,
    outcome: TrainOutcome,
    experiment: ExperimentRef,
    writers: Writers,
    report: dict[str, Any],
    started: float,
    scored: tuple[dict[str, float], float],
) -> None:
    """Gather what every rank reports, drain the uploads, and (rank 0) write the result."""
    mine = {
        "experiments": dataclasses.asdict(experiment),
        "samples_per_s_per_rank": outcome.samples_per_s,
        "peak_rss_mb_per_rank": peak_rss_mb(),
        "worker_pids": os.getpid(),
        "communication": outcome.communication,
    }
    ranks = all_gather_objects(mine)  # once, before the uploads drain, while ranks are in step
    gathered = {key: [rank[key] for rank in ranks] for key in mine}
    communication = _communication(gathered.pop("communication"))
    # Every rank waits for its last uploads (checkpoint.upload_timeout_s): ranks > 0 for
    # their shards, rank 0 for the commits, which need those shards.
    checkpointer, shard_stager = writers
    if shard_stager is not None:
        shard_stager.close()
    checkpointer.close()
    if not ctx.is_main:
        return
    # A resume from the final checkpoint has nothing left to train or save.
    final = checkpointer.committed[-1] if checkpointer.committed else report["resumed_from"]
    evaluation = _evaluation(final, outcome.steps, *scored)
    if evaluation is not None:
        store.write_json(evaluation_key(run_id), evaluation.model_dump(mode="json"))
    result = TrainingResult(
        world_size=ctx.world_size,
        device=str(ctx.device),
        backend=ctx.backend,
        steps=outcome.steps,
        history=outcome.history,
        checkpoints=checkpointer.committed,
        final_checkpoint=final,
        seconds=time.monotonic() - started,
        evaluation=evaluation,
        stragglers=outcome.stragglers,  # every rank reached the same verdicts
        rank_lanes=outcome.rank_lanes,
        skipped_checkpoint_epochs=outcome.skipped_checkpoint_epochs,
        communication=communication,
        **report,
        **gathered,
    )
    store.write_json(training_key(run_id), result.model_dump(mode="json"))
    log.info("training finished: %d steps, final checkpoint %s", outcome.steps, final)


def _communication(ranks: list[Communication | None]) -> CommunicationRecord | None:
    """Every rank's syncs, side by side (None where a rank did not count them)."""
    counted = [rank for rank in ranks if rank is not None]
    if not counted or len(counted) < len(ranks):
        return None
    return CommunicationRecord(
        bytes_sent_per_rank=[rank.bytes_sent for rank in counted],
        wait_s_per_rank=[round(rank.wait_s, 6) for rank in counted],
        syncs=counted[0].syncs,
        staleness=_summed([rank.staleness for rank in counted]),
        checkpoint_bytes_per_rank=[rank.checkpoint_bytes for rank in counted],
        checkpoint_wait_s_per_rank=[round(rank.checkpoint_wait_s, 6) for rank in counted],
    )


def _summed(counts: list[dict[int, int]]) -> dict[int, int] | None:
    """Every rank's pushes by staleness, added up (None: no parameter server's)."""
    total: Counter[int] = Counter()
    for count in counts:
        total.update(count)
    return dict(sorted(total.items())) or None


def _evaluation(
    final: str | None, steps: int, scores: dict[str, float], seconds: float
) -> EvaluationResult | None:
    """The in-job test scores as the final checkpoint's, if that checkpoint holds the weights
    they were computed with (it was taken at the last step, not dropped while uploads lag)."""
    if final is None or step_of(final) != steps:
        return None
    metrics = {name: value for name, value in scores.items() if name != "rows"}
    rows = int(scores["rows"])
    return EvaluationResult(
        split="test", checkpoint=final, rows=rows, metrics=metrics, seconds=seconds
    )
