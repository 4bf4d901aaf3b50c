"""`train()` on splits this process holds, from settings alone: the loop and the hooks a
job builds, without a job's run record, progress watchdog, pruner, live status or
interrupts. For tests, benchmarks and notebooks; a run's workers go through
trainyard.engine.jobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainyard.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data_spec import DataSpec
from trainyard.dist import DistContext
from trainyard.engine.hooks import CheckpointHook, Hook
from trainyard.engine.loop_hooks import LoopHooks
from trainyard.engine.tracking import Tracker
from trainyard.engine.train_state import TrainState
from trainyard.engine.training import Split, Splits, TrainOutcome, train
from trainyard.models.registry import table_spec
from trainyard.objectives import Objective


def train_standalone(
    ctx: DistContext,
    config: TrainyardConfig,
    train_split: Split,
    val_split: Split,
    objective: Objective,
    tracker: Tracker,
    checkpointer: CheckpointWriter | NullCheckpointWriter,
    checkpoint_meta: dict[str, Any],
    extra_hooks: Sequence[Hook] = (),
    data: DataSpec | None = None,
) -> TrainOutcome:
    """`config.train.epochs` epochs from scratch, with straggler detection, tracking,
    `extra_hooks` and checkpoints, in that order. `data` describes the samples to the model
    factory (default: the split's own description, or a table of the split's width)."""
    if data is None:  # a dataset describes itself; an in-memory table by its width
        data = getattr(train_split, "spec", None) or table_spec(
            train_split.features.shape[1],  # type: ignore[union-attr]  # a TensorSplit
            objective.num_outputs,
        )
    splits = Splits.prepared(ctx, config, train_split, val_split)
    state = TrainState.build(ctx, config, len(splits.train), data)
    checkpoints = CheckpointHook(
        config.checkpoint, config.train.epochs, checkpointer, checkpoint_meta, ctx=ctx
    )
    return train(
        state, splits, objective, LoopHooks.build(ctx, config, tracker, checkpoints, extra_hooks)
    )
