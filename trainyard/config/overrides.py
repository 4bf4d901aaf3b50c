"""Raw settings: YAML read without anchors or aliases, and `section.key=value` overrides."""

from __future__ import annotations

import re
from typing import Any

import yaml

from trainyard.errors import ConfigError


class AliasRefused(yaml.YAMLError):
    def __init__(self, line: int):
        super().__init__("YAML anchors and aliases (&name / *name) are not allowed")
        self.line = line


class PlainLoader(yaml.SafeLoader):
    """SafeLoader without anchors and aliases: a few hundred bytes of nested aliases
    ("billion laughs") expand to gigabytes, and settings never need them."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise AliasRefused(event.start_mark.line + 1)
        return super().compose_node(parent, index)


_INT = "tag:yaml.org,2002:int"
# YAML 1.1 reads 1:2 as the base-60 integer 62 (1 x 60 + 2), which no setting means:
# train.nnodes: 1:2 is a range of machines. Integers here are YAML 1.2's, without base 60.
PlainLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
PlainLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `section.key=value` (the value read as YAML) in raw settings, in place."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"-S {override!r}: expected section.key=value, e.g. -S train.epochs=5")
    try:
        value = yaml.load(text, Loader=PlainLoader) if text else ""
    except AliasRefused as exc:
        raise ConfigError(f"-S {override!r}: {exc}; write the value out") from None
    except (yaml.YAMLError, RecursionError):
        value = text  # not YAML: the text itself, e.g. a name with a ':'
    try:
        set_key(raw, key, value)
    except ValueError as exc:
        raise ConfigError(f"-S {override!r}: {exc}") from None


# A sweep space's keys are dotted setting names themselves (`train.lr`), each a mapping of
# these fields: `sweep.space.train.lr.high` is field `high` of key `train.lr`.
SEARCH_FIELDS = ("type", "low", "high", "log", "step", "choices")


def key_parts(key: str) -> list[str]:
    """`section.key` split into the nested keys it names; under `sweep.space`, the setting
    a dimension samples is one key (and a search field after it another)."""
    parts = key.split(".")
    if parts[:2] != ["sweep", "space"] or len(parts) < 3:
        return parts
    named = parts[2:]
    if len(named) > 1 and named[-1] in SEARCH_FIELDS:
        return ["sweep", "space", ".".join(named[:-1]), named[-1]]
    return ["sweep", "space", ".".join(named)]


def set_key(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `section.key` (any depth) in raw settings, in place."""
    node = raw
    *parents, leaf = key_parts(key)
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{part} is not a section")
        node = child
    node[leaf] = value
