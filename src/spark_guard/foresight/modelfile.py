"""What every model reader shares: one error family, one opener, one cache by identity.

GGUF headers (gguf.py), safetensors shards (safetensors.py), Ollama's manifests
(ollama.py) and LM Studio's files (lmstudio.py) are a user's files: each is opened
with safefs.open_regular (a FIFO, device or directory is refused, and the open never
waits), a problem is a ModelFileError whose text is 'FILE: problem', one line, and
what was read is kept by (path, identity) so that an unchanged file is not parsed
again, while a changed one is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ..system import safefs

Ident = tuple[int, int, int, int]  # safefs.identity: device, inode, size, mtime
identity = safefs.identity  # what says a file is still the one read


class ModelFileError(ValueError):
    """Not a readable model file; str() is 'FILE: problem', one line."""


class ModelUnreadable(ModelFileError):
    """A file could not be read (an I/O error): nothing said about what is in it."""


class ModelTimeout(ModelFileError):
    """The read went past its deadline."""


class ModelOpenError(ModelUnreadable):
    """A file or directory could not be opened at all (missing, no permission, ...).

    Kept apart so that a caller reading for someone else can give one answer for
    every reason, and so tell no one which paths exist where they cannot look.
    """

    def __init__(self, path: str, err: OSError) -> None:
        super().__init__(f"{path}: cannot open: {err.strerror}")
        self.path = path
        self.errno: int | None = err.errno


def open_regular(
    name: str, *, dir_fd: int | None = None, shown: str | None = None
) -> tuple[int, os.stat_result]:
    """An fd for a regular file and its stat (safefs.open_regular), as a ModelFileError
    naming it (`shown`, for a name relative to `dir_fd`)."""
    shown = shown or name
    try:
        return safefs.open_regular(name, dir_fd=dir_fd, shown=shown)
    except safefs.UnsafePath as e:
        raise ModelFileError(e.strerror) from None
    except OSError as e:
        raise ModelOpenError(shown, e) from None


T = TypeVar("T")


class IdentityCache(Generic[T]):
    """What was read of each file (or why it is not a sound one), by path and identity.

    Bounded by what the entries hold (`cost` of each, 1 by default: a count), least
    recently used out first. The same path at another identity is a file that changed:
    what it was is dropped. A file that failed is not parsed again until it changes.
    Safe to share between threads.
    """

    def __init__(self, max_cost: int, cost: Callable[[T], int] = lambda _: 1) -> None:
        self.max_cost = max_cost
        self._cost_of = cost
        self._items: dict[tuple[str, Ident], T] = {}
        self._cost = 0
        self._lock = threading.Lock()

    def get(self, path: str, ident: Ident) -> T | None:
        with self._lock:
            item = self._items.pop((path, ident), None)
            if item is not None:
                self._items[(path, ident)] = item  # most recently used last
            return item

    def put(self, path: str, ident: Ident, item: T) -> None:
        cost = self._cost_of(item)
        if cost > self.max_cost:
            return
        with self._lock:
            for key in [k for k in self._items if k[0] == path]:
                self._cost -= self._cost_of(self._items.pop(key))
            while self._items and self._cost + cost > self.max_cost:
                self._cost -= self._cost_of(self._items.pop(next(iter(self._items))))
            self._items[(path, ident)] = item
            self._cost += cost

    def __len__(self) -> int:
        return len(self._items)
