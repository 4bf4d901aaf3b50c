"""Malformed settings files: every one ends in exit code 2 and one stderr line naming the key,
before anything is launched. Table-driven, then property-based over the whole schema."""

from __future__ import annotations

import copy
import json
import math
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import get_args, get_origin

import annotated_types
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from trainyard.cli import main as cli
from trainyard.config import (
    MAX_IMAGE_SIDE,
    MAX_INTERRUPT_GRACE_S,
    MAX_JOB_S,
    MAX_WAIT_S,
    TrainyardConfig,
    config_from_dict,
    load_config,
)
from trainyard.errors import ConfigError

CASES = [
    # (params.yaml text, text the one error line must contain)
    ("train: {workers: 0}", "train.workers = 0"),
    ("train: {workers: -3}", "train.workers = -3"),
    ("train: {workers: two}", "train.workers = 'two'"),
    ("train: {workers: 1.5}", "train.workers = 1.5"),
    ("train: {epochs: 0}", "train.epochs = 0"),
    ("train: {epochs: null}", "train.epochs = None"),
    ("train: {batch_size: 0}", "train.batch_size = 0"),
    ("train: {batch_size: [32]}", "train.batch_size = [32]"),
    ("train: {lr: 0}", "train.lr = 0"),
    ("train: {lr: -0.01}", "train.lr = -0.01"),
    ("train: {lr: .inf}", "train.lr = inf"),
    ("train: {lr: fast}", "train.lr = 'fast'"),
    ("train: {momentum: 1.0}", "train.momentum = 1.0"),
    ("train: {weight_decay: -1}", "train.weight_decay = -1"),
    ("train: {device: gpu}", "train.device = 'gpu'"),
    ("train: {threads_per_worker: 0}", "train.threads_per_worker = 0"),
    ("train: {timeout_s: 0}", "train.timeout_s = 0"),
    ("train: {warmup_epochs: -1}", "train.warmup_epochs = -1"),
    ("train: {lr_reference_batch_size: 0}", "train.lr_reference_batch_size = 0"),
    ("train: {epochz: 3}", "unknown key 'train.epochz'; did you mean 'epochs'?"),
    ("train: {parallel: {tensor: 0}}", "train.parallel.tensor = 0"),
    ("train: {parallel: {tensr: 2}}", "unknown key 'train.parallel.tensr'"),
    ("train: {workers: 3, parallel: {tensor: 2}}", "tensor 2 = 2 does not divide the world size"),
    ("train: {pipeline_schedule: zigzag}", "train.pipeline_schedule = 'zigzag'"),
    ("train: {microbatches: 0}", "train.microbatches = 0"),
    ("train: {sync: gossip}", "train.sync = 'gossip'"),
    ("train: {sync: parameter_server, parameter_servers: 9}", "parameter_servers 9 is more"),
    ("train: {sync: parameter_server, nnodes: '1:2'}", "set train.nnodes to one number"),
    ("train: {sync: diloco, strategy: fsdp}", "sync diloco trains whole replicas"),
    ("train: {sync: local_sgd, nnodes: '1:2'}", "set train.nnodes to one number"),
    ("train: {sync_every: 0}", "train.sync_every = 0"),
    ("train: 5", "train = 5"),
    ("split: {val_fraction: 0}", "split.val_fraction = 0"),
    ("split: {test_fraction: 1.2}", "split.test_fraction = 1.2"),
    ("split: {val_fraction: 0.5, test_fraction: 0.45}", "val_fraction + test_fraction = 0.95"),
    ("split: {seed: abc}", "split.seed = 'abc'"),
    ("data: {path: /etc/passwd.csv}", "data.path = '/etc/passwd.csv'"),
    ("data: {path: data/../../x.csv}", "data.path = 'data/../../x.csv'"),
    ("data: {path: data/raw/x.xlsx}", "data.path = 'data/raw/x.xlsx'"),
    ("data: {path: raw/x.csv}", "data.path = 'raw/x.csv'"),
    ("data: {label_column: ''}", "data.label_column = ''"),
    ("data: {lable_column: y}", "unknown key 'data.lable_column'; did you mean 'label_column'?"),
    ("model: {name: 7}", "model.name = 7"),
    ("model: {options: [1, 2]}", "model.options = [1, 2]"),
    ("checkpoint: {every_n_epochs: 0}", "checkpoint.every_n_epochs = 0"),
    ("checkpoint: {every: 1}", "unknown key 'checkpoint.every'"),
    ("storage: {bucket: My_Bucket}", "storage.bucket = 'My_Bucket'"),
    ("storage: {bucket: ab}", "storage.bucket = 'ab'"),
    ("storage: {endpoint: s3.example}", "storage.endpoint = 's3.example'"),
    ("storage: {prefix: /abs}", "storage.prefix = '/abs'"),
    ("storage: {prefix: a/../b}", "storage.prefix = 'a/../b'"),
    ("tracking: {backend: wandb}", "tracking.backend = 'wandb'"),
    ("tracking: {project: ''}", "tracking.project = ''"),
    ("trainig: {epochs: 3}", "unknown key 'trainig'; did you mean 'train'?"),
    ("train: {epochs: [1, 2", "not valid YAML"),
    ("[1, 2, 3]", "must be a mapping of sections"),
    ("sweep: {n_trials: 0}", "sweep.n_trials = 0"),
    ("sweep: {sampler: bayes}", "sweep.sampler = 'bayes'"),
    ("sweep: {sampler: grid}", "sampler grid needs a step for float parameters: train.lr"),
    (
        "sweep: {space: {train.lr: {type: float, low: 0.1, high: 20}}}",
        "sweep.space.train.lr: a trial could get 20.0, which train.lr refuses",
    ),
    (
        "sweep: {space: {train.lrr: {type: float, low: 0.1, high: 2}}}",
        "sweep.space.train.lrr: no such setting; did you mean 'lr'?",
    ),
    (
        "sweep: {space: {train.workers: {type: int, low: 1, high: 4}}}",
        "train.workers cannot be searched",
    ),
    ("sweep: {storage: 'postgresql://me:hunter2@db/optuna'}", "'postgresql://me:***@db/optuna'"),
    ("registry: {model_name: 'my/model'}", "registry.model_name = 'my/model'"),
    ("train: {hang_timeout_s: .inf}", "train.hang_timeout_s = inf: Input should be a finite"),
    ("train: {hang_timeout_s: 1.0e+308}", "train.hang_timeout_s = 1e+308: Input should be less"),
    ("promote: {min_value: .nan}", "promote.min_value = nan: Input should be a finite number"),
    ("model: {options: {dropout: .nan}}", "model.options: holds inf or nan"),
]


