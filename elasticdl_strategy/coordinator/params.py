"""How a coordinator forms and keeps the membership: its parameters and the limits they imply."""

from __future__ import annotations

import dataclasses

from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.errors import ConfigError

# Longest a GetMembership call may block, so that callers' deadlines stay short.
MAX_MEMBERSHIP_WAIT_S = 30.0
# Heartbeats the coordinator asks for per second at most: a job that may grow past this many workers
# per heartbeat interval heartbeats less often (each heartbeat costs the coordinator's one event
# loop ~0.3 ms of CPU; measured with benchmarks/control_plane.py).
MAX_HEARTBEATS_PER_S = 250


@dataclasses.dataclass(frozen=True)
class CoordinatorParams:
    """How the coordinator forms and keeps the membership.

    Args:
        counts: fewest workers to form a membership with (``min_workers``), most
            in one (``max_workers``; later registrants wait as standbys); the first
            membership is formed as soon as ``counts.target`` have registered (or,
            with at least ``min_workers``, ``last_call_s`` after the
            ``min_workers``-th registered).
        heartbeat_interval_s: how often workers heartbeat; jobs of more than
            :data:`MAX_HEARTBEATS_PER_S` × this many workers are asked for less
            (:attr:`worker_heartbeat_interval_s`).
        heartbeat_timeout_s: silence after which a worker is declared dead.
        last_call_s: see ``counts``.

    Raises:
        ConfigError: the interval is not positive and below the timeout, or ``last_call_s`` is negative.
    """

    counts: WorkerCounts = WorkerCounts(1, 1, 1)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    last_call_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be positive and below "
                f"heartbeat_timeout_s={self.heartbeat_timeout_s}"
            )
        if self.last_call_s < 0:
            raise ConfigError(f"last_call_s={self.last_call_s} must not be negative")

    @property
    def worker_heartbeat_interval_s(self) -> float:
        """The interval workers are told to heartbeat at: ``heartbeat_interval_s``, or longer for a
        job that may hold more than :data:`MAX_HEARTBEATS_PER_S` workers per second of it (but
        never past a third of the timeout, so that one late heartbeat is not a death).

        >>> large = CoordinatorParams(WorkerCounts.of(1000), heartbeat_interval_s=1, heartbeat_timeout_s=30)
        >>> large.worker_heartbeat_interval_s
        4.0
        >>> CoordinatorParams(WorkerCounts.of(64)).worker_heartbeat_interval_s
        1.0
        """
        spread = self.counts.max_workers / MAX_HEARTBEATS_PER_S
        return max(self.heartbeat_interval_s, min(spread, self.heartbeat_timeout_s / 3))

    @property
    def reap_period_s(self) -> float:
        """How often the coordinator should look for silent workers (a :class:`~.events.Tick`)."""
        return min(self.heartbeat_interval_s, self.heartbeat_timeout_s / 4, 0.5)
