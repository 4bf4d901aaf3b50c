"""Dataset versioning with DVC, through its public command line (`dvc add`, `dvc push`).

`data.path` is a file or a folder (images per class); DVC tracks a folder as one directory
out whose md5 is that of its listing, `<md5>.dir`. The same hash is computed here without DVC
(`content_md5`), so a node or a resume check can name the data before, or without, `dvc add`.

The DVC remote is declared in .dvc/config (committed); where it lives and the credentials
for it go to .dvc/config.local (git-ignored), written here for the embedded store.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainyard.data.recorded import cache_object, listing_md5
from trainyard.errors import DataError, TrainyardError
from trainyard.project import ProjectPaths
from trainyard.storage import Store, StoreSettings
from trainyard.util.hashing import file_digest
from trainyard.util.locks import file_lock

log = logging.getLogger(__name__)

REMOTE = "store"
REMOTE_FOLDER = "dvc"  # inside the store's bucket and prefix


@dataclass(frozen=True)
class DatasetVersion:
    path: str  # relative to the project root
    dvc_md5: str
    size: int


def dvc(root: Path, *args: str) -> str:
    """Run dvc (never with a secret among its arguments: see `_write_local_remote`)."""
    exe = Path(sys.executable).parent / "dvc"
    cmd = [str(exe) if exe.exists() else "dvc", *args]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        message = f"`dvc {' '.join(args)}` failed: {detail[-1] if detail else done.returncode}"
        raise TrainyardError(message)
    return done.stdout


def dvc_lock(root: Path):
    """One trainyard process at a time runs dvc in this project: DVC's own repository lock
    gives up after 3 s (so two runs started together failed), and `dvc add` then reading the
    .dvc file must not interleave with another run's. Hold it around dvc calls only, which
    are short, never around training."""
    return file_lock(
        ProjectPaths(root).dvc_lock, "waiting for another trainyard process's dvc calls"
    )


def content_md5(path: Path) -> str:
    """The hash DVC 3 records for a file (`hash: md5`, of its bytes as they are) or a folder
    (`<md5>.dir`, of its listing: it changes when any file is added, removed, renamed or
    edited)."""
    if path.is_dir():
        return listing_md5(_folder_listing(path))
    return file_digest(path, "md5")


def _folder_listing(folder: Path) -> list[dict[str, str]]:
    """What DVC stores as a folder's `.dir` object: `{md5, relpath}` per file, by relpath.
    Walked as DVC walks it (os.walk: file symlinks are read, folder symlinks are not)."""
    entries = []
    for parent, _, names in os.walk(folder):
        for name in names:
            file = Path(parent, name)
            relpath = file.relative_to(folder).as_posix()
            entries.append({"md5": file_digest(file, "md5"), "relpath": relpath})
    return sorted(entries, key=lambda entry: entry["relpath"])


def version_dataset(root: Path, path: str, push: bool = True) -> DatasetVersion:
    """`dvc add` the dataset, a file or a folder (a no-op when unchanged), push it, and return
    its content hash."""
    data = root / path
    if not (data.is_file() or data.is_dir()):
        raise DataError(f"{path}: dataset file not found; set data.path in params.yaml")
    with dvc_lock(root):
        if data.is_dir():
            out = _version_folder(root, path)
        else:
            unchanged = _added_unchanged(root, path)
            if unchanged is not None:
                out = unchanged
            else:
                # `dvc add` of an unchanged file is not a no-op: it rewrites the .dvc file in
                # place and touches the data file. It runs only when something changed.
                dvc(root, "add", "--quiet", path)
                out = _dvc_out(root, path)
        # `dvc push` of a version the remote holds sends nothing but still took 1.6 s.
        if push and not _pushed(root, out["md5"]):
            dvc(root, "push", "--quiet", "--remote", REMOTE, f"{path}.dvc")
    return DatasetVersion(path=path, dvc_md5=out["md5"], size=int(out["size"]))


def _pushed(root: Path, md5: str) -> bool:
    """Whether the remote holds this version's object: the file's, or a folder's `.dir`
    listing, which DVC uploads only after every file it lists. Answered only for the remote
    `configure_remote` points at the store (its options in config.local); anything else, or
    any doubt, leaves it to `dvc push`."""
    options = _local_remote_options(root)
    url = options.get("url", "")
    if not url.startswith("s3://"):
        return False
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    settings = StoreSettings(
        bucket,
        prefix,
        options.get("endpointurl"),
        options.get("access_key_id"),
        options.get("secret_access_key"),
    )
    try:
        return Store(settings).exists(f"files/md5/{md5[:2]}/{md5[2:]}")
    except Exception as exc:  # unreachable, refused, ...: dvc push reports it its own way
        log.debug("cannot tell whether %s is pushed (%s); pushing", md5, exc)
        return False


def _version_folder(root: Path, path: str) -> dict:
    """The folder's .dvc out, `dvc add`ed only when it changed (an unchanged folder's add
    still rewrites its .dvc file, which another run may be reading)."""
    listing = _folder_listing(root / path)
    md5 = listing_md5(listing)
    out = _folder_added_unchanged(root, path, md5, listing)
    if out is not None:
        return out
    dvc(root, "add", "--quiet", path)
    out = _dvc_out(root, path)
    if out.get("md5") != md5:
        # The split cache and resume checks use content_md5; it must be DVC's hash.
        raise DataError(
            f"{path}: DVC versioned the folder as {out.get('md5')}, but its files hash to {md5}; "
            "a .dvcignore pattern probably skips files inside it: move those files out of "
            "the folder or drop the pattern"
        )
    return out


def _dvc_out(root: Path, path: str) -> dict:
    return yaml.safe_load((root / f"{path}.dvc").read_text())["outs"][0]


def _cached(root: Path, md5: str) -> bool:
    """Whether DVC's cache (at its default place) holds the object of this md5."""
    return cache_object(root, md5).is_file()


