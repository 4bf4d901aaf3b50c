"""9. Sweeps: ASHA against no pruning over the same trials budget (wall time, best value,
trials pruned), and what a trial costs beyond its training (start-up and teardown).

Both arms are `trainyard sweep run` as a user types it (Prefect's temporary API) on the same
project, space, random sampler and seed, so trial n trains the same learning rate in both
and the pruner is the only difference. train.lr log-uniform over 1e-4..0.3 on a wide MLP is
a space where many trials are clearly bad after one epoch: where pruning pays. Two trials at
a time of one worker each (2 cores), tracking off.

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

from benchmarks.common import BIN, BenchProject, _env, prepare_run_split, summary
from trainyard.runs import RunRecord, load_record
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
        return max(t.value for t in self.completed())


def run(project: BenchProject, quick: bool) -> dict:
    n_trials, epochs, alone_s = (2, 1, 2.0) if quick else (16, 40, 30.0)
    budget = [f"sweep.n_trials={n_trials}", f"train.epochs={epochs}"]
    # A failing trial must not stop an arm early (sweep.max_failed_trials); it is counted.
    budget.append(f"sweep.max_failed_trials={n_trials + 1}")
    prepare_run_split(project, SETTINGS)  # the split cache is warm: no arm pays for it
    pruners = ("none",) if quick else ("none", "asha")  # quick (a smoke test): one arm
    arms = {pruner: run_sweep(project, [*budget, f"sweep.pruner={pruner}"]) for pruner in pruners}
    none = arms["none"]
    asha = arms.get("asha", none)
    # The fastest tenth of the packed epochs (trained while the other slot was starting up)
    # is the nearest to an epoch alone; the median would leave the trial alone short.
    packed = sorted(
        row["epoch_s"] for t in none.completed() for row in none.records[t.number].history
    )
    epoch_s = packed[len(packed) // 10]
    alone = none  # quick mode (a smoke test): the no-pruning arm's trials stand in
    if not quick:
        alone = run_sweep(
            project,
            [
                "sweep.n_trials=1",
                f"train.epochs={max(1, round(alone_s / epoch_s))}",
                "sweep.pruner=none",
                "sweep.max_concurrent_trials=1",
            ],
        )
    figures = {
        "no pruning, wall s": summary([none.wall_s]),
        "asha, wall s": summary([asha.wall_s]),
    }
    figures |= _sweep_ends([none, asha, alone])
    figures |= _trial_figures("no pruning, per trial", trial_costs(none))
    figures |= _trial_figures(f"one trial alone (~{alone_s:g} s of training)", trial_costs(alone))
    ratios = _arm_ratios(none, asha, n_trials) | _overhead_ratios(none, alone, alone_s)
    return {"figures": figures, "ratios": ratios}


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


def trial_costs(sweep: SweepRun) -> dict[str, list[float]]:
    """Each completed trial's duration, its training loop and the rest (the overhead), the
    rest cut two ways: around the loop (start-up, teardown) and by who spends it."""
    costs: dict[str, list[float]] = {}
    for trial in sweep.completed():
        record = sweep.records[trial.number]
        # Optuna stores naive local times; this machine's local zone reads them back.
        start, end = trial.datetime_start.timestamp(), trial.datetime_complete.timestamp()
        loop = sum(row["epoch_s"] for row in record.history)
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
    start (CLI, Prefect's temporary API, store check, DVC, study), and from its last trial's
    end to the command's exit."""
    starts = [min(t.datetime_start.timestamp() for t in s.trials) - s.launched for s in sweeps]
    ends = [s.ended - max(t.datetime_complete.timestamp() for t in s.trials) for s in sweeps]
    return {
        "sweep start (launch -> first trial start), s": summary(starts),
        "sweep end (last trial done -> exit), s": summary(ends),
    }


def _arm_ratios(none: SweepRun, asha: SweepRun, n_trials: int) -> dict[str, float]:
    """ASHA against its baseline, no pruning, from the same run of this benchmark."""

    def trials_phase(sweep: SweepRun) -> float:  # the part of the wall time pruning can cut
        starts = [t.datetime_start.timestamp() for t in sweep.trials]
        return max(t.datetime_complete.timestamp() for t in sweep.trials) - min(starts)

    val_rows = next(iter(none.records.values())).dataset.split_rows["val"]
    best = none.best()
    # One val accuracy's binomial standard error, no finer than one row of the split.
    noise = max(math.sqrt(best * (1 - best) / val_rows), 1 / val_rows)
    return {
        "asha / no pruning, wall (target <= 0.4)": asha.wall_s / none.wall_s,
        "asha / no pruning, trials phase (first trial start -> last trial done)": (
            trials_phase(asha) / trials_phase(none)
        ),
        f"asha, trials pruned (of {n_trials})": asha.count(TrialState.PRUNED),
        "trials failed, both arms (expected 0)": none.count(TrialState.FAIL)
        + asha.count(TrialState.FAIL),
        f"no pruning, best {OBJECTIVE}": best,
        f"asha, best {OBJECTIVE}": asha.best(),
        f"standard error of the best {OBJECTIVE} ({val_rows} val rows)": noise,
        f"(no pruning - asha) best {OBJECTIVE} / standard error (target <= 2)": (
            (best - asha.best()) / noise
        ),
    }


def _overhead_ratios(none: SweepRun, alone: SweepRun, alone_s: float) -> dict[str, float]:
    def median_share(costs: dict[str, list[float]], of: str) -> float:
        pairs = zip(costs["overhead (duration - training loop)"], costs[of], strict=True)
        return statistics.median(overhead / seconds for overhead, seconds in pairs)

    packed, single = trial_costs(none), trial_costs(alone)
    return {
        "no pruning trials, overhead / training loop": median_share(packed, "training loop"),
        "no pruning trials, overhead / duration": median_share(packed, "duration"),
        f"one trial alone (~{alone_s:g} s of training), overhead / training loop "
        "(target <= 0.10)": median_share(single, "training loop"),
    }
