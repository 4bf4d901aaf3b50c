"""Where a run's state is kept: the `checkpoint` section (cadence, retention, uploads) and the
`storage` section (the S3-compatible store checkpoints and records go to)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from trainyard.config.base import MAX_INTERRUPT_GRACE_S, MAX_WAIT_S, Section

_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class CheckpointConfig(Section):
    every_n_epochs: int = Field(1, ge=1)
    every_n_steps: int | None = Field(
        None, ge=1, description="also checkpoint mid-epoch every N global steps"
    )
    every_n_minutes: float | None = Field(
        None,
        gt=0,
        le=MAX_WAIT_S / 60,
        description="also checkpoint every N minutes of training (mid-epoch too): long epochs "
        "of any speed lose at most this much work",
    )
    # 0.01, not 0.03: measured on a 2-core machine with a local store, a checkpoint costs
    # training about its absorb time (the store's CPU is the workers'), so the default
    # pays ~1% of training for checkpoints rather than using up a 3% budget on them.
    max_overhead: float | None = Field(
        0.01,
        gt=0,
        lt=1,
        description="skip an every_n_epochs checkpoint while the store cannot take it within "
        "this share of the time (one still uploading, or the last one's serialize + upload "
        "time over this share of the time since it; the first one's, which holds one-time "
        "work, is not counted); the first and the last epoch's are always taken; null: "
        "every every_n_epochs",
    )
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: a run id that already has committed checkpoints continues from its latest",
    )
    on_interrupt: bool = Field(
        True,
        description="SIGINT or SIGTERM (Ctrl-C, a preemption, a cancelled flow run): the "
        "workers stop at the next step, all at the same one, and commit a checkpoint there "
        "before exiting; false: they stop at once and the last committed checkpoint stays",
    )
    # 25 s: a cloud preemption notice is 30 s (GCP, Azure) to 2 minutes (AWS); the agent and
    # the launcher wait this long for the commit, so it must leave them time to exit too.
    interrupt_grace_s: float = Field(
        25,
        gt=0,
        le=MAX_INTERRUPT_GRACE_S,
        description="the longest an interrupted run spends on its last checkpoint; past it "
        "the workers exit and the last committed checkpoint stays",
    )
    keep_last: int = Field(3, description="committed checkpoints kept besides the best and pinned")
    keep_best_by: str = Field(
        "monitor",
        description="also keep the end-of-epoch checkpoint best by this validation metric: "
        "monitor (the task's monitored metric), val_<metric>, or none",
    )
    pinned_steps: list[int] = Field(default_factory=list, description="steps never deleted")
    max_staged: int = Field(
        4, ge=2, description="checkpoints staged locally while uploads lag (or the store is down)"
    )
    upload_backoff_s: float = Field(
        0.5, gt=0, le=MAX_WAIT_S, description="first retry delay; doubles each time"
    )
    upload_backoff_max_s: float = Field(30, gt=0, le=MAX_WAIT_S)
    upload_timeout_s: float = Field(
        600,
        gt=0,
        le=MAX_WAIT_S,
        description="at the end, wait this long for the last uploads, then fail",
    )

    @field_validator("keep_best_by")
    @classmethod
    def _best_by(cls, value: str) -> str:
        if value not in ("monitor", "none") and not re.fullmatch(r"val_\w+", value):
            raise ValueError("must be monitor, none, or a validation metric such as val_loss")
        return value

    @field_validator("keep_last")
    @classmethod
    def _keep_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "must be at least 2: the newest checkpoint may still be uploading, so the one "
                "before it must stay"
            )
        return value


class StorageConfig(Section):
    endpoint: str = Field(
        "embedded",
        description="'embedded' (local SeaweedFS), 'aws', or an http(s) URL of an S3-compatible store",
    )
    bucket: str = "trainyard"
    prefix: str = ""

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, value: str) -> str:
        if value not in {"embedded", "aws"} and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
            raise ValueError("must be 'embedded', 'aws' or an http(s):// URL")
        return value

    @field_validator("bucket")
    @classmethod
    def _valid_bucket(cls, value: str) -> str:
        if not _BUCKET_NAME.fullmatch(value):
            raise ValueError(
                "must be an S3 bucket name: 3-63 lowercase letters, digits, '.' or '-'"
            )
        return value

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        if value.startswith("/") or ".." in value.split("/"):
            raise ValueError("must be a relative key prefix without '..'")
        return value.strip("/")
