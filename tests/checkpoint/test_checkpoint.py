import copy
import io
import os
import socket
import time
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainyard.checkpoint.layout import MANIFEST_FILE, STATE_FILE, checkpoint_key, checkpoint_steps
from trainyard.checkpoint.reader import load_checkpoint, strip_wrapper_prefixes
from trainyard.checkpoint.snapshot import cpu_snapshot, file_info, save_without_gil
from trainyard.checkpoint.writer import CheckpointWriter, remove_empty_staging
from trainyard.config import CheckpointConfig
from trainyard.engine.train_state import by_parameter_name
from trainyard.errors import CheckpointError
from trainyard.storage import Store, StoreSettings

from tests_support import manifest_fields


@pytest.fixture
def writer(store, tmp_path):
    return CheckpointWriter(store, "run-1", tmp_path / "staging")


def commit(writer, step, state, meta):
    """Save, then wait until the background uploader has committed it."""
    uri = writer.save(step, state, meta)
    writer.close()
    return uri


def test_committed_checkpoint_round_trips_through_the_store(store, writer):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1, "step": 10}
    uri = commit(writer, 10, state, manifest_fields(epoch=1))
    assert uri == store.uri(checkpoint_key("run-1", 10)) and uri.endswith(
        "checkpoints/step-00000010"
    )
    loaded, manifest = load_checkpoint(store, uri)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert manifest.step == 10 and manifest.epoch == 1 and manifest.files[STATE_FILE].size > 0
    assert writer.committed == [uri]


def test_the_hash_taken_as_a_state_is_written_is_the_written_files(tmp_path):
    """The manifest's size and sha256 come from the bytes as torch.save writes them, not
    from reading the file back: they must be the file's, or every load refuses it."""
    state = {
        "model": {"w": torch.randn(300_000), "b": torch.arange(7), "half": torch.ones(3).half()},
        "optimizer": {"step": 12, "lrs": [0.1, 0.01]},
        "rng": torch.get_rng_state(),
    }
    entry = save_without_gil(state, tmp_path / "state.pt")
    assert entry == file_info(tmp_path / "state.pt")
    assert entry.size > 300_000 * 4
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_a_checkpoint_holds_the_state_as_it_was_when_saved(store, writer):
    """Saving snapshots the state: the training loop goes on changing its tensors (in place,
    like an optimizer step) while the uploader serializes the copy."""
    weights = torch.zeros(1_000_000)
    state = {"model": {"w": weights}, "history": [{"loss": 1.0}]}
    uri = writer.save(1, state, manifest_fields())
    weights.add_(1.0)
    state["history"].append({"loss": 0.5})
    writer.close()
    loaded, _ = load_checkpoint(store, uri)
    assert torch.count_nonzero(loaded["model"]["w"]) == 0 and loaded["history"] == [{"loss": 1.0}]


def test_a_snapshot_reuses_an_earlier_snapshots_memory_where_shapes_match():
    state = {"w": torch.arange(6.0), "b": torch.ones(2), "opt": [torch.zeros(3)], "step": 4}
    first = cpu_snapshot(state)
    state["w"].add_(10.0)
    state["b"] = torch.ones(5)  # a new shape: fresh memory
    second = cpu_snapshot(state, reuse=first)
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert second["opt"][0].data_ptr() == first["opt"][0].data_ptr()
    assert second["w"].data_ptr() != state["w"].data_ptr()  # a copy, not the live tensor
    assert torch.equal(second["w"], torch.arange(6.0) + 10) and second["b"].shape == (5,)
    assert second["step"] == 4


def test_each_checkpoint_keeps_its_own_values_when_the_next_snapshot_reuses_its_memory(
    store, writer
):
    """The writer copies a new checkpoint into the memory of the last one once that one is
    written to staging, never before: both load with the values they were saved with."""
    weights = torch.zeros(100_000)
    first = writer.save(1, {"model": {"w": weights}}, manifest_fields())
    while writer.staged_steps():
        time.sleep(0.01)
    spare = writer._spare["model"]["w"].data_ptr()
    weights.add_(1.0)
    second = writer.save(2, {"model": {"w": weights}}, manifest_fields())
    while writer.staged_steps():
        time.sleep(0.01)
    assert writer._spare["model"]["w"].data_ptr() == spare  # step 2 was copied into it
    writer.close()
    assert writer._spare is None  # the memory is not held past the writer
    assert torch.count_nonzero(load_checkpoint(store, first)[0]["model"]["w"]) == 0
    assert torch.equal(load_checkpoint(store, second)[0]["model"]["w"], torch.ones(100_000))


def test_a_manifest_that_is_not_one_is_refused_naming_the_field(store, writer):
    uri = commit(writer, 4, {"model": {}}, manifest_fields())
    key = f"{store.key_of(uri)}/{MANIFEST_FILE}"
    manifest = store.read_json(key)
    del manifest["world_size"]
    store.write_json(key, manifest)
    with pytest.raises(CheckpointError, match=r"is not a checkpoint manifest \(world_size: Field"):
        load_checkpoint(store, uri)


