"""Retrying idempotent calls: which gRPC codes are worth another attempt, and how long to pause.

One helper for every retry loop of the package: pauses grow exponentially
(50 ms, doubling, at most 1 s) with jitter, so that workers retrying against a
restarting coordinator neither hammer it nor wait in step, and a
:class:`Deadline` bounds the whole loop.

>>> pauses = backoff(jitter=0)
>>> [round(next(pauses), 2) for _ in range(6)]
[0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterator

import grpc

# The call did not reach a server that could answer it (yet): another attempt may.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def retryable(error: grpc.RpcError) -> bool:
    """Whether an idempotent call that failed with ``error`` is worth another attempt."""
    return error.code() in RETRYABLE_CODES


def backoff(
    first_s: float = 0.05,
    max_s: float = 1.0,
    factor: float = 2.0,
    jitter: float = 0.2,
    rng: Callable[[], float] = random.random,
) -> Iterator[float]:
    """Endless pauses: ``first_s``, multiplied by ``factor`` up to ``max_s``, each spread by ``±jitter``."""
    pause = first_s
    while True:
        yield pause * (1.0 + jitter * (2.0 * rng() - 1.0))
        pause = min(max_s, pause * factor)


class Deadline:
    """A point in time that bounds a loop of attempts.

    >>> deadline = Deadline(0.0)
    >>> deadline.expired(), deadline.pause(0.1)
    (True, False)
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic, sleep=time.sleep):
        self._clock, self._sleep = clock, sleep
        self.at = clock() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self.at

    def pause_at_most(self, seconds: float) -> None:
        """Sleeps ``seconds``, or until the deadline if that comes first."""
        self._sleep(min(seconds, self.remaining()))

    def pause(self, seconds: float) -> bool:
        """Sleeps ``seconds`` before the next attempt; ``False`` (without sleeping) if that would pass the deadline."""
        if self._clock() + seconds > self.at:
            return False
        self._sleep(seconds)
        return True
