"""One line per validation failure: the key, the value and what is allowed."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from trainyard.config.base import URL_PASSWORD

_VALUE_REPR = 80  # characters of a value shown in an error line


def describe(exc: ValidationError, raw: dict[str, Any], root: type[BaseModel]) -> str:
    """The first failure of validating `raw` as `root`, as one line."""
    errors = exc.errors()
    # A value refused by every member of a union (e.g. inf among `choices`) is reported once
    # per member; the finiteness error is the one that says what is wrong.
    error = next((e for e in errors if e["type"] == "finite_number"), errors[0])
    if error["type"] == "finite_number" and _lookup(raw, error["loc"]) is None:
        error = {**error, "loc": error["loc"][:-1]}  # it ends in a union member's tag, not a key
    key = _shorten(".".join(str(part) for part in error["loc"]))
    if not key:  # a rule over the whole settings names its keys itself
        return error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}'{_did_you_mean(root, error['loc'])}"
    message = error["msg"].removeprefix("Value error, ")
    value = _lookup(raw, error["loc"])
    if "input" in error and error["type"] != "missing" and not isinstance(value, dict):
        # A whole section's rule names its keys itself; a huge value is shown cut short.
        return f"{key} = {_shorten(repr(_masked(value)))}: {message}"
    return f"{key}: {message}"


def unsearchable(root: type[BaseModel], key: str, value: Any, error: Any) -> str:
    """Why a value a sweep trial could get for `key` is not a setting `root` accepts."""
    if error["type"] == "extra_forbidden":
        return f"sweep.space.{key}: no such setting{_did_you_mean(root, error['loc'])}"
    message = error["msg"].removeprefix("Value error, ")
    return f"sweep.space.{key}: a trial could get {value!r}, which {key} refuses: {message}"


def _masked(value: Any) -> Any:
    """A URL's password never reaches an error line."""
    return URL_PASSWORD.sub(r"\1***@", value) if isinstance(value, str) else value


def _shorten(text: str, limit: int = _VALUE_REPR) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _did_you_mean(root: type[BaseModel], loc: tuple) -> str:
    model = root
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} (allowed: {', '.join(allowed)})"


def _lookup(raw: Any, loc: tuple) -> Any:
    for part in loc:
        if (
            isinstance(raw, dict)
            and part in raw
            or isinstance(raw, list)
            and isinstance(part, int)
            and part < len(raw)
        ):
            raw = raw[part]
        else:
            return None
    return raw
