"""Sharded (FSDP2) checkpoints through torch.distributed.checkpoint: one file per rank.

Every rank writes its own shard (`__<rank>_0.distcp`) of the model and optimizer; rank 0
also writes DCP's `.metadata`. The files are listed, with their sha256, in the same
manifest as a DDP checkpoint, so the commit protocol is unchanged; loading verifies them
and can reshard (DCP reads whatever slices the loading ranks need).

DCP's `.metadata` is a pickle. It is read with a restricted unpickler that accepts only
DCP's own metadata classes and torch dtypes/sizes, and the non-tensor values inside the
shards (optimizer param groups, ...) are read with `weights_only=True` where DCP's default
planner uses `weights_only=False`: the same promise `torch.load(weights_only=True)` makes
for `state.pt`.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainyard.checkpoint import checkpoint_key, file_info, retry_transient
from trainyard.config import CheckpointConfig
from trainyard.dist import all_gather_objects
from trainyard.errors import CheckpointError
from trainyard.storage import Store

METADATA_FILE = ".metadata"
_REFUSED = "holds objects other than checkpoint metadata"
_REFUSED_VALUE = "holds objects other than tensors and plain data"
_SAFE_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "collections",
}


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: every rank writes its shard of model and optimizer into `folder`."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def shard_files(folder: Path, rank: int) -> list[str]:
    """The files of `folder` that this rank wrote."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")]
    if rank == 0 and (folder / METADATA_FILE).exists():
        names.append(METADATA_FILE)
    return sorted(names)


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path) -> None:
    """Collective: load the (verified) files in `folder` into a sharded or bare model."""
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": model.state_dict()}
    # Outside torchrun (a notebook, a test) DCP reads the whole checkpoint in this process.
    no_dist = not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # intended
        try:
            dcp.load(
                state,
                storage_reader=SafeReader(str(folder)),
                planner=SafeLoadPlanner(),
                no_dist=no_dist,
            )
        except (CheckpointException, CheckpointError) as exc:  # DCP wraps every rank's error
            if _REFUSED in str(exc):
                raise CheckpointError(
                    f"{folder}/{METADATA_FILE} {_REFUSED}; refusing to unpickle it"
                ) from None
            if _REFUSED_VALUE in str(exc):
                raise CheckpointError(
                    f"a shard in {folder} {_REFUSED_VALUE}; refusing to unpickle it"
                ) from None
            raise
    if optimizer is not None:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
    else:
        model.load_state_dict(state["model"])


class ShardStager:
    """Every rank's part of saving a sharded checkpoint.

    All ranks write their shard (collective); ranks > 0 upload their own file right away
    (retrying transient errors; on another machine rank 0 could not reach it) and delete the
    local copy; rank 0's CheckpointWriter then uploads its files and commits the manifest
    listing every rank's file. An uncommitted shard in the store is never loaded.
    """

    def __init__(
        self, store: Store, run_id: str, staging: Path, config: CheckpointConfig, rank: int
    ):
        self.store = store
        self.run_id = run_id
        self.staging = staging / run_id
        self.config = config
        self.rank = rank

    def stage(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, dict[str, Any]], frozenset[str]]:
        """(every rank's files with size and sha256, the names already uploaded)."""
        folder = self.staging / f"step-{step:08d}"
        save_shards(model, optimizer, folder)
        mine = {name: file_info(folder / name) for name in shard_files(folder, self.rank)}
        if self.rank != 0:
            key = checkpoint_key(self.run_id, step)
            for name in mine:
                retry_transient(
                    f"upload of {name} (step {step})",
                    lambda name=name: self.store.put_file(folder / name, f"{key}/{name}"),
                    self.config,
                )
                (folder / name).unlink()
        files: dict[str, dict[str, Any]] = {}
        uploaded: set[str] = set()
        for rank, theirs in enumerate(all_gather_objects(mine)):
            files |= theirs
            if rank != 0:
                uploaded |= set(theirs)
        return files, frozenset(uploaded)


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        data = (Path(self.path) / METADATA_FILE).read_bytes()
        try:
            metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{METADATA_FILE} {_REFUSED} ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{METADATA_FILE} is not checkpoint metadata")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles a checkpoint's non-tensor values with
    `weights_only=False` (code could run); this one never does."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{fqn} {_REFUSED_VALUE} ({str(exc).splitlines()[0]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES:
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size"
            or isinstance(
                getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
            )
        ):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # name -> torch.layout
            return super().find_class(module, name)
        if module == "pathlib" and name in {"PosixPath", "PurePosixPath", "Path"}:
            return getattr(pathlib, name)
        if module in {"builtins", "__builtin__"} and name in {"set", "frozenset", "slice"}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
