"""A process's small cache of the most recently used values, safe across threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most `keep` values, the least recently put one dropped first."""

    def __init__(self, keep: int):
        self.keep = keep
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()  # flows and their tasks run in threads

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._values.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.keep:
                self._values.popitem(last=False)
