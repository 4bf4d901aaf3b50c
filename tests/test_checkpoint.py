import io
import os

import pytest
import torch

from trainyard.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointWriter,
    checkpoint_key,
    load_checkpoint,
    strip_wrapper_prefixes,
)
from trainyard.errors import CheckpointError


@pytest.fixture
def writer(store, tmp_path):
    return CheckpointWriter(store, "run-1", tmp_path / "staging")


def test_committed_checkpoint_round_trips_through_the_store(store, writer):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1, "step": 10}
    uri = writer.save(10, state, {"epoch": 1})
    assert uri == store.uri(checkpoint_key("run-1", 10)) and uri.endswith(
        "checkpoints/step-00000010"
    )
    loaded, manifest = load_checkpoint(store, uri)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert manifest["step"] == 10 and manifest["files"][STATE_FILE]["size"] > 0
    assert writer.committed == [uri]


def test_committed_checkpoints_are_never_overwritten(writer):
    writer.save(5, {"step": 5}, {})
    with pytest.raises(CheckpointError, match="already committed"):
        writer.save(5, {"step": 6}, {})


def test_checkpoint_without_manifest_is_not_loaded(store):
    key = checkpoint_key("run-2", 1)
    buffer = io.BytesIO()
    torch.save({"step": 1}, buffer)
    store.put_bytes(f"{key}/{STATE_FILE}", buffer.getvalue())
    with pytest.raises(CheckpointError, match="has no manifest.json: it was never committed"):
        load_checkpoint(store, store.uri(key))


def test_tampered_checkpoint_is_refused(store, writer):
    uri = writer.save(3, {"model": {"w": torch.ones(4)}}, {})
    key = store.key_of(uri)
    data = bytearray(store.get_bytes(f"{key}/{STATE_FILE}"))
    data[-20] ^= 0xFF
    store.put_bytes(f"{key}/{STATE_FILE}", bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        load_checkpoint(store, uri)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_checkpoint_with_a_pickled_callable_is_refused_and_never_runs(
    store, writer, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    uri = writer.save(
        7, {"model": {}, "extra": Payload()}, {}
    )  # a valid manifest for a malicious file
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(store, uri)
    assert not (tmp_path / "PWNED").exists()
    assert store.exists(f"{store.key_of(uri)}/{MANIFEST_FILE}")


def test_wrapper_prefixes_are_stripped():
    state = {"module._orig_mod.0.weight": 1, "module.0.bias": 2, "head.weight": 3}
    assert strip_wrapper_prefixes(state) == {"0.weight": 1, "0.bias": 2, "head.weight": 3}
