"""How many workers a job has, validated in one place for both launchers and the coordinator."""

from __future__ import annotations

import dataclasses
from typing import Optional

from elasticdl_strategy.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WorkerCounts:
    """The worker counts of a job; construction raises a one-line ConfigError naming the flag.

    Attributes:
        workers: workers started at first (``--workers``).
        min_workers: fewest to train with; below it training waits (``--min-workers``).
        max_workers: most in a membership; workers beyond it wait as standbys (``--max-workers``).
        max_restarts: relaunches of failed workers (``--max-restarts``).

    >>> WorkerCounts.of(4, min_workers=2)
    WorkerCounts(workers=4, min_workers=2, max_workers=4, max_restarts=0)
    >>> WorkerCounts.of(4, max_workers=2).target
    2
    >>> WorkerCounts.of(2, min_workers=3)
    Traceback (most recent call last):
    ...
    elasticdl_strategy.errors.ConfigError: --min-workers=3 must be between 1 and --workers=2
    """

    workers: int
    min_workers: int
    max_workers: int
    max_restarts: int = 0

    @classmethod
    def of(
        cls,
        workers: int,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        max_restarts: int = 0,
    ) -> "WorkerCounts":
        """Counts with the defaults of the flags: ``max_workers`` = ``workers``, ``min_workers`` = the target."""
        max_workers = workers if max_workers is None else max_workers
        min_workers = min(workers, max_workers) if min_workers is None else min_workers
        return cls(workers, min_workers, max_workers, max_restarts)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers={self.workers} must be at least 1")
        if not 1 <= self.min_workers <= self.workers:
            raise ConfigError(f"--min-workers={self.min_workers} must be between 1 and --workers={self.workers}")
        if self.max_workers < self.min_workers:
            raise ConfigError(f"--max-workers={self.max_workers} must be at least --min-workers={self.min_workers}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts} must not be negative")

    @property
    def target(self) -> int:
        """The size of the first membership: the workers started, up to ``max_workers``."""
        return min(self.workers, self.max_workers)

    @property
    def elastic(self) -> bool:
        """Whether the job survives the loss of a worker (it may shrink, restart or has standbys)."""
        return self.min_workers < self.target or self.max_restarts > 0 or self.workers > self.max_workers
