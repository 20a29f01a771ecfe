"""Waiting for the coordinator's state to change, in an event loop, without a thread per waiter."""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable, Dict, List, Optional, Set, Tuple, TypeVar

T = TypeVar("T")


class Changes:
    """Wakes coroutines waiting for a state change; :meth:`notify` may be called from any thread.

    A waiter asks its question again after every change, so a change that
    does not concern it costs one call of its function.

    Example:

    >>> import asyncio
    >>> changes, state = Changes(), {"version": 0}
    >>> async def main():
    ...     waiter = asyncio.ensure_future(changes.wait_for(lambda: state["version"] or None, timeout=5))
    ...     await asyncio.sleep(0)
    ...     state["version"] = 2
    ...     changes.notify()
    ...     return await waiter
    >>> asyncio.run(main())
    2
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: Set[Tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        by_loop: Dict[asyncio.AbstractEventLoop, List[asyncio.Future]] = collections.defaultdict(list)
        for loop, future in waiters:
            by_loop[loop].append(future)
        for loop, futures in by_loop.items():  # one wake-up per loop, not one per waiter (a thousand at a barrier)
            try:
                loop.call_soon_threadsafe(_wake, futures)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    async def wait_for(self, answer: Callable[[], Optional[T]], timeout: float) -> Optional[T]:
        """Returns ``answer()`` once it is not ``None``, or ``None`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            future = loop.create_future()
            entry = (loop, future)
            with self._lock:  # listen before asking: a change in between is not missed
                self._waiters.add(entry)
            try:
                result = answer()
                remaining = deadline - loop.time()
                if result is not None or remaining <= 0:
                    return result
                await asyncio.wait([future], timeout=remaining)
            finally:
                with self._lock:
                    self._waiters.discard(entry)


def _wake(futures: List[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
