"""params.yaml to TrainyardConfig: read, overridden with -S, validated, one error line."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainyard.config.messages import describe
from trainyard.config.model import DEFAULT_MODEL
from trainyard.config.overrides import AliasRefused, PlainLoader, apply_override
from trainyard.config.settings import TrainyardConfig
from trainyard.errors import ConfigError


def load_config(params_path: Path, overrides: list[str] | None = None) -> TrainyardConfig:
    """Read params.yaml, apply `key=value` overrides, validate; raise ConfigError on any fault."""
    source = params_path.name
    if not params_path.is_file():
        raise ConfigError(f"{params_path} not found: run trainyard from the project folder")
    try:
        raw = yaml.load(params_path.read_text(), Loader=PlainLoader) or {}
    except AliasRefused as exc:
        raise ConfigError(f"{source}: {exc} (line {exc.line}); write the values out") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_fault(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be settings") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a mapping of sections (data, train, ...)")
    written_for = _model_name(raw)
    as_written = copy.deepcopy(raw) if overrides else raw
    for override in overrides or []:
        apply_override(raw, override)
    left_out = _leave_out_other_models_options(raw, written_for, overrides or [])
    try:
        config = config_from_dict(raw, source=source)
    except ConfigError:
        _blame_an_override(as_written, overrides or [], source)
        raise
    if left_out:
        print(
            f"trainyard: model.name={config.model.name}: {source}'s model.options for "
            f"{written_for} left out ({', '.join(left_out)}); give this model's own with "
            "-S model.options.KEY=VALUE",
            file=sys.stderr,
        )
    return config


def _blame_an_override(raw: dict[str, Any], overrides: list[str], source: str) -> None:
    """Where the file alone is valid, raise the fault under the override that brings it in
    (the first whose addition fails), not under the file, which does not hold it."""
    if not overrides:
        return
    try:
        config_from_dict(copy.deepcopy(raw), source=source)
    except ConfigError:
        return  # the file's own fault
    written_for = _model_name(raw)
    for count, override in enumerate(overrides, 1):
        trial = copy.deepcopy(raw)
        for given in overrides[:count]:
            apply_override(trial, given)
        _leave_out_other_models_options(trial, written_for, overrides[:count])
        config_from_dict(trial, source=f"override {override}")


def _model_name(raw: dict[str, Any]) -> Any:
    model = raw.get("model") or {}
    return model.get("name", DEFAULT_MODEL) if isinstance(model, dict) else None


def _leave_out_other_models_options(
    raw: dict[str, Any], written_for: Any, overrides: list[str]
) -> list[str]:
    """The file's model.options were written for its model.name: when -S switches the model,
    they are left out (another model's factory refuses them, or reads them otherwise): the
    options given with -S remain, or else the new model's defaults. Returns the names left out."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return []
    options = model.get("options")
    if not isinstance(options, dict) or _model_name(raw) == written_for:
        return []
    keys = {override.partition("=")[0].strip() for override in overrides}
    if keys & {"model", "model.options"}:
        return []  # the options were all given with -S: validated as they are
    given = {key.split(".")[2] for key in keys if key.startswith("model.options.")}
    model["options"] = {name: value for name, value in options.items() if name in given}
    if not model["options"]:
        del model["options"]  # the new model's default options
    return [str(name) for name in options if name not in given]


def config_from_dict(raw: dict[str, Any], source: str = "params") -> TrainyardConfig:
    """Validate raw settings; the first fault becomes one ConfigError line naming `source`."""
    try:
        return TrainyardConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe(exc, raw, TrainyardConfig)}") from None


def _yaml_fault(exc: yaml.YAMLError) -> str:
    """`expected ',' or ']', but got '<stream end>' at line 3, column 1, while parsing a
    flow sequence at line 2, column 11`: the problem and where, and what it was inside,
    which the exception's first line (its context alone) leaves out."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem is None or mark is None:
        return _first_line(exc)
    fault = f"{problem} at {_where(mark)}"
    context, began = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and began is not None:
        fault += f", {context} at {_where(began)}"
    if "'\\t'" in problem:
        fault += "; YAML indents with spaces, never tabs"
    return fault


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]