def run_cli(tmp_path, monkeypatch, capsys, params: str, *args: str) -> tuple[int, str]:
    (tmp_path / "params.yaml").write_text(params)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", *args])
    return code, capsys.readouterr().err


def test_the_table_has_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize(("params", "expected"), CASES, ids=[c[0][:40] for c in CASES])
def test_malformed_settings_file_exits_2_with_one_line_naming_the_key(
    tmp_path, monkeypatch, capsys, params, expected
):
    code, err = run_cli(tmp_path, monkeypatch, capsys, params)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainyard: error: params.yaml: "), err
    assert expected in lines[0]
    assert not (tmp_path / ".trainyard").exists(), "nothing may be started or written"


# For each leaf of the schema: values that can never be valid there.
NOT_A_NUMBER = st.text(alphabet="abcxyz", min_size=1, max_size=6)
NOT_AN_INTEGER = NOT_A_NUMBER | st.floats(allow_infinity=False, allow_nan=False).filter(
    lambda f: f != int(f)
)
BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"}
BAD = {
    "train.workers": st.integers(max_value=0) | NOT_A_NUMBER,
    "train.epochs": st.integers(max_value=0) | NOT_A_NUMBER,
    "train.batch_size": st.integers(max_value=0) | NOT_A_NUMBER,
    "train.lr": st.floats(max_value=0) | st.floats(min_value=10, exclude_min=True) | NOT_A_NUMBER,
    "train.lr_reference_batch_size": st.integers(max_value=0),
    "train.warmup_epochs": st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=100_000, exclude_min=True),
    "train.momentum": st.floats(min_value=1) | st.floats(max_value=0, exclude_max=True),
    "train.weight_decay": st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=1, exclude_min=True),
    "train.threads_per_worker": st.integers(max_value=0) | st.integers(min_value=257),
    "train.gpus": NOT_A_NUMBER
    | st.just([])
    | st.lists(st.integers(max_value=-1), min_size=2, max_size=3)
    | st.integers(0, 7).map(lambda gpu: [gpu, gpu])  # twice
    | st.integers(0, 7).map(lambda gpu: [gpu]),  # fewer than the 2 workers
    "train.timeout_s": st.floats(max_value=0) | st.floats(min_value=MAX_JOB_S, exclude_min=True),
    "train.device": NOT_A_NUMBER.filter(lambda s: s not in {"auto", "cpu", "cuda"}),
    "train.precision": NOT_A_NUMBER.filter(lambda s: s not in {"fp32", "bf16"}),
    "train.optimizer": NOT_A_NUMBER.filter(lambda s: s not in {"sgd", "adamw"}),
    "train.grad_clip_norm": st.floats(max_value=0) | NOT_A_NUMBER,
    "train.grad_accum_steps": st.integers(max_value=0) | NOT_A_NUMBER,
    "train.compile": NOT_A_NUMBER.filter(lambda s: s.lower() not in BOOLEAN_WORDS),
    "train.prefetch": NOT_A_NUMBER.filter(lambda s: s.lower() not in BOOLEAN_WORDS),
    "data.context": st.integers(max_value=1) | st.integers(min_value=65537),
    "data.tokenizer": NOT_A_NUMBER.filter(lambda s: s not in {"char", "byte"}),
    # the label itself, not a list, not names (a column that is absent is preflight's)
    "data.ignore_columns": st.sampled_from([["label"], ["a", "label"], "id", 5, [1, 2], [None]]),
    "data.image_size": st.sampled_from(
        [[0, 32], [32], [32, 32, 3], [1.5, 8], "32", 32, [MAX_IMAGE_SIDE + 1, 8]]
    ),
    "data.channels": st.integers().filter(lambda n: n not in {1, 3}) | NOT_A_NUMBER,
    "data.augment": NOT_A_NUMBER.filter(lambda s: s not in {"none", "flip_crop"}),
    "tracking.log_every_n_steps": st.integers(max_value=0) | NOT_A_NUMBER,
    "tracking.min_interval_s": st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=3600, exclude_min=True)
    | NOT_A_NUMBER,
    "stragglers.enabled": NOT_A_NUMBER.filter(lambda s: s.lower() not in BOOLEAN_WORDS),
    "stragglers.window_steps": st.integers(max_value=0)
    | st.integers(min_value=100_001)
    | NOT_A_NUMBER,
    "stragglers.windows_in_a_row": st.integers(max_value=0) | NOT_A_NUMBER,
    "stragglers.mad_factor": st.floats(max_value=0)
    | st.floats(min_value=100, exclude_min=True)
    | NOT_A_NUMBER,
    "stragglers.min_slowdown": st.floats(max_value=0)
    | st.floats(min_value=100, exclude_min=True)
    | NOT_A_NUMBER,
    "stragglers.min_gap_ms": st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=3_600_000, exclude_min=True)
    | NOT_A_NUMBER,
    "split.val_fraction": st.floats(max_value=0) | st.floats(min_value=1),
    "split.test_fraction": st.floats(max_value=0) | st.floats(min_value=1),
    "split.seed": NOT_AN_INTEGER,
    "train.seed": NOT_AN_INTEGER,
    "checkpoint.every_n_epochs": st.integers(max_value=0),
    "storage.bucket": st.text(alphabet="ABC_!", min_size=1, max_size=5),
    "storage.endpoint": st.text(alphabet="abc:/.", min_size=1, max_size=8).filter(
        lambda s: s not in {"embedded", "aws"}
    ),
    "tracking.backend": NOT_A_NUMBER.filter(lambda s: s not in {"comet", "none"}),
    "train.strategy": NOT_A_NUMBER.filter(lambda s: s not in {"ddp", "fsdp"}),
    "train.nnodes": st.integers(max_value=0)
    | st.integers(min_value=4097)
    | st.sampled_from(["2:1", "0:2", "1:4097", "1:2:3", ":2", "1:", "one:two"]),
    "train.node_rank": st.integers(max_value=-1),
    "train.parallel": st.sampled_from(
        [{"tensor": 0}, {"pipeline": -1}, {"tensor": 1025}, {"tensor": "two"}, {"pipe": 2}, 3]
    ),
    "train.pipeline_schedule": NOT_A_NUMBER.filter(
        lambda s: s not in {"gpipe", "1f1b", "interleaved_1f1b"}
    ),
    "train.microbatches": st.integers(max_value=0) | st.integers(min_value=4097) | NOT_A_NUMBER,
    "train.sync": NOT_A_NUMBER.filter(
        lambda s: s not in {"allreduce", "local_sgd", "diloco", "parameter_server"}
    ),
    "train.sync_every": st.integers(max_value=0) | st.integers(min_value=1_000_001) | NOT_A_NUMBER,
    "train.outer_lr": st.floats(max_value=0)
    | st.floats(min_value=10, exclude_min=True)
    | NOT_A_NUMBER,
    "train.outer_momentum": st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=1)
    | NOT_A_NUMBER,
    "train.parameter_servers": st.integers(max_value=-1)
    | st.integers(min_value=1025)
    | NOT_A_NUMBER,
    "train.max_staleness": st.integers(max_value=-1)
    | st.integers(min_value=1_000_001)
    | NOT_A_NUMBER,
    "train.rdzv_endpoint": st.sampled_from(
        ["node0", "node0:", ":29400", "node 0:1", "node0:123456"]
    ),
    "train.max_restarts": st.integers(max_value=-1) | st.integers(min_value=101),
    "train.hang_timeout_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_WAIT_S, exclude_min=True),
    "train.node_timeout_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_WAIT_S, exclude_min=True),
    "checkpoint.every_n_steps": st.integers(max_value=0),
    "checkpoint.every_n_minutes": st.floats(max_value=0) | NOT_A_NUMBER,
    "checkpoint.max_overhead": st.floats(max_value=0) | st.floats(min_value=1) | NOT_A_NUMBER,
    "checkpoint.resume": NOT_A_NUMBER.filter(lambda s: s not in {"auto", "never"}),
    "checkpoint.on_interrupt": NOT_A_NUMBER.filter(lambda s: s.lower() not in BOOLEAN_WORDS),
    "checkpoint.interrupt_grace_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_INTERRUPT_GRACE_S, exclude_min=True)
    | NOT_A_NUMBER,
    "checkpoint.keep_last": st.integers(max_value=1),
    "checkpoint.keep_best_by": NOT_A_NUMBER.filter(lambda s: s not in {"none"}),
    "task.name": NOT_A_NUMBER.filter(lambda s: s not in {"classification", "regression"}),
    "checkpoint.pinned_steps": NOT_A_NUMBER | st.lists(NOT_A_NUMBER, min_size=1, max_size=3),
    "checkpoint.max_staged": st.integers(max_value=1),
    "checkpoint.upload_backoff_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_WAIT_S, exclude_min=True),
    "checkpoint.upload_backoff_max_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_WAIT_S, exclude_min=True),
    "checkpoint.upload_timeout_s": st.floats(max_value=0)
    | st.floats(min_value=MAX_WAIT_S, exclude_min=True),
    "sweep.space": st.sampled_from(
        [
            {"train.lr": {"type": "float", "low": 1, "high": 0}},
            {"train.lrr": {"type": "float", "low": 0.01, "high": 0.1}},
            {"train.workers": {"type": "int", "low": 1, "high": 2}},
            {"train.lr": {"type": "categorical"}},
            {"train.lr": {"type": "float", "low": 0, "high": 1, "log": True}},
            {"train.lr": {"type": "float", "low": 0.01, "high": 50}},
            {"train.epochs": {"type": "int", "low": 1.5, "high": 4}},
            {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
            "abc",
            [1],
        ]
    ),
    "sweep.sampler": NOT_A_NUMBER.filter(lambda s: s not in {"tpe", "random", "grid", "cmaes"}),
    "sweep.n_trials": st.integers(max_value=0) | NOT_A_NUMBER,
    "sweep.timeout_s": st.floats(max_value=0) | NOT_A_NUMBER,
    "sweep.pruner": NOT_A_NUMBER.filter(lambda s: s not in {"asha", "median", "hyperband", "none"}),
    "sweep.min_epochs": st.integers(max_value=0) | NOT_A_NUMBER,
    "sweep.max_concurrent_trials": st.integers(max_value=0) | NOT_A_NUMBER,
    "sweep.cores": st.integers(max_value=0) | NOT_A_NUMBER,
    "sweep.max_failed_trials": st.integers(max_value=0) | NOT_A_NUMBER,
    "sweep.heartbeat_s": st.integers(max_value=0) | st.integers(min_value=3601) | NOT_A_NUMBER,
    "sweep.storage": st.sampled_from(
        ["postgresql://u:secret@db.example/optuna", "mysql://root:pw@localhost/optuna", 7, [1]]
    ),
    "sweep.seed": NOT_AN_INTEGER,
    "promote.min_delta": st.floats(max_value=0, exclude_max=True)
    | st.sampled_from([math.nan, math.inf])
    | NOT_A_NUMBER,
    "promote.min_value": NOT_A_NUMBER | st.sampled_from([math.nan, math.inf, -math.inf]),
    "registry.model_name": st.sampled_from(["", "a/b", "..", "-lead", "x" * 65, "sp ace", 7]),
    "retrain.init": NOT_A_NUMBER.filter(lambda s: s not in {"scratch", "champion"}),
    "inference.workers": st.integers(max_value=0) | NOT_A_NUMBER,
    "inference.batch_size": st.integers(max_value=0) | st.integers(min_value=(1 << 24) + 1),
    "inference.shard_rows": st.integers(max_value=0) | NOT_A_NUMBER,
    "inference.timeout_s": st.floats(max_value=0) | NOT_A_NUMBER,
    "inference.max_restarts": st.integers(max_value=-1) | st.integers(min_value=101),
    "data.path": st.sampled_from(
        ["/abs.csv", "../x.csv", "data/x.txt", "x.csv", "data/../../y.csv"]
    ),
}
SECTIONS = {
    name: model.annotation.model_fields  # type: ignore[union-attr]  # every section is a model
    for name, model in TrainyardConfig.model_fields.items()
}