def test_committed_checkpoints_are_never_overwritten(writer):
    writer.save(5, {"step": 5}, manifest_fields())
    with pytest.raises(CheckpointError, match="already committed"):
        writer.save(5, {"step": 6}, manifest_fields())


def test_checkpoint_without_manifest_is_not_loaded(store):
    key = checkpoint_key("run-2", 1)
    buffer = io.BytesIO()
    torch.save({"step": 1}, buffer)
    store.put_bytes(f"{key}/{STATE_FILE}", buffer.getvalue())
    with pytest.raises(CheckpointError, match="has no manifest.json: it was never committed"):
        load_checkpoint(store, store.uri(key))


def test_tampered_checkpoint_is_refused(store, writer):
    uri = commit(writer, 3, {"model": {"w": torch.ones(4)}}, manifest_fields())
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
    # a valid manifest for a malicious file
    uri = commit(writer, 7, {"model": {}, "extra": Payload()}, manifest_fields())
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(store, uri)
    assert not (tmp_path / "PWNED").exists()
    assert store.exists(f"{store.key_of(uri)}/{MANIFEST_FILE}")


def test_wrapper_prefixes_are_stripped():
    state = {"module._orig_mod.0.weight": 1, "module.0.bias": 2, "head.weight": 3}
    assert strip_wrapper_prefixes(state) == {"0.weight": 1, "0.bias": 2, "head.weight": 3}


def test_retention_keeps_the_last_k_the_best_and_pinned(store, tmp_path):
    config = CheckpointConfig(keep_last=2, pinned_steps=[1], max_staged=10)
    writer = CheckpointWriter(store, "kept", tmp_path / "staging", config)
    accuracy = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.6, 5: 0.8, 6: 0.8}
    for step, value in accuracy.items():
        writer.save(step, {"step": step}, manifest_fields(metrics={"val_accuracy": value}))
    writer.close()

    def has(step, name):
        return store.exists(f"{checkpoint_key('kept', step)}/{name}")

    assert [s for s in checkpoint_steps(store, "kept") if has(s, MANIFEST_FILE)] == [1, 2, 5, 6]
    assert not has(3, STATE_FILE) and not has(4, STATE_FILE)
    assert writer.committed == [store.uri(checkpoint_key("kept", s)) for s in (1, 2, 5, 6)]
    for uri in writer.committed:
        load_checkpoint(store, uri)  # every retained one verifies
    assert not list((tmp_path / "staging" / "kept").iterdir())  # committed: local copy gone


def test_a_writer_keeps_up_when_the_last_checkpoints_trip_fits_the_share_of_time(
    store, writer, tmp_path
):
    """checkpoint.max_overhead: one more checkpoint fits when the last one's snapshot-to-
    retention time is at most that share of the time since it was taken. The first one's
    time holds one-time work, so it is not extrapolated: the second is taken at once."""
    state = {"model": {"w": torch.zeros(10_000)}}
    first_only = CheckpointWriter(store, "first-only", tmp_path / "staging")
    assert first_only.keeps_up(since_last_s=0.0, max_overhead=0.03)  # no cost known yet
    commit(first_only, 1, state, manifest_fields())
    assert first_only.last_absorb_s is None
    assert first_only.keeps_up(since_last_s=0.0, max_overhead=0.03)
    writer.save(1, state, manifest_fields())
    commit(writer, 2, state, manifest_fields())  # close() waits for both
    cost = writer.last_absorb_s
    assert cost is not None and cost > 0
    assert writer.keeps_up(since_last_s=cost / 0.03 * 1.01, max_overhead=0.03)
    assert not writer.keeps_up(since_last_s=cost / 0.03 * 0.99, max_overhead=0.03)


def test_an_error_after_a_commit_fails_the_writer_at_once_instead_of_hanging(
    store, writer, monkeypatch
):
    """Whatever breaks on the uploader thread ends it with a failure close() reports, not
    a thread gone silently while close() waits checkpoint.upload_timeout_s (600 s)."""

    def broken_retention() -> None:
        raise RuntimeError("retention bug")

    monkeypatch.setattr(writer, "_retain", broken_retention)
    writer.save(1, {"w": torch.zeros(3)}, manifest_fields())
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="upload of step 1 failed: retention bug"):
        writer.close()
    assert time.monotonic() - started < 60