def _added_unchanged(root: Path, path: str) -> dict | None:
    """The .dvc file's out for `path` if it records the file's current bytes and those bytes
    are in the DVC cache (at its default place): then `dvc add` has nothing to do."""
    if not (root / f"{path}.dvc").is_file():
        return None
    out = _dvc_out(root, path)
    md5, data = out.get("md5"), root / path
    if out.get("hash") != "md5" or not isinstance(md5, str) or len(md5) != 32:
        return None
    if out.get("size") != data.stat().st_size or not _cached(root, md5):
        return None
    return out if content_md5(data) == md5 else None


def _folder_added_unchanged(
    root: Path, path: str, md5: str, listing: list[dict[str, str]]
) -> dict | None:
    """The .dvc file's out for the folder if it records this listing's hash and the cache
    holds the listing and every file (what `dvc push` sends)."""
    if not (root / f"{path}.dvc").is_file():
        return None
    out = _dvc_out(root, path)
    if out.get("hash") != "md5" or out.get("md5") != md5 or "size" not in out:
        return None
    if not _cached(root, md5) or not all(_cached(root, e["md5"]) for e in listing):
        return None
    return out


def configure_remote(root: Path, store: Store) -> None:
    """Point the DVC remote at the store (`<bucket>/<prefix>/dvc`, its endpoint and
    credentials), in config.local only."""
    settings = store.settings
    options = {
        "url": store.uri(REMOTE_FOLDER),  # storage.bucket and storage.prefix, as for runs
        "endpointurl": settings.endpoint_url,
        "access_key_id": settings.access_key,
    }
    wanted = {k: v for k, v in options.items() if v}
    if settings.secret_key:
        wanted["secret_access_key"] = settings.secret_key
    with dvc_lock(root):
        _write_local_remote(root, wanted)
    if settings.endpoint_url and not store.fs.exists(settings.bucket):
        store.fs.mkdir(settings.bucket)


def _write_local_remote(root: Path, wanted: dict[str, str]) -> None:
    """The remote's options in .dvc/config.local, written with configobj, the library DVC
    reads its config with (so the quoting is DVC's own): four `dvc remote modify` processes
    took about 4 s of each new project's first run."""
    local = root / ".dvc" / "config.local"
    if not local.exists():  # private before the secret is written to it
        local.touch(mode=0o600)
    local.chmod(0o600)
    config = _local_config(root)
    section = config.setdefault(f'remote "{REMOTE}"', {})
    if any(section.get(option) != value for option, value in wanted.items()):
        section.update(wanted)
        config.write()
    local.chmod(0o600)  # it holds the store's secret key


def _local_remote_options(root: Path) -> dict[str, str]:
    return dict(_local_config(root).get(f'remote "{REMOTE}"', {}))


def _local_config(root: Path):
    from configobj import ConfigObj  # DVC's own dependency

    return ConfigObj(str(root / ".dvc" / "config.local"), encoding="utf-8", interpolation=False)