def test_every_numeric_or_choice_setting_has_a_bad_value_generator():
    leaves = {f"{s}.{k}" for s, fields in SECTIONS.items() for k in fields}
    free_text = {
        "data.label_column",
        "data.dataset",  # an import path, checked like model.name (test_hardening.py)
        "model.name",
        "model.options",
        "storage.prefix",
        "tracking.project",
        "tracking.workspace",
        "task.monitor",  # checked against the task's metrics in preflight (test_tasks.py)
    }
    assert leaves - free_text <= set(BAD), sorted(leaves - free_text - set(BAD))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_wrong_value_for_any_key_exits_2_naming_it(tmp_path, monkeypatch, capsys, data):
    key = data.draw(st.sampled_from(sorted(BAD)))
    value = data.draw(BAD[key])
    text = json.dumps(value)  # YAML reads JSON, except for non-finite floats
    if isinstance(value, float) and not math.isfinite(value):
        text = {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}[repr(value)]
    code, err = run_cli(tmp_path, monkeypatch, capsys, "{}", "-S", f"{key}={text}")
    assert code == 2, (key, value, err)
    assert key in err and len(err.strip().splitlines()) == 1, (key, value, err)
    assert not (tmp_path / ".trainyard").exists(), (key, value, "nothing may be started")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    section=st.sampled_from(sorted(SECTIONS)),
    name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
