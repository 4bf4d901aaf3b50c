"""Reading the store's JSON documents (run records, registry documents) when any of them may
be damaged: truncated, empty, not JSON, or not the schema. A reader that needs one document
gets an `UnreadableDocument` naming it; a listing skips it into `Skipped`, so one bad
document is one warning, never a failed listing. Also how a document's text is printed to
a terminal (`printable`): the store is writable by more hands than the reader's."""

from __future__ import annotations

import threading
import unicodedata
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from trainyard.errors import TrainyardError

if TYPE_CHECKING:
    from trainyard.storage import Store

M = TypeVar("M", bound=BaseModel)
REASON_MAX = 160  # characters of a parser's complaint kept in a warning


class UnreadableDocument(TrainyardError):
    """A document in the store that exists but cannot be used."""

    def __init__(self, uri: str, reason: str):
        self.uri = printable(uri)  # a listed key may hold any character
        self.reason = reason
        super().__init__(f"{self.uri} cannot be read ({reason})")


def read_model(store: Store, key: str, model: type[M]) -> M:
    """The document at `key` as `model`. A missing key raises FileNotFoundError (absent is
    not damaged); anything present that does not parse raises `UnreadableDocument`."""
    try:
        return model.model_validate(store.read_json(key))
    except ValidationError as exc:
        raise UnreadableDocument(store.uri(key), schema_reason(exc, model)) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise UnreadableDocument(store.uri(key), json_reason(exc)) from None


def schema_reason(exc: ValidationError, model: type[BaseModel]) -> str:
    """The first problem only, without the offending value (it may be anything)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    extra = f" and {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
    return printable(f"not a {model.__name__}: {where}: {first['msg']}{extra}")[:REASON_MAX]


def json_reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "not JSON: nested too deeply"
    text = str(exc)
    if text.startswith("Expecting value: line 1 column 1 (char 0)"):
        return "empty or not JSON"
    return printable(f"not JSON: {text}")[:REASON_MAX]


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
