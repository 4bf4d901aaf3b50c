"""A model-parallel layout the model cannot take is one line before anything launches
(trainyard.runs.preflight.check_layout, which `trainyard run` and every flow call): heads
that do not split, fewer pipeline pieces than stages, a model that declares none, and a
tensor split of a pipeline's stages that does not divide, and a pipeline compiled (not yet
supported)."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard.config import config_from_dict
from trainyard.data_spec import DataSpec
from trainyard.errors import ConfigError
from trainyard.runs.preflight import check_layout

TOKENS = DataSpec("tokens", (16,), 64, vocab_size=64, context=16)
TABLE = DataSpec("table", (8,), 3)
GPT = {"name": "transformer", "options": {"layers": 2, "heads": 4, "width": 32}}

CASES: list[tuple[dict[str, Any], DataSpec, str]] = [
    ({"workers": 3, "parallel": {"tensor": 3}}, TOKENS, "4 heads do not split into 3 equal"),
    (
        {"workers": 4, "parallel": {"pipeline": 4}, "pipeline_schedule": "interleaved_1f1b"},
        TOKENS,
        "the model has 4 pipeline pieces, fewer than the 8 stages asked for",
    ),
    (
        {"workers": 2, "parallel": {"pipeline": 2}},
        TABLE,
        "model.name 'mlp': the model (Sequential) declares no pipeline_stages()",
    ),
    (
        {"workers": 6, "parallel": {"pipeline": 2, "tensor": 3}},
        TOKENS,
        "train.parallel.tensor 3: the transformer's 4 heads do not split into 3 equal",
    ),
    ({"workers": 2, "parallel": {"pipeline": 2}, "compile": True}, TOKENS, "train.compile true"),
]


@pytest.mark.parametrize(("train", "spec", "expected"), CASES, ids=[c[2][:30] for c in CASES])
def test_a_layout_the_model_cannot_take_is_one_line(train, spec, expected):
    model = GPT if spec is TOKENS else {"name": "mlp"}
    config = config_from_dict({"model": model, "train": train})
    with pytest.raises(ConfigError) as refused:
        check_layout(config, spec)
    assert expected in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_layouts_trainyard_runs_pass():
    for train in (
        {"workers": 2, "parallel": {"pipeline": 2}},
        {"workers": 4, "parallel": {"pipeline": 2}, "pipeline_schedule": "interleaved_1f1b"},
        {"workers": 4, "parallel": {"tensor": 2}, "strategy": "fsdp"},
        {"workers": 4, "parallel": {"pipeline": 2, "tensor": 2}},
        {"workers": 4, "parallel": {"pipeline": 2}, "strategy": "fsdp"},
    ):
        check_layout(config_from_dict({"model": GPT, "train": train}), TOKENS)