def test_any_unknown_key_exits_2_naming_it(tmp_path, monkeypatch, capsys, section, name):
    if name in SECTIONS[section]:
        return
    code, err = run_cli(tmp_path, monkeypatch, capsys, "{}", "-S", f"{section}.{name}=1")
    assert code == 2
    assert f"unknown key '{section}.{name}'" in err


# Every float setting, found by walking the settings' models, so that a new one is covered
# without touching this file: inf, -inf and nan pass range checks such as gt=0 (nan compares
# false) and failed only inside the workers, after Prefect and torchrun were up.
NON_FINITE = [math.inf, -math.inf, math.nan]
NON_FINITE_TEXTS = ["inf", "-inf", "nan", ".inf", "-.inf", ".nan", "Infinity", "NaN", "1e400"]


def float_settings(model: type[BaseModel], raw: dict, loc: tuple = ()) -> Iterator[tuple]:
    """(location, is_list) of each float-valued field under `model`, descending into nested
    sections and into the mappings of sections that `raw` (the default settings) holds, such
    as sweep.space's search parameters."""
    for name, field in model.model_fields.items():
        annotation, here = field.annotation, (*loc, name)
        args = get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from float_settings(annotation, raw[name], here)
        elif get_origin(annotation) is dict and _is_model(args[-1]):
            for key, value in raw[name].items():
                yield from float_settings(args[-1], value, (*here, key))
        elif _mentions_float(annotation):
            yield here, any(get_origin(a) is list for a in (annotation, *args))


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _mentions_float(annotation) -> bool:
    return annotation is float or any(_mentions_float(a) for a in get_args(annotation))


