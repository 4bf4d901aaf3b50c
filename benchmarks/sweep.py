"""9. Sweeps: ASHA against no pruning over the same trials budget (wall time, best value,
trials pruned), and what a trial costs beyond its training (start-up and teardown).

Both arms are `trainyard sweep run` as a user types it (the project's Prefect server) on the same
project, space, random sampler and seed, so trial n trains the same learning rate in both
and the pruner is the only difference. train.lr log-uniform over 1e-4..0.3 on a wide MLP is
a space where many trials are clearly bad after one epoch: where pruning pays. Two trials at
a time of one worker each (2 cores), tracking off. Each arm runs 3 sweeps, interleaved
with the other's (1 in quick mode), and the ratios are of the arms' medians.

A trial's overhead is its duration (Optuna's start to finish) minus its training loop (the
sum of its epochs' epoch_s: steps, validation, checkpoint, the pruner's question), cut into
start-up (trial start -> first step) and teardown (the rest); over the no-pruning arm's
trials, and for one trial alone whose loop trains about 30 s (quick mode reads the
no-pruning arm's trials instead).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from benchmarks.common import BIN, BenchProject, _env, prepare_run_split, ratio, summary
from trainyard.runs.record import RunRecord, load_record
from trainyard.storage import Store, StoreSettings
from trainyard.sweeps.record import load_sweep
from trainyard.sweeps.report import load_study

SPACE = {"train.lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True}}
SETTINGS = [
    f"sweep.space={json.dumps(SPACE)}",
    "sweep.sampler=random",  # draws do not depend on results: both arms train the same rates
    "sweep.seed=0",
    "sweep.min_epochs=1",
    "sweep.max_concurrent_trials=2",
    "train.workers=1",
    "train.threads_per_worker=1",
    "tracking.backend=none",
    # Steps of some milliseconds, so a full trial trains for a while (the default MLP's
    # epochs take a few hundredths of a second, far below a trial's start-up).
    "model.options.hidden_sizes=[1024,1024]",
]
OBJECTIVE = "val_accuracy"


# What Optuna leaves optional is always set on a finished trial of a finished sweep.
def started_at(trial: FrozenTrial) -> float:
    assert trial.datetime_start is not None
    return trial.datetime_start.timestamp()


def ended_at(trial: FrozenTrial) -> float:
    assert trial.datetime_complete is not None
    return trial.datetime_complete.timestamp()


def value_of(trial: FrozenTrial) -> float:
    assert trial.value is not None
    return trial.value


@dataclass
class SweepRun:
    wall_s: float
    launched: float  # unix time `trainyard sweep run` started
    ended: float
    trials: list[FrozenTrial]
    records: dict[int, RunRecord]  # by trial number

    def completed(self) -> list[FrozenTrial]:
        return [t for t in self.trials if t.state == TrialState.COMPLETE]

    def count(self, state: TrialState) -> int:
        return sum(t.state == state for t in self.trials)

    def best(self) -> float:
        return max(value_of(t) for t in self.completed())


def run(project: BenchProject, quick: bool) -> dict:
    n_trials, epochs, alone_s, reps = (2, 1, 2.0, 1) if quick else (16, 40, 30.0, 3)
    budget = [f"sweep.n_trials={n_trials}", f"train.epochs={epochs}"]
    # A failing trial must not stop an arm early (sweep.max_failed_trials); it is counted.
    budget.append(f"sweep.max_failed_trials={n_trials + 1}")
    prepare_run_split(project, SETTINGS)  # the split cache is warm: no arm pays for it
    pruners = ("none",) if quick else ("none", "asha")  # quick (a smoke test): one arm
    # Which trials ASHA prunes depends on the order two packed trials finish in, so one
    # sweep per arm moves the ratio by ~0.07: arms interleaved, medians of `reps`.
    arms: dict[str, list[SweepRun]] = {pruner: [] for pruner in pruners}
    for _ in range(reps):
        for pruner, runs in arms.items():
            runs.append(run_sweep(project, [*budget, f"sweep.pruner={pruner}"]))
    nones = arms["none"]
    ashas = arms.get("asha", nones)
    alone = nones[0]  # quick mode (a smoke test): the no-pruning arm's trials stand in
    if not quick:
        alone = run_sweep(
            project,
            [
                "sweep.n_trials=1",
                f"train.epochs={max(1, round(alone_s / _epoch_alone_s(nones)))}",
                "sweep.pruner=none",
                "sweep.max_concurrent_trials=1",
            ],
        )
    figures = {
        "no pruning, wall s": summary([r.wall_s for r in nones]),
        "asha, wall s": summary([r.wall_s for r in ashas]),
    }
    figures |= _sweep_ends([*nones, *ashas, alone])
    figures |= _trial_figures("no pruning, per trial", trial_costs(*nones))
    figures |= _trial_figures(f"one trial alone (~{alone_s:g} s of training)", trial_costs(alone))
    ratios = _arm_ratios(nones, ashas, n_trials) | _overhead_ratios(nones, alone, alone_s)
    return {"figures": figures, "ratios": ratios}


def _epoch_alone_s(sweeps: list[SweepRun]) -> float:
    """The fastest tenth of the packed epochs (trained while the other slot was starting
    up) is the nearest to an epoch alone; the median would leave the trial alone short."""
    packed = sorted(
        row["epoch_s"]
        for sweep in sweeps
        for t in sweep.completed()
        for row in sweep.records[t.number].history
    )
    return packed[len(packed) // 10]


def run_sweep(project: BenchProject, overrides: list[str]) -> SweepRun:
    """`trainyard sweep run` with SETTINGS and `overrides`, then its study and trials' run
    records, read in-process (what `sweep show` and `runs show` print)."""
    flags = [arg for override in [*SETTINGS, *overrides] for arg in ("-S", override)]
    launched = time.time()
    done = subprocess.run(
        [str(BIN / "trainyard"), "sweep", "run", *flags],
        cwd=project.root, env=project.env(), capture_output=True, text=True,
    )  # fmt: skip
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(
            f"trainyard sweep run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    sweep_id = done.stdout.splitlines()[0].removeprefix("sweep ").strip()
    with _env(project.env()):
        store = Store(StoreSettings.from_worker_env())
        trials = load_study(load_sweep(store, sweep_id)).get_trials(deepcopy=False)
        records = {t.number: load_record(store, t.user_attrs["run_id"]) for t in trials}
    return SweepRun(ended - launched, launched, ended, trials, records)


def trial_costs(*sweeps: SweepRun) -> dict[str, list[float]]:
    """Each completed trial's duration, its training loop and the rest (the overhead), the
    rest cut two ways: around the loop (start-up, teardown) and by who spends it."""
    costs: dict[str, list[float]] = {}
    for sweep, trial in ((s, t) for s in sweeps for t in s.completed()):
        record = sweep.records[trial.number]
        # Optuna stores naive local times; this machine's local zone reads them back.
        start, end = started_at(trial), ended_at(trial)
        loop = sum(row["epoch_s"] for row in record.history)
        assert record.first_step_at is not None  # a completed trial took its first step
        startup = record.first_step_at - start  # includes the first step, a few ms
        timings = record.timings_s
        parts = {
            "duration": end - start,
            "training loop": loop,
            "start-up (trial start -> first step)": startup,
            "teardown (last epoch -> trial done)": end - start - startup - loop,
            "overhead (duration - training loop)": end - start - loop,
            # The same overhead by where it is spent:
            "sweep's trial task and the run flow's start and end": end - start - timings["total"],
            "run flow outside its training task (split, records)": timings["total"]
            - timings["train"],
            # On persistent workers: handing the job over, data, model, the job's end.
            "training task outside its loop": timings["train"] - loop,
        }
        for name, seconds in parts.items():
            costs.setdefault(name, []).append(seconds)
    return costs


def _trial_figures(label: str, costs: dict[str, list[float]]) -> dict:
    return {f"{label}, {name} s": summary(values) for name, values in costs.items()}


def _sweep_ends(sweeps: list[SweepRun]) -> dict:
    """What every sweep pays once, whatever its trials: from launch to its first trial's
    start (CLI, the project's Prefect server, store check, DVC, study), and from its last trial's
    end to the command's exit."""
    starts = [min(started_at(t) for t in s.trials) - s.launched for s in sweeps]
    ends = [s.ended - max(ended_at(t) for t in s.trials) for s in sweeps]
    return {
        "sweep start (launch -> first trial start), s": summary(starts),
        "sweep end (last trial done -> exit), s": summary(ends),
    }


def _arm_ratios(nones: list[SweepRun], ashas: list[SweepRun], n_trials: int) -> dict[str, float]:
    """ASHA against its baseline, no pruning, from the same run of this benchmark: ratios
    of the arms' medians."""

    def trials_phase(sweep: SweepRun) -> float:  # the part of the wall time pruning can cut
        starts = [started_at(t) for t in sweep.trials]
        return max(ended_at(t) for t in sweep.trials) - min(starts)

    def median(values) -> float:
        return statistics.median(list(values))

    dataset = next(iter(nones[0].records.values())).dataset
    assert dataset is not None  # a trial's run records the split it trained on
    val_rows = dataset.split_rows["val"]
    best, asha_best = median(r.best() for r in nones), median(r.best() for r in ashas)
    # One val accuracy's binomial standard error, no finer than one row of the split.
    noise = max(math.sqrt(best * (1 - best) / val_rows), 1 / val_rows)
    failed = sum(r.count(TrialState.FAIL) for r in [*nones, *ashas])
    return {
        "asha / no pruning, wall (target <= 0.4)": ratio(
            [r.wall_s for r in ashas], [r.wall_s for r in nones]
        ),
        "asha / no pruning, trials phase (first trial start -> last trial done)": ratio(
            [trials_phase(r) for r in ashas], [trials_phase(r) for r in nones]
        ),
        f"asha, trials pruned (of {n_trials}), median": median(
            r.count(TrialState.PRUNED) for r in ashas
        ),
        "trials failed, all arms' sweeps (expected 0)": failed,
        f"no pruning, best {OBJECTIVE} (median)": best,
        f"asha, best {OBJECTIVE} (median)": asha_best,
        f"standard error of the best {OBJECTIVE} ({val_rows} val rows)": noise,
        f"(no pruning - asha) best {OBJECTIVE} / standard error (target <= 2)": (
            (best - asha_best) / noise
        ),
    }


def _overhead_ratios(nones: list[SweepRun], alone: SweepRun, alone_s: float) -> dict[str, float]:
    def median_share(costs: dict[str, list[float]], of: str) -> float:
        pairs = zip(costs["overhead (duration - training loop)"], costs[of], strict=True)
        return statistics.median(overhead / seconds for overhead, seconds in pairs)

    packed, single = trial_costs(*nones), trial_costs(alone)
    return {
        "no pruning trials, overhead / training loop": median_share(packed, "training loop"),
        "no pruning trials, overhead / duration": median_share(packed, "duration"),
        f"one trial alone (~{alone_s:g} s of training), overhead / training loop "
        "(target <= 0.10)": median_share(single, "training loop"),
    }
