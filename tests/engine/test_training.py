"""Pins a short run's loss curve under a fixed seed: a refactor must keep it (torchtitan's rule).

One process (world size 1, gloo): the loop, the sharding, the loss scaling, the warm-up and
cosine schedule and the optimizer, exactly as the workers run them.
"""

import pytest
import torch
import torch.distributed as dist

from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data import tensors
from trainyard.data.split import SplitSchema, prepare_splits
from trainyard.data.tables import write_digits
from trainyard.data.tensors import load_split
from trainyard.dist import DistContext
from trainyard.engine.hooks import CheckpointHook, Hook
from trainyard.engine.live import WRITE_EVERY_S, LiveHook
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.engine.training import lr_text
from trainyard.objectives import Classification, TargetStats
from trainyard.runs.live_files import HISTORY_FILE, curve_rows, read_live, read_live_history

# Per-epoch mean training loss of 3 epochs on digits with the default settings, 1 worker.
PINNED = [1.9676850204346383, 0.39406079944155004, 0.13211681530792369]


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


def train_digits(
    folder, group, extra_hooks=(), checkpoint=None, writer=None, tracker=None, tracking=None,
    **train_settings,
):  # fmt: skip
    """3 epochs on digits with the default settings, 1 worker, as the workers run them."""
    config = TrainyardConfig.model_validate(
        {
            "train": {"workers": 1, "epochs": 3, **train_settings},
            "checkpoint": checkpoint or {},
            "tracking": tracking or {},
        }
    )
    write_digits(folder / "digits.csv")
    schema = prepare_splits(config.data, config.split, folder / "digits.csv", folder / "processed")
    train_split = load_split(folder / "processed", "train", schema)
    val_split = load_split(folder / "processed", "val", schema)
    torch.set_num_threads(1)
    return train(
        group, config, train_split, val_split, Classification(TargetStats(len(schema.classes))),
        tracker or NullTracker(0), writer or NullCheckpointWriter(), {}, extra_hooks=extra_hooks,
    )  # fmt: skip


def test_short_run_loss_curve_is_pinned(tmp_path, single_process_group):
    outcome = train_digits(tmp_path, single_process_group)
    losses = [row["train_loss"] for row in outcome.history]
    assert losses == pytest.approx(PINNED, rel=1e-5), losses
    assert losses[-1] < losses[0]


def test_bf16_autocast_learns_like_fp32(tmp_path, single_process_group):
    """The bf16 path (autocast; on CPU too) changes the arithmetic, not the learning."""
    outcome = train_digits(tmp_path, single_process_group, precision="bf16")
    losses = [row["train_loss"] for row in outcome.history]
    assert losses != pytest.approx(PINNED, rel=1e-5)  # bf16 arithmetic did run
    assert losses == pytest.approx(PINNED, rel=0.1), losses
    assert outcome.history[-1]["val_accuracy"] >= 0.9
    assert next(outcome.model.parameters()).dtype == torch.float32


def test_a_small_table_held_in_memory_trains_the_very_weights_read_from_its_arrays(
    tmp_path, single_process_group, monkeypatch
):
    in_memory = train_digits(tmp_path, single_process_group)
    split = load_split(tmp_path / "processed", "train", SplitSchema.read(tmp_path / "processed"))
    assert isinstance(tensors.resident(split, torch.device("cpu")), tensors.TensorSplit)
    monkeypatch.setattr(tensors, "HOST_RESIDENT_BYTES", 0)  # as if too large to hold
    assert tensors.resident(split, torch.device("cpu")) is split
    streamed = train_digits(tmp_path, single_process_group)
    assert [h["train_loss"] for h in in_memory.history] == [
        h["train_loss"] for h in streamed.history
    ]
    for a, b in zip(in_memory.model.parameters(), streamed.model.parameters(), strict=True):
        assert torch.equal(a, b)


class _RecordingTracker(NullTracker):
    def __init__(self):
        super().__init__(0)
        self.points: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.points.append((step, metrics))


@pytest.mark.parametrize(
    ("min_interval_s", "expected_steps", "expected_rows"),
    [
        (0, [s for s in range(5, 121, 5)], [40, 80, 120]),  # every 5 steps, 40 an epoch
        # None mid-epoch, and epoch rows (each with its last window) only when due: the first,
        # then the last, which waited for the end of training.
        (3600, [40, 120], [40, 120]),
    ],
)
def test_tracking_points_come_every_n_steps_and_never_more_often_than_min_interval(
    tmp_path, single_process_group, min_interval_s, expected_steps, expected_rows
):
    tracker = _RecordingTracker()
    tracking = {"log_every_n_steps": 5, "min_interval_s": min_interval_s}
    outcome = train_digits(tmp_path, single_process_group, tracker=tracker, tracking=tracking)
    windows = [(step, m) for step, m in tracker.points if "samples_per_s" in m]
    assert [step for step, _ in windows] == expected_steps
    assert all(m["loss"] > 0 and m["step_time_s"] > 0 for _, m in windows)
    rows = [(step, m) for step, m in tracker.points if "val_accuracy" in m]
    assert [step for step, _ in rows] == expected_rows
    # The last row logged is the last epoch's, whenever it was held back.
    assert rows[-1][1]["val_accuracy"] == outcome.history[-1]["val_accuracy"]
    assert len(outcome.history) == 3  # the run record keeps every epoch