DEFAULTS = TrainyardConfig().model_dump(mode="json")
FLOATS = list(float_settings(TrainyardConfig, DEFAULTS))
DURATIONS = [loc for loc, _ in FLOATS if loc[-1].endswith(("_s", "_ms", "_minutes"))]
SECONDS = {"_s": 1, "_ms": 0.001, "_minutes": 60}


def test_the_walk_finds_every_float_setting_named_in_the_issue():
    keys = {".".join(loc) for loc, _ in FLOATS}
    assert len(keys) >= 30, sorted(keys)
    assert {
        "train.hang_timeout_s", "train.timeout_s", "train.warmup_epochs", "train.grad_clip_norm",
        "train.weight_decay", "checkpoint.upload_backoff_s", "checkpoint.upload_backoff_max_s",
        "checkpoint.upload_timeout_s", "promote.min_delta", "promote.min_value",
        "sweep.space.train.lr.low", "sweep.space.train.batch_size.choices",
    } <= keys  # fmt: skip


def put(raw: dict, loc: tuple, value) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    for part in loc[:-1]:
        node = node[part]
    node[loc[-1]] = value
    return raw


@pytest.mark.parametrize("loc, is_list", FLOATS, ids=[".".join(loc) for loc, _ in FLOATS])
def test_every_float_setting_refuses_inf_and_nan_in_one_line_naming_it(loc, is_list):
    key = ".".join(loc)
    for bad in NON_FINITE:
        with pytest.raises(ConfigError) as refused:
            config_from_dict(put(DEFAULTS, loc, [bad] if is_list else bad))
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and key in message, (bad, message)
        assert "finite" in message, (bad, message)


