"""What a torchrun job hands back to the flow, through the store, as typed models: a renamed
or missing field fails at the boundary, not as a KeyError later. Fields are only added."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainyard.runs.record import CommunicationRecord, ExperimentInfo, RankLanes, Straggler


def training_key(run_id: str) -> str:
    """Where rank 0 of a training job writes its TrainingResult."""
    return f"runs/{run_id}/training.json"


def evaluation_key(run_id: str) -> str:
    """Where a job writes its EvaluationResult (the training job: its final checkpoint's)."""
    return f"runs/{run_id}/evaluation.json"


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvaluationResult(Contract):
    """`runs/<id>/evaluation.json`: a checkpoint scored on one split, exactly."""

    split: str
    checkpoint: str
    rows: int
    metrics: dict[str, float]  # the task's metrics, by name
    seconds: float = 0.0  # loading (if any) and scoring


class TrainingResult(Contract):
    """`runs/<id>/training.json`, written by rank 0 when training ends."""

    world_size: int
    device: str
    backend: str
    # {data, pipeline, tensor}: replicas x the workers each replica is cut across
    layout: dict[str, int] = Field(default_factory=dict)
    steps: int  # the global step reached
    # One row per epoch, restored ones included; counts (epoch, rows) stay integers.
    history: list[dict[str, int | float]]
    checkpoints: list[str]  # retained committed checkpoints, ascending
    final_checkpoint: str | None
    experiments: list[ExperimentInfo]  # one per rank
    samples_per_s_per_rank: list[float]
    first_step_at: float | None
    seconds: float
    restarts: int  # torchrun restarts of the worker group
    resumed_from: str | None
    warm_start: bool
    resumes: list[dict[str, Any]] = Field(default_factory=list)
    steps_redone: int = 0
    peak_rss_mb_per_rank: list[float] = Field(default_factory=list)  # each worker's high-water
    # The test split scored in the training job with the final checkpoint's weights (None
    # when the final checkpoint is not the last step's: the flow then scores it separately).
    evaluation: EvaluationResult | None = None
    pruned_at_epoch: int | None = None  # a sweep's pruner stopped training after this epoch
    # Epochs whose checkpoint was skipped because the store was behind (max_overhead).
    skipped_checkpoint_epochs: list[int] = Field(default_factory=list)
    stragglers: list[Straggler] = Field(default_factory=list)  # ranks found slow (stragglers.py)
    rank_lanes: RankLanes | None = None  # every rank's step times per window (stragglers.py)
    communication: CommunicationRecord | None = None  # the replicas' syncs (trainyard.sync)
    # Each rank's process id: jobs on the same persistent workers (trainyard.runtime.persistent)
    # share them.
    worker_pids: list[int] = Field(default_factory=list)


class FileEntry(Contract):
    size: int
    sha256: str


class CheckpointManifest(Contract):
    """`runs/<id>/checkpoints/step-<n>/manifest.json`, written last: its presence commits the
    checkpoint, its file list is what loading verifies, and its run fields are what a resume
    compares (`resume.check_compatible`)."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)

    run_id: str
    model: dict[str, Any]  # models.describe(): name, options, the data it was built for
    dataset_md5: str | None
    world_size: int
    global_batch_size: int
    strategy: str
    sync: str = "allreduce"  # train.sync (manifests written before it: all-reduced)
    # {data, pipeline, tensor}: how the world was cut (None: written before model
    # parallelism, when it was all data parallel).
    layout: dict[str, int] | None = None
    # The split's SplitSchema (classes, statistics, vocabulary); "schema" in the file.
    split_schema: dict[str, Any] = Field(alias="schema")
    params_hash: str
    settings_hash: str | None = None  # None in manifests written before continuations
    step: int
    epoch: int  # where to continue: this epoch, after step_in_epoch steps of it
    step_in_epoch: int
    metrics: dict[str, float] = Field(default_factory=dict)  # validation, at an epoch's end
    torch_version: str
    files: dict[str, FileEntry] = Field(default_factory=dict)  # name -> size and sha256
    # HMAC-SHA256 of the rest and of where it is committed, with the project's key
    # (trainyard.checkpoint.signing); loading refuses a manifest without a valid one.
    signature: str | None = None

    @property
    def data_workers(self) -> int:
        """The replicas the checkpoint's global batch was cut across."""
        return self.layout["data"] if self.layout else self.world_size

    @property
    def sharded(self) -> bool:
        """Every worker saved its own part of the model and optimizer (DCP's files)."""
        return self.strategy == "fsdp" or self.model_layout != {"pipeline": 1, "tensor": 1}

    @property
    def model_layout(self) -> dict[str, int]:
        """How one replica was cut: {pipeline, tensor}."""
        layout = self.layout or {}
        return {"pipeline": layout.get("pipeline", 1), "tensor": layout.get("tensor", 1)}
