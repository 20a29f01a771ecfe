"""A per-thread flag set for the duration of a ``with`` block (nestable)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ThreadFlag:
    """A flag set for the current thread only, inside ``with flag():``.

    >>> suspended = ThreadFlag()
    >>> with suspended():
    ...     suspended.is_set
    True
    >>> suspended.is_set
    False
    """

    def __init__(self):
        self._local = threading.local()

    @property
    def is_set(self) -> bool:
        """Whether this thread is inside a ``with flag():`` block."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
