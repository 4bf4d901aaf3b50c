"""One way to load a checkpoint: a URI in, a ready model and its data description out.

Evaluation, tests, and next the registry and batch inference all load through here, so a
checkpoint made by DDP or FSDP, of any model and any data kind, loads the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from trainyard.checkpoint.reader import fetch_files, load_checkpoint, strip_wrapper_prefixes
from trainyard.config import ModelConfig
from trainyard.data.split import SplitSchema
from trainyard.data_spec import DataSpec
from trainyard.models.registry import build_model, model_data_spec
from trainyard.models.zoo import split_fused_qkv
from trainyard.runs.contracts import CheckpointManifest
from trainyard.storage import Store


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # on the CPU, in eval mode, with the checkpoint's weights
    data: DataSpec  # what it reads and predicts
    schema: SplitSchema  # how to prepare new samples for it: classes, statistics
    manifest: CheckpointManifest
    uri: str


def load_model(store: Store, uri: str, scratch: Path, rank: int = 0) -> LoadedModel:
    """The model a committed checkpoint holds, its weights verified. A sharded checkpoint's
    files are fetched into `scratch/restore-rank<rank>/` and read whole: inside torchrun
    every rank must call this together (DCP reads collectively), outside it one process
    reads them all."""
    state, manifest = load_checkpoint(store, uri)
    described = manifest.model
    data = model_data_spec(described)
    model = build_model(ModelConfig(name=described["name"], options=described["options"]), data)
    if manifest.sharded:
        from trainyard.checkpoint.sharded import (
            load_shards,  # imports DCP: only sharded checkpoints pay
        )

        dest = scratch / f"restore-rank{rank}" / f"step-{manifest.step:08d}"
        load_shards(model, None, fetch_files(store, uri, manifest, dest))
    else:
        weights = strip_wrapper_prefixes(state["model"])
        split_fused_qkv(weights)  # a transformer saved before its projections were three
        model.load_state_dict(weights)
    model.eval()
    return LoadedModel(model, data, SplitSchema(**manifest.split_schema), manifest, uri)
