"""Sharded (FSDP2) checkpoints through torch.distributed.checkpoint: one file per rank.

Every rank writes its own shard (`__<rank>_0.distcp`) of the model and optimizer; rank 0
also writes DCP's `.metadata`. The files are listed, with their sha256, in the same
manifest as a DDP checkpoint, so the commit protocol is unchanged: every rank uploads its
own shard in the background, and rank 0 writes the manifest once all are in the store.
Loading verifies them and can reshard (DCP reads whatever slices the loading ranks need).

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
from collections.abc import Callable
from dataclasses import dataclass
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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from trainyard.checkpoint.layout import checkpoint_key
from trainyard.checkpoint.snapshot import file_info
from trainyard.checkpoint.uploads import UploadQueue, disk_full, staging_full
from trainyard.config import CheckpointConfig
from trainyard.dist import all_gather_objects
from trainyard.errors import CheckpointError
from trainyard.runs.contracts import FileEntry
from trainyard.storage import Store
from trainyard.storage.sender import FileSender

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
    model_state, optim_state = read_shards(model, optimizer, folder)
    if optimizer is not None and optim_state is not None:  # read whenever an optimizer is given
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    else:
        set_model_state_dict(model, model_state)


def read_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective: (model, optimizer) state dicts shaped like `model`'s own (this rank's
    slices of a sharded model), filled from the verified files in `folder`; DCP reads
    whatever slices they need, so a checkpoint loads into another world size."""
    state: dict[str, Any]
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model)}  # its keys without wrapper prefixes
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
    return state["model"], state.get("optim")


class ShardStager:
    """Every rank's part of saving a sharded checkpoint.

    All ranks write their shard (collective). Ranks > 0 hand their file to their own
    background uploader and go on training; rank 0's CheckpointWriter uploads its files and
    commits the manifest, listing every rank's file, once the others' shards are in the
    store. Rank 0 decides which checkpoints stay staged while uploads lag
    (`checkpoint.max_staged`) and says so at each save, so the other ranks keep only those.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        staging: Path,
        config: CheckpointConfig,
        rank: int,
        staged_steps: Callable[[], list[int]] = list,
    ):
        self.store = store
        self.run_id = run_id
        self.staging = staging / run_id
        self.rank = rank
        self.staged_steps = staged_steps  # rank 0's CheckpointWriter.staged_steps
        self.uploader = ShardUploader(store, config) if rank != 0 else None

    def stage(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, FileEntry], frozenset[str]]:
        """(every rank's files with size and sha256, the names rank 0 does not upload)."""
        folder = self.staging / f"step-{step:08d}"
        try:
            save_shards(model, optimizer, folder)
        except (OSError, RuntimeError, CheckpointException) as exc:  # DCP's is a BaseException
            if disk_full(exc):
                raise staging_full(step, self.staging) from None
            raise
        mine = {name: file_info(folder / name) for name in shard_files(folder, self.rank)}
        staged = self.staged_steps() if self.rank == 0 else None
        gathered = all_gather_objects((mine, staged))
        if self.uploader is not None:
            self.uploader.keep_only(set(gathered[0][1]))
            self.uploader.submit(step, folder, sorted(mine), checkpoint_key(self.run_id, step))
        files: dict[str, FileEntry] = {}
        uploaded: set[str] = set()
        for rank, (theirs, _) in enumerate(gathered):
            files |= theirs
            if rank != 0:
                uploaded |= set(theirs)
        return files, frozenset(uploaded)

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.close()


@dataclass
class _Shard:
    step: int
    folder: Path
    names: list[str]
    key: str


class ShardUploader(UploadQueue):
    """A rank > 0's uploads of its own shard files, oldest first, on one background thread,
    retrying transient store errors like rank 0's uploader, so training never waits."""

    def __init__(self, store: Store, config: CheckpointConfig):
        self.store = store
        self._sender = FileSender(store)  # large shards upload from a child process
        super().__init__(config, "shard-uploader")

    def submit(self, step: int, folder: Path, names: list[str], key: str) -> None:
        with self._cond:
            if self._failure:
                raise CheckpointError(self._failure)
            self._pending.append(_Shard(step, folder, names, key))
            self._cond.notify_all()

    def keep_only(self, steps: set[int]) -> None:
        """Drop waiting shards of checkpoints rank 0 no longer has staged (it dropped them,
        or committed them, which it does only once this rank's shard is in the store)."""
        with self._cond:
            dropped = [s for s in self._pending[1:] if s.step not in steps]
            self._pending[1:] = [s for s in self._pending[1:] if s.step in steps]
        for shard in dropped:
            for name in shard.names:
                (shard.folder / name).unlink(missing_ok=True)

    def close(self) -> None:
        timeout_s = self.config.upload_timeout_s
        done, left, failure = self._drain(timeout_s)
        self._sender.close()
        if failure:
            raise CheckpointError(failure)
        if not done:
            raise CheckpointError(
                f"shard upload did not finish within checkpoint.upload_timeout_s={timeout_s:g}s "
                f"(steps {left} not in {self.store.settings.where})"
            )

    def _describe(self, shard: _Shard) -> str:
        return f"upload of this rank's shard of step {shard.step}"

    def _process(self, shard: _Shard) -> bool:
        for name in shard.names:
            local = shard.folder / name
            try:
                self._sender.send(local, f"{shard.key}/{name}")
            except FileNotFoundError:
                if local.exists():
                    raise
                # On one node rank 0 and this rank share the staging folder: rank 0 removed
                # a checkpoint it dropped (never committed), so this shard is not needed.
                return True
            local.unlink(missing_ok=True)
        return True


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