@pytest.mark.parametrize("loc", [loc for loc, _ in FLOATS if len(loc) == 2], ids=".".join)
def test_every_float_setting_refuses_non_finite_overrides(tmp_path, loc):
    """As `-S section.key=...` writes them: YAML's .inf, and words pydantic would read as inf."""
    (tmp_path / "params.yaml").write_text("{}")
    key = ".".join(loc)
    for text in NON_FINITE_TEXTS:
        with pytest.raises(ConfigError, match=f"^override {key}=.*: {key} = .*finite") as refused:
            load_config(tmp_path / "params.yaml", [f"{key}={text}"])
        assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("loc", DURATIONS, ids=".".join)
def test_every_duration_is_bounded_well_inside_what_timers_hold(loc):
    """1e308 s overflowed timedelta inside the workers. Each duration has an upper bound,
    at most MAX_JOB_S, that timedelta and threading take."""
    section, name = loc
    field = TrainyardConfig.model_fields[section].annotation.model_fields[name]
    bounds = [m.le for m in field.metadata if isinstance(m, annotated_types.Le)]
    unit = next(factor for suffix, factor in SECONDS.items() if name.endswith(suffix))
    assert bounds and bounds[0] * unit <= MAX_JOB_S, (loc, field.metadata)
    timedelta(seconds=bounds[0] * unit)  # does not overflow
    assert bounds[0] * unit <= threading.TIMEOUT_MAX
    config_from_dict(put(DEFAULTS, loc, bounds[0]))  # the bound itself is a valid setting
    with pytest.raises(ConfigError, match=f"{'.'.join(loc)} = 1e\\+308: Input should be less"):
        config_from_dict(put(DEFAULTS, loc, 1e308))


@pytest.mark.parametrize("text", ["inf", "1e308"])
def test_an_infinite_hang_timeout_exits_2_before_anything_starts(
    tmp_path, monkeypatch, capsys, text
):
    code, err = run_cli(tmp_path, monkeypatch, capsys, "{}", "-S", f"train.hang_timeout_s={text}")
    assert code == 2
    assert err.startswith(f"trainyard: error: override train.hang_timeout_s={text}: "), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / ".trainyard").exists(), "no Prefect home, store or torchrun started"
