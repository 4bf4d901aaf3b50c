"""Where a trainyard project keeps its files. Every path the tools write is derived here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainyard.errors import ConfigError

_SPLIT_KEY = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class ProjectPaths:
    """Paths of one project checkout (the folder holding params.yaml and .dvc/)."""

    root: Path

    @classmethod
    def here(cls) -> ProjectPaths:
        return cls(Path.cwd().resolve())

    @property
    def params(self) -> Path:
        return self.root / "params.yaml"

    @property
    def state(self) -> Path:
        """Local, git-ignored state: embedded services, staging, Comet archives."""
        return self.root / ".trainyard"

    def make_state_private(self) -> None:
        """The local state holds staged checkpoints, split copies of the data, the signing
        key, Prefect's database and the store: only its owner may enter it (0700), even
        where it was made under a looser umask. Never made here: a refused command leaves
        no trace."""
        try:
            info = self.state.stat()
        except OSError:  # none yet (or not ours to look at): nothing to close
            return
        if info.st_mode & 0o077 and info.st_uid == os.getuid():
            self.state.chmod(0o700)

    @property
    def s3_server(self) -> Path:
        return self.state / "s3"

    @property
    def comet(self) -> Path:
        return self.state / "comet"

    @property
    def prefect_home(self) -> Path:
        return self.state / "prefect"

    @property
    def staging(self) -> Path:
        return self.state / "staging"

    def run_logs(self, run_id: str) -> Path:
        """A run's local logs: the traceback of the failure that ended it."""
        return self.state / "logs" / run_id

    @property
    def run_summaries(self) -> Path:
        """`runs list`'s summaries of finished runs, by their records' ETags (trainyard.runs.record)."""
        return self.state / "cache" / "run-summaries.json"

    @property
    def signing_key(self) -> Path:
        """The key checkpoint manifests are signed with (trainyard.checkpoint.signing); never in the store."""
        return self.state / "signing.key"

    @property
    def inputs(self) -> Path:
        """Prediction inputs, checked and converted, content-addressed (trainyard.inference)."""
        return self.state / "inputs"

    @property
    def dvc_lock(self) -> Path:
        """Held around this project's dvc calls: DVC allows one process per repository."""
        return self.state / "dvc.lock"

    def split_cache(self, key: str) -> Path:
        """A run's train/val/test split, content-addressed by trainyard.data.split.split_key
        and shared read-only by every run with that key (never data/processed, which
        `trainyard prepare` rewrites)."""
        if not _SPLIT_KEY.fullmatch(key):
            raise ConfigError(f"split key {key!r} is not valid: expected hex digits")
        return self.state / "splits" / key

    @property
    def processed(self) -> Path:
        """The `prepare` stage's output folder, as dvc.yaml declares it."""
        outs = self._dvc_yaml().get("stages", {}).get("prepare", {}).get("outs") or []
        if not outs:
            raise ConfigError(f"{self.root / 'dvc.yaml'}: stage 'prepare' declares no outs")
        return self.root / _path_of(outs[0])

    def _dvc_yaml(self) -> dict:
        path = self.root / "dvc.yaml"
        if not path.is_file():
            raise ConfigError(f"{path} not found: run trainyard from the project folder")
        return yaml.safe_load(path.read_text()) or {}


def _path_of(entry: str | dict) -> str:
    """A dvc.yaml out is either `path` or `{path: {options}}`."""
    return entry if isinstance(entry, str) else next(iter(entry))
