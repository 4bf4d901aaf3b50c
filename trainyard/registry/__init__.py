"""The model registry, in the artifact store: immutable versions, aliases that point at them,
and an append-only history of every alias change.

    registry/<model>/versions/<n>/claim.json      <- n is taken (created only if absent)
    registry/<model>/versions/<n>/state.pt ...    the run's final checkpoint files, verified
    registry/<model>/versions/<n>/version.json    where it came from and how good it is
    registry/<model>/versions/<n>/manifest.json   <- commit marker, written last
    registry/<model>/history/<seq:08d>.json       one alias change each (created only if absent)
    registry/<model>/aliases.json                 a cache: what the history adds up to

A version is a copy, so deleting its run or the run's checkpoint retention never touches it.
Its manifest is the checkpoint's own, so `loading.load_model(store, version_uri(...))` loads
it exactly as it loads a run's checkpoint.

One writer without a lock: S3 conditional writes (a PUT with `If-None-Match: *` succeeds only
if the key is absent; AWS S3 since 2024, and measured on the embedded SeaweedFS 4.48: of 8
threads racing for one key, 1 wrote and 7 got 412) make "create if absent" atomic. Claiming a
version number and appending a history entry both use it: of two writers racing for the same
key exactly one wins; the other re-reads and decides again. The history is the truth;
aliases.json is rebuilt from it after each change and names the last entry it reflects, so a
reader can tell a stale cache (the next entry exists) and fold the history instead.
"""

from trainyard.registry.aliases import (
    alias_at,
    aliases_of,
    parse_time,
    promote,
    read_aliases,
    read_history,
    rollback,
)
from trainyard.registry.documents import (
    AliasChange,
    Evidence,
    VersionInfo,
    check_name,
    now,
    user_at_host,
    version_uri,
)
from trainyard.registry.versions import (
    list_models,
    list_versions,
    read_version,
    register,
    version_numbers,
)

__all__ = [
    "AliasChange",
    "Evidence",
    "VersionInfo",
    "alias_at",
    "aliases_of",
    "check_name",
    "list_models",
    "list_versions",
    "now",
    "parse_time",
    "promote",
    "read_aliases",
    "read_history",
    "read_version",
    "register",
    "rollback",
    "user_at_host",
    "version_numbers",
    "version_uri",
]
