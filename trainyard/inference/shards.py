"""Exactly-once output: fixed-size shards, each written under a name of its own and then
committed by creating its commit document only if absent; a manifest written last lists
them all. A rerun skips committed shards, so however often a job dies, each row is in
exactly one committed shard, and readers read only what the manifest lists."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import secrets
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trainyard.errors import CheckpointError
from trainyard.inference.documents import (
    PredictionJob,
    PredictionManifest,
    ShardCommit,
    commit_key,
    manifest_key,
    part_key,
    prediction_root,
)
from trainyard.storage import Store

log = logging.getLogger(__name__)


def shard_rows(job: PredictionJob, shard: int) -> tuple[int, int]:
    """[first, stop) of the input rows shard `shard` holds."""
    first = shard * job.shard_rows
    return first, min(first + job.shard_rows, job.input.rows)


def rank_shards(num_shards: int, rank: int, world_size: int) -> range:
    """The shards rank `rank` scores: a contiguous run of them, so a contiguous slice of
    the input, and together the ranks cover every shard once."""
    return range(num_shards * rank // world_size, num_shards * (rank + 1) // world_size)


def find_commit(store: Store, prediction_id: str, shard: int) -> ShardCommit | None:
    try:
        return ShardCommit.model_validate(store.read_json(commit_key(prediction_id, shard)))
    except FileNotFoundError:
        return None


def committed_shards(store: Store, prediction_id: str) -> set[int]:
    """The shards an earlier attempt committed, in one listing."""
    names = store.list_files(f"{prediction_root(prediction_id)}/commits")
    return {int(key.rsplit("part-", 1)[1].split(".")[0]) for key in names}


def commit_shard(
    store: Store, job: PredictionJob, shard: int, table: pa.Table, rank: int, attempt: int
) -> ShardCommit:
    """Write the shard's part, then create its commit. If another attempt committed the
    shard first (a job started twice), its part stands and ours is removed."""
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    key = part_key(job.prediction_id, shard, secrets.token_hex(4))
    store.put_bytes(key, data)
    first, _ = shard_rows(job, shard)
    commit = ShardCommit(
        shard=shard,
        key=key,
        first_row=first,
        rows=table.num_rows,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        rank=rank,
        attempt=attempt,
    )
    if store.create_json(commit_key(job.prediction_id, shard), commit.model_dump(mode="json")):
        return commit
    winner = find_commit(store, job.prediction_id, shard)
    if winner is None or winner.key != key:
        store.delete(key)
    return winner or commit


def write_manifest(store: Store, job: PredictionJob, **fields) -> PredictionManifest:
    """Once every shard is committed: the manifest (the output's commit), after removing
    the parts no commit names (what earlier attempts left half-done)."""
    commits = [find_commit(store, job.prediction_id, k) for k in range(job.num_shards)]
    missing = [k for k, commit in enumerate(commits) if commit is None]
    if missing:
        raise RuntimeError(f"prediction {job.prediction_id}: shards {missing[:5]} not committed")
    named = {commit.key for commit in commits if commit is not None}
    parts = store.list_files(f"{prediction_root(job.prediction_id)}/parts")
    store.delete_files([key for key in parts if key not in named])
    manifest = PredictionManifest(
        prediction_id=job.prediction_id,
        rows=sum(commit.rows for commit in commits if commit is not None),
        shards=[commit for commit in commits if commit is not None],
        **fields,
    )
    store.write_json(manifest_key(job.prediction_id), manifest.model_dump(mode="json"))
    return manifest


def read_output_manifest(store: Store, prediction_id: str) -> PredictionManifest | None:
    try:
        return PredictionManifest.model_validate(store.read_json(manifest_key(prediction_id)))
    except FileNotFoundError:
        return None


def read_shard(store: Store, commit: ShardCommit) -> pa.Table:
    """A committed shard, verified against its commit."""
    data = store.get_bytes(commit.key)
    if hashlib.sha256(data).hexdigest() != commit.sha256:
        raise CheckpointError(f"{store.uri(commit.key)} does not match its commit (sha256)")
    return pq.read_table(io.BytesIO(data))


def export_parquet(store: Store, manifest: PredictionManifest, dest: Path) -> Path:
    """Every shard, in input order, into one local Parquet file (written beside `dest` and
    renamed, so it appears whole or not at all)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: a link planted at the temporary name is never followed out of the folder.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as handle:
            writer = None
            for commit in manifest.shards:
                table = read_shard(store, commit)
                writer = writer or pq.ParquetWriter(handle, table.schema)
                writer.write_table(table)
            if writer is not None:
                writer.close()
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
