"""The `predict` command of a torchrun worker: score this rank's contiguous slice of the
input, one committed shard at a time, skipping shards an earlier attempt committed."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from trainyard.checkpoint.loading import load_model
from trainyard.config import TaskConfig
from trainyard.data.split import SplitSchema
from trainyard.dist import DistContext, all_gather_objects, barrier
from trainyard.inference.documents import PredictionJob
from trainyard.inference.readers import InputRows, open_rows
from trainyard.inference.shards import commit_shard, committed_shards, rank_shards, shard_rows
from trainyard.inference.shards import write_manifest as commit_output
from trainyard.objectives import Objective, objective_for
from trainyard.storage import Store
from trainyard.util.attempts import torchrun_restarts

log = logging.getLogger(__name__)


class ShardScorer:
    """A loaded model and what turns rows of the input into an output table."""

    def __init__(
        self,
        model: nn.Module,
        schema: SplitSchema,
        objective: Objective,
        device,
        named: tuple[str, ...] = (),
    ):
        self.model, self.schema, self.objective, self.device = model, schema, objective, device
        self.named = named  # columns that name the rows (an image folder's "file")
        # Per feature of a table, per channel of images (as TableArrays and ImageArray apply);
        # a user's dataset returns what the model reads already.
        self.standardize = schema.dataset is None and bool(schema.feature_mean)
        per = (-1, 1, 1) if schema.kind == "image" else (-1,)
        self.mean = torch.tensor(schema.feature_mean, dtype=torch.float32).reshape(per)
        self.std = torch.tensor(schema.feature_std, dtype=torch.float32).reshape(per)

    @property
    def text(self) -> bool:
        return self.objective.target_kind == "tokens"

    @property
    def columns(self) -> list[str]:
        if self.text:
            return ["row", "prediction", "token", "loss"]
        probabilities = [f"prob_{c}" for c in self.schema.classes if self.schema.target == "class"]
        return ["row", *self.named, "prediction", *probabilities]

    @torch.inference_mode()
    def score(
        self,
        block: np.ndarray | torch.Tensor,
        first: int,
        batch_size: int,
        targets: torch.Tensor | None = None,
        named: dict[str, list[str]] | None = None,
    ) -> pa.Table:
        inputs = torch.as_tensor(block)
        if self.standardize:  # the same standardization, in float32, as training's readers
            inputs = (inputs.float() - self.mean) / self.std
        parts = []
        for at in range(0, len(inputs), batch_size):
            outputs = self.model(inputs[at : at + batch_size].to(self.device))
            if self.text:
                assert targets is not None  # a text input's rows carry their windows' targets
                window_targets = targets[at : at + batch_size].to(self.device)
                parts.append(self.objective.predictions(outputs, window_targets))
            else:
                parts.append(self.objective.predictions(outputs))
        merged = {name: torch.cat([p[name] for p in parts]).cpu().numpy() for name in parts[0]}
        columns: dict[str, pa.Array] = {"row": pa.array(np.arange(first, first + len(inputs)))}
        columns |= {name: pa.array(values, pa.string()) for name, values in (named or {}).items()}
        return pa.table(columns | self._prediction_columns(merged))

    def _prediction_columns(self, merged: dict[str, np.ndarray]) -> dict[str, pa.Array]:
        if self.text:
            texts = np.asarray(token_texts(self.schema), dtype=object)
            return {
                "prediction": pa.array(texts[merged["prediction"]], type=pa.string()),
                "token": pa.array(merged["prediction"].astype(np.int64)),
                "loss": pa.array(merged["loss"].astype(np.float64)),
            }
        if "probabilities" not in merged:
            return {"prediction": pa.array(merged["prediction"])}
        classes = np.asarray(self.schema.classes, dtype=object)
        columns = {"prediction": pa.array(classes[merged["prediction"]], type=pa.string())}
        for j, name in enumerate(self.schema.classes):
            columns[f"prob_{name}"] = pa.array(merged["probabilities"][:, j])
        return columns


def token_texts(schema: SplitSchema) -> list[str]:
    """Each token id's text: its character, or at byte level an ASCII byte as itself and
    any other byte as \\xNN (one byte of a longer UTF-8 character is no text of its own)."""
    if schema.dataset is not None:  # the user's own tokens: their ids are all we know
        return [str(i) for i in range(schema.vocab_size or 0)]
    if schema.token_level == "char":
        return list(schema.token_chars or [])
    return [chr(b) if b < 128 else f"\\x{b:02x}" for b in range(schema.vocab_size or 256)]


def predict_job(
    ctx: DistContext, store: Store, job: PredictionJob, root: Path, scratch: Path
) -> None:
    started = time.monotonic()
    loaded = load_model(store, job.model.checkpoint, scratch, ctx.rank)
    objective = objective_for(TaskConfig(**job.model.task), loaded.schema)
    named = ("file",) if job.input.names else ()
    model = loaded.model.to(ctx.device)
    scorer = ShardScorer(model, loaded.schema, objective, ctx.device, named)
    mine = rank_shards(job.num_shards, ctx.rank, ctx.world_size)
    todo = [k for k in mine if k not in committed_shards(store, job.prediction_id)]
    clock = time.monotonic()
    rows = open_rows(root, job.input, loaded.schema)
    scored_rows = _score_shards(ctx, store, job, scorer, rows, todo)
    seconds = time.monotonic() - clock
    gathered = all_gather_objects((scored_rows, seconds, len(mine) - len(todo)))
    barrier()  # every rank's commits are in before rank 0 writes the manifest
    if not ctx.is_main:
        return
    manifest = commit_output(
        store,
        job,
        columns=scorer.columns,
        world_size=ctx.world_size,
        device=str(ctx.device),
        scoring_seconds=max(s for _, s, _ in gathered),
        rows_scored=sum(r for r, _, _ in gathered),
        shards_reused=sum(n for _, _, n in gathered),
    )
    log.info(
        "prediction %s: %d rows in %d shards (%d reused) in %.2fs",
        job.prediction_id,
        manifest.rows,
        len(manifest.shards),
        manifest.shards_reused,
        time.monotonic() - started,
    )


def _score_shards(
    ctx: DistContext,
    store: Store,
    job: PredictionJob,
    scorer: ShardScorer,
    rows: InputRows,
    shards: list[int],
) -> int:
    """Score `shards` in order; each is serialized and committed on a background thread
    while the next one computes (at most two wait), so the store's latency hides behind
    the model. Returns the rows scored."""
    attempt = torchrun_restarts()

    def commit(shard: int, table: pa.Table) -> None:
        commit_shard(store, job, shard, table, ctx.rank, attempt)
        log.info("shard %d committed: rows [%d, %d)", shard, *shard_rows(job, shard))

    scored = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-commit") as committer:
        pending: list[Future] = []
        for shard in shards:
            first, stop = shard_rows(job, shard)
            table = _score_rows(scorer, rows, first, stop, job.batch_size)
            pending.append(committer.submit(commit, shard, table))
            scored += stop - first
            while len(pending) > 2:
                pending.pop(0).result()
        for future in pending:
            future.result()
    return scored


def _score_rows(
    scorer: ShardScorer, rows: InputRows, first: int, stop: int, batch_size: int
) -> pa.Table:
    """Rows [first, stop), read and scored a batch at a time: only a batch of decoded
    samples (and their outputs) is in memory. For text, `inference.batch_size` counts
    tokens, so a batch is that many tokens' worth of windows."""
    if scorer.text:
        assert scorer.schema.input_shape is not None  # a token model's: its context
        batch_size = max(1, batch_size // max(1, scorer.schema.input_shape[0]))
    tables = []
    for at in range(first, stop, batch_size):
        read = rows.read(at, min(at + batch_size, stop))
        tables.append(scorer.score(read.inputs, at, batch_size, read.targets, read.named))
    return pa.concat_tables(tables)
