"""What batch inference writes to the store, as typed documents, and where:

    predictions/<id>/job.json                          what the torchrun job scores (PredictionJob)
    predictions/<id>/parts/part-<k:05d>.<token>.parquet one shard's rows, a unique name per attempt
    predictions/<id>/commits/part-<k:05d>.json         created once (If-None-Match): commits a part
    predictions/<id>/manifest.json                     written last: every shard, rows and sha256
    predictions/<id>/prediction.json                   the record: model, input md5, rows, rows/s

Fields are only added, never renamed: other programs read these files.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")


def prediction_root(prediction_id: str) -> str:
    return f"predictions/{prediction_id}"


def job_key(prediction_id: str) -> str:
    return f"{prediction_root(prediction_id)}/job.json"


def manifest_key(prediction_id: str) -> str:
    return f"{prediction_root(prediction_id)}/manifest.json"


def record_key(prediction_id: str) -> str:
    return f"{prediction_root(prediction_id)}/prediction.json"


def commit_key(prediction_id: str, shard: int) -> str:
    return f"{prediction_root(prediction_id)}/commits/part-{shard:05d}.json"


def part_key(prediction_id: str, shard: int, token: str) -> str:
    return f"{prediction_root(prediction_id)}/parts/part-{shard:05d}.{token}.parquet"


class ModelSource(Document):
    """The model a prediction used, resolved once: an alias never moves under a running job."""

    reference: str  # as the user wrote it: digits@champion, digits:3, run:RUN_ID
    checkpoint: str  # the URI loading.load_model reads (a registry version or a checkpoint)
    name: str | None = None  # registry model, if any
    version: int | None = None
    alias: str | None = None
    run_id: str | None = None  # the run that trained it
    task: dict[str, Any]  # the task settings it was trained with (what predictions mean)


class InputTable(Document):
    """The input as checked against the model's input schema, and converted where it is
    read as an array: `reader` says how workers read its rows (trainyard.inference.readers)."""

    path: str  # as given
    md5: str  # of the file's bytes; a folder's is DVC's listing hash (<md5>.dir)
    rows: int  # table rows, images, text windows, or the user dataset's rows
    columns: list[str]  # a table's feature columns, in the model's order; [] otherwise
    array: str  # the converted samples inside the project: float32 rows x shape, or tokens
    shape: list[int] = Field(default_factory=list)  # one sample's: [columns], [C, H, W], [context]
    # array: float32 samples in raw units; tokens: the text's token ids, read in windows of
    # the model's context; dataset: the model's data.dataset factory reads `path` (no array)
    reader: Literal["array", "tokens", "dataset"] = "array"
    names: str | None = None  # an image folder's: a JSON list of each row's file, by row
    tokens: int | None = None  # text: tokens in the file (the windows cover all but the tail)


class PredictionJob(Document):
    """`job.json`: what every rank of the torchrun job reads."""

    prediction_id: str
    model: ModelSource
    input: InputTable
    shard_rows: int
    batch_size: int
    device: str  # train.device: auto | cpu | cuda

    @property
    def num_shards(self) -> int:
        return max(1, -(-self.input.rows // self.shard_rows))


class ShardCommit(Document):
    """`commits/part-<k>.json`: shard k is the part at `key`; created only if absent, so of
    two attempts that both wrote shard k exactly one is committed."""

    shard: int
    key: str
    first_row: int
    rows: int
    size: int
    sha256: str
    rank: int
    attempt: int  # torchrun's restart count when it was written


class PredictionManifest(Document):
    """`manifest.json`, written last by rank 0 once every shard is committed: readers read
    these shards, in this order, and nothing else under the prefix."""

    prediction_id: str
    rows: int
    columns: list[str]  # row, prediction, and for classes prob_<class> per class
    shards: list[ShardCommit]
    world_size: int
    device: str
    scoring_seconds: float  # the slowest rank's, this attempt
    rows_scored: int  # this attempt; the rest were committed by an earlier one
    shards_reused: int


class PredictionRecord(Document):
    """`prediction.json`: a prediction's record, like a run's."""

    prediction_id: str
    status: Literal["running", "completed", "failed", "interrupted"]
    created_at: str
    finished_at: str | None = None
    model: ModelSource
    input: InputTable
    output: str  # URI of the manifest
    rows: int = 0
    world_size: int = 0
    device: str | None = None
    shards: int = 0
    shards_reused: int = 0
    rows_per_s: float | None = None  # rows scored / the slowest rank's scoring time
    seconds: dict[str, float] = Field(default_factory=dict)  # check, scoring, total
    code: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