def test_unreachable_store_bounds_staging_and_fails_clearly_keeping_local_copies(tmp_path):
    with socket.socket() as s:  # a loopback port nobody listens on: the store is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = Store(StoreSettings("trainyard", "x", f"http://127.0.0.1:{port}", "k", "s"))
    config = CheckpointConfig(max_staged=2, upload_backoff_s=0.05, upload_backoff_max_s=0.2)
    writer = CheckpointWriter(down, "offline", tmp_path / "staging", config)
    for step in (1, 2, 3, 4):
        writer.save(step, {"step": step}, manifest_fields())
    # Snapshots go to disk while the store is down (memory does not hold the backlog), and
    # the dropped ones' folders go away, all before close().
    folders = tmp_path / "staging" / "offline"
    deadline = time.monotonic() + 60
    while sorted(p.parent.name for p in folders.glob("step-*/" + STATE_FILE)) != [
        f"step-0000000{s}" for s in (1, 4)
    ] or any(folders.glob("step-0000000[23]")):
        assert time.monotonic() < deadline, sorted(p.name for p in folders.rglob("*"))
        time.sleep(0.05)
    # While checkpoints wait for the store, another would only queue: the epoch skips it.
    assert not writer.keeps_up(since_last_s=1e9, max_overhead=0.5)
    with pytest.raises(CheckpointError, match=r"did not finish within .*=2s \(steps \[1, 4\]"):
        writer.close(timeout_s=2)
    staged = sorted(p.name for p in (tmp_path / "staging" / "offline").iterdir())
    assert staged == ["step-00000001", "step-00000004"]  # the oldest and the newest stay
    assert (tmp_path / "staging/offline/step-00000004" / STATE_FILE).stat().st_size > 0


def test_remove_empty_staging_keeps_folders_with_files(tmp_path):
    for empty in ("step-00000001", "restore-rank1/step-00000002", "restore-rank2"):
        (tmp_path / empty).mkdir(parents=True)
    for kept in ("step-00000003", "restore-rank3/step-00000003"):
        (tmp_path / kept).mkdir(parents=True)
        (tmp_path / kept / STATE_FILE).write_bytes(b"waiting for the store")
    (tmp_path / "other").mkdir()  # not staging's: left alone
    remove_empty_staging(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_dir())
    assert left == ["other", "restore-rank3", "restore-rank3/step-00000003", "step-00000003"]


def test_close_leaves_no_empty_staging_folder(store, tmp_path):
    writer = CheckpointWriter(store, "tidy", tmp_path / "staging", CheckpointConfig(keep_last=2))
    staging = tmp_path / "staging" / "tidy"
    # What an earlier attempt can leave: a dropped checkpoint's folder, an emptied restore.
    (staging / "step-00000099").mkdir(parents=True)
    (staging / "restore-rank1" / "step-00000001").mkdir(parents=True)
    for step in (1, 2, 3):
        writer.save(step, {"step": step}, manifest_fields())
    writer.close()
    assert [load_checkpoint(store, uri)[1].step for uri in writer.committed] == [2, 3]
    assert not any(p.is_dir() for p in staging.rglob("*"))


def test_sharded_checkpoint_metadata_with_a_pickled_callable_is_refused(tmp_path, monkeypatch):
    import pickle

    from trainyard.checkpoint.sharded import METADATA_FILE, load_shards

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / METADATA_FILE).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="holds objects other than checkpoint metadata"):
        load_shards(torch.nn.Linear(2, 2), None, folder)
    assert not (tmp_path / "PWNED").exists()


def test_sharded_checkpoint_value_with_a_pickled_callable_is_refused(tmp_path, monkeypatch):
    """DCP keeps non-tensor values (optimizer param groups) as pickles inside the shards and
    its default planner loads them with weights_only=False; ours must refuse them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainyard.checkpoint.sharded import load_shards

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = Payload()
    folder = tmp_path / "shards"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    with pytest.raises(CheckpointError, match="holds objects other than tensors and plain data"):
        load_shards(model, optimizer, folder)
    assert not (tmp_path / "PWNED").exists()


def test_sharded_checkpoint_round_trips_model_and_optimizer(tmp_path):
    from trainyard.checkpoint.sharded import load_shards, save_shards

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_shards(model, optimizer, tmp_path / "shards")
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    load_shards(fresh, fresh_optimizer, tmp_path / "shards")
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(fresh_optimizer.state[fresh.weight]["momentum_buffer"], momentum)


def test_an_optimizer_state_saved_by_position_loads_by_parameter_name():
    """Checkpoints written before the DCP state-dict API keyed optimizer state by position."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    legacy = copy.deepcopy(optimizer.state_dict())
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    set_state_dict(
        model,
        fresh,
        model_state_dict=model.state_dict(),
        optim_state_dict=by_parameter_name(copy.deepcopy(legacy), model),
    )
    restored = fresh.state_dict()
    assert restored["param_groups"][0]["params"] == legacy["param_groups"][0]["params"]
    for index, moments in legacy["state"].items():
        for name, value in moments.items():
            assert torch.equal(
                torch.as_tensor(restored["state"][index][name]), torch.as_tensor(value)
            )
