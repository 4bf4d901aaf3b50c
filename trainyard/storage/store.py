"""The artifact store: any S3-compatible object store, reached through s3fs.

Settings travel to torchrun workers as environment variables (never on the command line);
each process builds its own filesystem object because s3fs is not fork-safe.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec.asyn
import s3fs
from botocore.exceptions import BotoCoreError, ClientError

from trainyard.errors import StoreError

ENDPOINT_ENV = "TRAINYARD_S3_ENDPOINT"
BUCKET_ENV = "TRAINYARD_S3_BUCKET"
PREFIX_ENV = "TRAINYARD_S3_PREFIX"


@dataclass(frozen=True)
class StoreSettings:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None  # None means AWS S3
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)

    def worker_env(self) -> dict[str, str]:
        """What a child process needs to reach the same store."""
        env = {
            ENDPOINT_ENV: self.endpoint_url or "aws",
            BUCKET_ENV: self.bucket,
            PREFIX_ENV: self.prefix,
        }
        if self.access_key and self.secret_key:
            env |= {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        return env

    @classmethod
    def from_worker_env(cls) -> StoreSettings:
        endpoint = os.environ.get(ENDPOINT_ENV, "aws")
        return cls(
            bucket=os.environ[BUCKET_ENV],
            prefix=os.environ.get(PREFIX_ENV, ""),
            endpoint_url=None if endpoint == "aws" else endpoint,
            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        )

    @property
    def where(self) -> str:
        """Human-readable location, safe to print (no credentials)."""
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint_url or 'AWS S3'}"


class Store:
    """Keys are relative to `s3://bucket/prefix/`."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        client_kwargs: dict[str, Any] = {}
        if settings.endpoint_url:
            # Path-style addressing and a fixed region keep S3-compatible servers happy.
            client_kwargs = {"endpoint_url": settings.endpoint_url, "region_name": "us-east-1"}
        self.fs = s3fs.S3FileSystem(
            key=settings.access_key,
            secret=settings.secret_key,
            client_kwargs=client_kwargs,
            config_kwargs={"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 3}},
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def _path(self, key: str) -> str:
        return "/".join(part for part in (self.settings.bucket, self.settings.prefix, key) if part)

    def uri(self, key: str) -> str:
        return f"s3://{self._path(key)}"

    def key_of(self, uri: str) -> str:
        root = self.uri("") + "/"
        if not uri.startswith(root):
            raise StoreError(f"{uri} is not inside this store ({root})")
        return uri[len(root) :]

    def check(self) -> None:
        """Fail early, and clearly, when the store cannot be used."""
        where = self.settings.endpoint_url or "AWS S3"
        try:
            # The bucket itself, not the prefix: some servers create buckets on first write.
            self.fs.ls(self.settings.bucket, detail=False)
        except FileNotFoundError:
            raise StoreError(
                f"bucket '{self.settings.bucket}' not found at {where}; create it or set storage.bucket"
            ) from None
        except PermissionError:
            raise StoreError(
                f"access to bucket '{self.settings.bucket}' at {where} was denied; "
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            ) from None
        except (OSError, BotoCoreError) as exc:
            raise StoreError(
                f"cannot reach the artifact store at {where} ({type(exc).__name__}); "
                "is it running? (`trainyard storage status`)"
            ) from None

    def put_file(self, local: Path, key: str) -> str:
        self.fs.put_file(str(local), self._path(key))
        return self.uri(key)

    def get_file(self, key: str, local: Path) -> Path:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._path(key), str(local))
        return local

    def put_bytes(self, key: str, data: bytes) -> str:
        self.fs.pipe_file(self._path(key), data)
        return self.uri(key)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist (a PUT with `If-None-Match: *`): True if this
        call created it, False if it was there already (someone else's, or ours from a
        retried request: callers check)."""
        try:
            self.fs.pipe_file(self._path(key), data, IfNoneMatch="*")
        except FileExistsError:  # s3fs's translation when AWS names the condition
            return False
        except OSError as exc:
            if _precondition_failed(exc):  # SeaweedFS: 412 without the condition's name
                return False
            raise
        return True

    def create_json(self, key: str, obj: Any) -> bool:
        """`create_bytes` of `obj` as JSON, as `write_json` writes it."""
        return self.create_bytes(key, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def get_bytes(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def get_bytes_and_time(self, key: str) -> tuple[bytes, float]:
        """The object and when the store last saw it written (its Last-Modified, a Unix time
        by the store's clock), from one GET. A missing key raises FileNotFoundError."""
        bucket, path, _ = self.fs.split_path(self._path(key))

        async def get() -> tuple[bytes, float]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=path)
            try:
                return await response["Body"].read(), response["LastModified"].timestamp()
            finally:
                response["Body"].close()

        return fsspec.asyn.sync(self.fs.loop, get)

    def stamp(self, key: str) -> float:
        """The store's own time now: write an empty object at `key` and return its
        Last-Modified (no more than the store's time when this returns). Read back with a
        HEAD, never from s3fs's caches."""
        self.put_bytes(key, b"")
        return self.fs.info(self._path(key), refresh=True)["LastModified"].timestamp()

    def write_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))

    def read_bytes(self, key: str) -> bytes:
        """One GET (a missing key raises FileNotFoundError): small files skip s3fs's size probe."""
        return self.fs.cat_file(self._path(key), max_concurrency=1)

    def delete(self, key: str, recursive: bool = False) -> None:
        self.fs.rm(self._path(key), recursive=recursive)

    def delete_files(self, keys: list[str]) -> None:
        """Named objects in one bulk request (no listing)."""
        if keys:
            self.fs.rm([self._path(key) for key in keys])

    def size(self, key: str) -> int | None:
        """The object's size, or None if there is none."""
        try:
            return self.fs.info(self._path(key))["size"]
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def list_files(self, key: str) -> dict[str, int]:
        """Every object under `key` (recursively): its key -> size."""
        return {name: info["size"] for name, info in self._find(key).items()}

    def list_etags(self, key: str) -> dict[str, str]:
        """Every object under `key` (recursively): its key -> ETag, which changes whenever
        the object is written again; one paged listing, however many objects."""
        return {name: info.get("ETag", "") for name, info in self._find(key).items()}

    def _find(self, key: str) -> dict[str, dict]:
        try:
            found = self.fs.find(self._path(key), detail=True)
        except FileNotFoundError:
            return {}
        root = self._path("")
        return {
            name[len(root) + 1 :]: info for name, info in found.items() if info["type"] == "file"
        }

    def list_dirs(self, key: str) -> list[str]:
        """Names of the immediate sub-folders of `key`."""
        try:
            entries = self.fs.ls(self._path(key), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")


def _precondition_failed(exc: OSError) -> bool:
    cause = exc.__cause__
    if not isinstance(cause, ClientError):
        return False
    response = cause.response
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "PreconditionFailed" or status == 412
