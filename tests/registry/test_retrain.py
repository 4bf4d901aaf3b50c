"""Retraining end to end (real runs, store, registry and Prefect), and its decision rule."""

from __future__ import annotations

import pytest

from trainyard.checkpoint.resume import ResumeRefused
from trainyard.config import PromoteConfig
from trainyard.registry import list_versions, read_aliases, read_history, version_uri
from trainyard.registry.retraining import challenger_start, decide, list_decisions
from trainyard.runs.record import list_records, load_record
from trainyard.util.documents import Skipped


def run_count(store) -> int:
    """How many run records the store holds, every one of them readable."""
    skipped = Skipped()
    count = len(list_records(store, skipped))
    assert not skipped.documents, skipped.documents
    return count


def drop_last_rows(project, count: int) -> None:
    """A new version of the dataset: the same file without its last rows."""
    digits = project / "data/raw/digits.csv"
    lines = digits.read_text().splitlines(keepends=True)
    digits.write_text("".join(lines[:-count]))


def rename_class(project, old: str, new: str) -> None:
    """A new version of the dataset whose label `old` is spelled `new` (the last column)."""
    digits = project / "data/raw/digits.csv"
    header, *rows = digits.read_text().splitlines()
    cells = [row.rsplit(",", 1) for row in rows]
    renamed = [f"{x},{new if label == old else label}" for x, label in cells]
    digits.write_text("\n".join([header, *renamed]) + "\n")


@pytest.mark.slow
@pytest.mark.distributed
def test_retraining_skips_unchanged_data_and_promotes_only_a_better_model(
    project, store, prefect_api
):
    from flows.retrain import retrain

    base = ["train.workers=1", "tracking.backend=none"]
    weak = [*base, "train.epochs=1", "train.lr=0.0005", "retrain.init=champion"]
    good = [*base, "train.epochs=4"]

    first = retrain(overrides=weak)  # no champion yet: the floor decides
    assert first.action == "promoted" and first.challenger_version == 1
    # retrain.init: champion, with no champion to start from: fresh weights, and it says so.
    assert first.init == "champion" and first.warm_start_version is None
    assert "there was no champion yet" in challenger_start(first)
    assert load_record(store, first.run_id).resume_checkpoint is None
    assert read_aliases(store, "trainyard") == {"champion": 1, "challenger": 1}

    again = retrain(overrides=good)  # the champion's own data
    assert again.action == "skipped" and "nothing new to learn" in again.reason
    assert len(list_versions(store, "trainyard")) == 1 and run_count(store) == 1

    drop_last_rows(project, 50)  # an accuracy cannot improve by more than 1: kept
    kept = retrain(overrides=[*good, "promote.min_delta=1.0"])
    assert kept.action == "kept" and kept.challenger_value > kept.champion_value
    assert "does not beat" in kept.reason
    assert read_aliases(store, "trainyard") == {"champion": 1, "challenger": 2}

    drop_last_rows(project, 50)
    better = retrain(overrides=good)
    assert better.action == "promoted" and better.champion_version == 1
    assert better.challenger_value > better.champion_value
    assert read_aliases(store, "trainyard") == {"champion": 3, "challenger": 3}
    change = [e for e in read_history(store, "trainyard") if e.alias == "champion"][-1]
    assert (change.from_version, change.to_version) == (1, 3)
    assert change.evidence.from_value == better.champion_value  # both on the same test rows
    assert change.evidence.to_value == better.challenger_value
    assert change.by.startswith("flow-run:")
    actions = [d.action for d in list_decisions(store, "trainyard")]
    assert actions == ["promoted", "skipped", "kept", "promoted"]

    # retrain.init: champion on a new dataset version: the challenger starts from version 3's
    # weights (same model, same columns and classes), with a fresh optimizer and schedule.
    drop_last_rows(project, 50)
    from_champion = [*base, "train.epochs=1", "retrain.init=champion"]
    warm = retrain(overrides=from_champion)
    champion_uri = version_uri(store, "trainyard", 3)
    assert warm.init == "champion" and warm.champion_version == 3
    assert (warm.warm_start_version, warm.warm_start_checkpoint) == (3, champion_uri)
    assert "warm start from champion version 3" in challenger_start(warm)
    run = load_record(store, warm.run_id)
    assert run.warm_start and run.warm_start_from == run.resume_checkpoint == champion_uri
    assert len(run.history) == 1  # its own schedule: one epoch, not the champion's four
    # The champion's weights show: its first epoch is far better than the first epoch of a
    # run from scratch with the same model and learning rate (version 3's own run).
    scratch = load_record(store, better.run_id).history[0]
    assert run.history[0]["train_loss"] < scratch["train_loss"] / 3
    assert run.history[0]["val_accuracy"] > scratch["val_accuracy"]

    # A dataset version whose classes mean other things is refused in one line, before a
    # challenger run is recorded.
    rename_class(project, "9", "nine")
    runs_before = run_count(store)
    refused = r"champion version \d+ of trainyard .*\(classes: '9' there only; 'nine' here only\)"
    with pytest.raises(ResumeRefused, match=refused + ".*set retrain.init: scratch"):
        retrain(overrides=from_champion)
    assert run_count(store) == runs_before


@pytest.mark.parametrize(
    ("challenger", "champion", "mode", "rules", "promoted", "why"),
    [
        (0.9, None, "max", PromoteConfig(), True, "no champion yet"),
        (
            0.4,
            None,
            "max",
            PromoteConfig(min_value=0.5),
            False,
            "misses the promote.min_value floor",
        ),
        (0.91, 0.90, "max", PromoteConfig(min_delta=0.02), False, "does not beat"),
        (0.93, 0.90, "max", PromoteConfig(min_delta=0.02), True, "beats"),
        (0.90, 0.90, "max", PromoteConfig(), False, "does not beat"),  # a tie keeps the champion
        (1.2, 1.5, "min", PromoteConfig(min_delta=0.1), True, "beats"),  # a loss, lower is better
        (1.2, 1.5, "min", PromoteConfig(min_value=1.0), False, "ceiling"),
    ],
)
def test_the_promotion_rule(challenger, champion, mode, rules, promoted, why):
    decided, reason = decide(challenger, champion, "test_metric", mode, rules)
    assert decided is promoted and why in reason