def test_adamw_with_gradient_clipping_learns_digits(tmp_path, single_process_group):
    outcome = train_digits(
        tmp_path, single_process_group, optimizer="adamw", lr=0.002, grad_clip_norm=1.0
    )
    losses = [row["train_loss"] for row in outcome.history]
    assert losses != pytest.approx(PINNED, rel=1e-3)  # another optimizer did run
    assert losses[-1] < losses[0] / 3 and outcome.history[-1]["val_accuracy"] >= 0.9, losses


class _StopAfter(Hook):
    """A pruner's shape: it reads the epoch's row and ends training there."""

    def __init__(self, epochs: int):
        self.epochs = epochs

    def on_epoch_end(self, state, row):
        state.stop = row["epoch"] >= self.epochs


def test_the_epoch_a_hook_stops_at_is_logged_even_when_its_row_was_not_due(
    tmp_path, single_process_group
):
    """The pruner runs after the tracking hook, which cannot know the epoch is the last."""
    tracker = _RecordingTracker()
    outcome = train_digits(
        tmp_path, single_process_group, tracker=tracker, extra_hooks=[_StopAfter(2)],
        tracking={"min_interval_s": 3600},
    )  # fmt: skip
    rows = [m["val_accuracy"] for _, m in tracker.points if "val_accuracy" in m]
    assert rows == [row["val_accuracy"] for row in outcome.history] and len(rows) == 2


def test_a_hook_ends_training_cleanly_at_an_epochs_end_which_is_checkpointed(
    tmp_path, single_process_group
):
    """That epoch is the run's last: its checkpoint is taken (here no other is due), so the
    job scores its final weights itself, with no second launch."""
    writer = _StepsSaved()
    outcome = train_digits(
        tmp_path, single_process_group, extra_hooks=[_StopAfter(2)], writer=writer,
        checkpoint={"every_n_epochs": 10},
    )  # fmt: skip
    assert [row["epoch"] for row in outcome.history] == [1, 2]
    assert [row["train_loss"] for row in outcome.history] == pytest.approx(PINNED[:2], rel=1e-5)
    assert writer.steps == [outcome.steps] and outcome.steps == 2 * 40


def test_the_live_status_is_written_at_most_once_a_second_and_at_the_last_epochs_end(
    tmp_path, single_process_group
):
    """Epochs of a few ms would each rewrite the progress bar's file; the last epoch's
    status (its step and validation metric) is always there when training ends."""
    path = tmp_path / "staging" / "run" / "live.json"
    seen = _StatusesSeen(path)
    live = LiveHook(path, "run", epochs=20, world_size=1, monitor="accuracy")
    outcome = train_digits(
        tmp_path, single_process_group, extra_hooks=[live, seen], epochs=20, batch_size=512
    )
    final = read_live(path)
    assert (final.epoch, final.step) == (20, outcome.steps)
    assert final.monitor_value == outcome.history[-1]["val_accuracy"]
    # The first step's write, then each at least a second after the one before, but the last.
    writes = sorted(seen.writes)
    assert len(writes) <= 2 + (writes[-1] - writes[0]) / WRITE_EVERY_S, writes
    assert len(writes) < 20  # 60 steps of digits take well under the 18 s that would allow it
    # The curves so far, beside it for `trainyard ui`: every epoch's, once training ends.
    curves = read_live_history(path.parent / HISTORY_FILE)
    assert curves == curve_rows(outcome.history) and len(curves) == 20
    assert set(curves[0]) == {"epoch", "train_loss", "val_loss", "val_accuracy"}


class _StatusesSeen(Hook):
    """The distinct statuses found in the live file after each epoch's end."""

    def __init__(self, path):
        self.path, self.writes = path, set()

    def on_epoch_end(self, state, row):
        self.writes.add(read_live(self.path).written_at)


class _StepsSaved(NullCheckpointWriter):
    """Rank 0's writer, reduced to the steps it was asked to save."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def save(self, step, state, meta, **_):
        self.steps.append(step)


@pytest.mark.parametrize("minutes", [1e-9, 1e4])
def test_time_cadence_checkpoints_mid_epoch_once_the_minutes_have_passed(
    tmp_path, single_process_group, minutes
):
    """every_n_minutes is checked every CLOCK_CHECK_EVERY steps: a cadence shorter than those
    steps saves at each check, a longer one only at the end (every_n_epochs is 10 here)."""
    writer = _StepsSaved()
    checkpoint = {"every_n_epochs": 10, "every_n_minutes": minutes}
    outcome = train_digits(tmp_path, single_process_group, checkpoint=checkpoint, writer=writer)
    final = outcome.steps
    if minutes > 1:
        assert writer.steps == [final]
        return
    every = CheckpointHook.CLOCK_CHECK_EVERY
    steps_per_epoch = final // 3
    ends = {steps_per_epoch * e for e in (1, 2, 3)}  # due at each epoch end too
    assert set(writer.steps) == {s for s in range(every, final, every)} | ends


def test_the_plan_says_when_linear_scaling_moves_the_learning_rate(
    tmp_path, single_process_group, caplog
):
    caplog.set_level("INFO", logger="trainyard.engine.training")
    train_digits(tmp_path, single_process_group, epochs=1, batch_size=256)
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("training "))
    assert plan.endswith(
        "lr 0.4 (train.lr 0.05 scaled linearly: global batch 256 / "
        "train.lr_reference_batch_size 32)"
    ), plan
    unscaled = TrainyardConfig.model_validate({"train": {"workers": 2, "batch_size": 16}})
    assert lr_text(unscaled) == "lr 0.05", "the value the user set, unchanged, says no more"
