"""How a run is watched: the `tracking` (experiment tracker) and `stragglers` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainyard.config.base import Section


class TrackingConfig(Section):
    backend: Literal["comet", "none"] = "comet"
    project: str = Field("trainyard", min_length=1)
    workspace: str | None = None
    log_every_n_steps: int = Field(
        20,
        ge=1,
        le=100_000,
        description="one point per rank every N steps (window means); epochs log at their end",
    )
    min_interval_s: float = Field(
        0.5,
        ge=0,
        le=3600,
        description="and at most one per this many seconds, epoch rows too (the last "
        "epoch's always; the run record keeps every epoch): at steps of a millisecond, 20 "
        "steps' points cost the loop 5-10% (Comet writes each metric as a message)",
    )


class StragglersConfig(Section):
    """Flagging a rank whose steps stay slower than the other ranks' (trainyard/stragglers.py)."""

    enabled: bool = Field(
        True, description="compare the ranks' step times each window (one tiny all-reduce)"
    )
    window_steps: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="steps per window, each rank's median over them compared; "
        "default: tracking.log_every_n_steps",
    )
    windows_in_a_row: int = Field(
        3, ge=1, le=100_000, description="slow windows in a row that make a rank a straggler"
    )
    mad_factor: float = Field(
        3.0,
        gt=0,
        le=100,
        description="slow in a window: its median step more than this many robust standard "
        "deviations (1.4826 x MAD) of the other ranks' medians above their median",
    )
    min_slowdown: float = Field(
        0.2,
        gt=0,
        le=100,
        description="and above it by at least this fraction (0.2: 20% slower), which is what "
        "counts when the other ranks agree closely (a MAD near 0) or are few",
    )
    min_gap_ms: float = Field(
        5.0,
        ge=0,
        le=3_600_000,
        description="and by at least this many milliseconds per step: steps of a few ms on a "
        "busy CPU differ by that much from scheduling alone, which costs a run little",
    )
