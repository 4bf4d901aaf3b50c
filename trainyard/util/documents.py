"""Reading the store's JSON documents (run records, registry documents) when any of them may
be damaged: truncated, empty, not JSON, or not the schema. A reader that needs one document
gets an `UnreadableDocument` naming it; a listing skips it into `Skipped`, so one bad
document is one warning, never a failed listing. Also how a document's text is printed to
a terminal (`printable`): the store is writable by more hands than the reader's."""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from trainyard.errors import TrainyardError


class DocumentStore(Protocol):
    """What reading a document needs of the store (trainyard.storage.Store has it)."""

    def read_bytes(self, key: str) -> bytes: ...

    def uri(self, key: str) -> str: ...


M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
REASON_MAX = 160  # characters of a parser's complaint kept in a warning


class UnreadableDocument(TrainyardError):
    """A document in the store that exists but cannot be used."""

    def __init__(self, uri: str, reason: str):
        self.uri = printable(uri)  # a listed key may hold any character
        self.reason = reason
        super().__init__(f"{self.uri} cannot be read ({reason})")


def read_model(store: DocumentStore, key: str, model: type[M]) -> M:
    """The document at `key` as `model`. A missing key raises FileNotFoundError (absent is
    not damaged); anything present that does not parse raises `UnreadableDocument`."""
    # Parsed and validated in one pass by pydantic's own JSON reader: a listing of 500
    # records spent a third of its time in json.loads and model_validate.
    data = store.read_bytes(key)
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise UnreadableDocument(store.uri(key), reason(exc, model, data)) from None


def read_each(items: Iterable[T], read: Callable[[T], M], skipped: Skipped | None) -> list[M]:
    """`read(item)` for each item, in order. A damaged document raises `UnreadableDocument`,
    or, given `skipped`, is left out and noted there."""
    found = []
    for item in items:
        try:
            found.append(read(item))
        except UnreadableDocument as exc:
            if skipped is None:
                raise
            skipped.add(exc)
    return found


def reason(exc: ValidationError, model: type[BaseModel], data: bytes) -> str:
    """The first problem only, without the offending value (it may be anything)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    if not data.strip():
        return "empty"
    if first["type"] == "json_invalid":
        return printable(f"not JSON: {first['msg'].removeprefix('Invalid JSON: ')}")[:REASON_MAX]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    extra = f" and {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
    return printable(f"not a {model.__name__}: {where}: {first['msg']}{extra}")[:REASON_MAX]


class Skipped:
    """The documents a listing skipped, from any of its reader threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.documents: list[UnreadableDocument] = []

    def add(self, exc: UnreadableDocument) -> None:
        with self._lock:
            self.documents.append(exc)

    def lines(self) -> list[str]:
        """One warning per document, in a stable order."""
        return [f"skipped {d.uri}: {d.reason}" for d in sorted(self.documents, key=lambda d: d.uri)]

    def __len__(self) -> int:
        return len(self.documents)


def printable(text: str) -> str:
    """`text` safe to print to a terminal: control and format characters (escape sequences,
    carriage returns, bidirectional overrides) shown as \\x.. / \\u.... escapes."""
    return "".join(
        repr(ch)[1:-1] if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in text
    )
