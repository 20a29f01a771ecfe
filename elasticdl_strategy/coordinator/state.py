"""What a coordinator knows about its job, as plain immutable data.

:mod:`~elasticdl_strategy.coordinator.transitions` computes each new
:class:`JobState` from the last one and an event; nothing changes a state in place.
Protocol messages held here (``last_commit``) are never modified either: a
change stores a new message.
"""

from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional

from elasticdl_strategy.coordinator.membership import EMPTY, Membership
from elasticdl_strategy.transport.protos import coordinator_pb2


@dataclasses.dataclass(frozen=True)
class Worker:
    """One registered worker process.

    ``join_order`` is unique per registration: it tells a process apart from a later one under the
    same id, so that a health probe's answer about one is never applied to the other.
    """

    worker_id: str
    address: str
    join_order: int
    last_heartbeat: float
    alive: bool = True
    # False for members adopted from another worker's report after a coordinator restart, until
    # they register themselves: their heartbeats are answered "unknown" so that they report their
    # own last commit (it may be newer).
    reported: bool = True
    incarnation: str = ""  # the registering process; "" when unknown (adopted from another worker's report)
    host: str = ""  # as Member.host


@dataclasses.dataclass(frozen=True)
class JobState:
    """The membership state of a job.

    Attributes:
        workers: every worker that registered, by id (dead ones too, until their id registers again).
        joins: registrations so far (the last ``join_order`` handed out).
        polling: workers with open membership long polls, and how many: a worker that waits is alive.
        membership: the last published membership (version 0: none yet).
        min_reached_at: when ``min_workers`` had first registered, while forming the first membership.
        last_commit: the last recorded commit.
        finished: a worker reported that training finished.
        stopped: the coordinator is stopping: every wait ends.
    """

    workers: Mapping[str, Worker] = dataclasses.field(default_factory=dict)
    joins: int = 0
    polling: Mapping[str, int] = dataclasses.field(default_factory=dict)
    membership: Membership = EMPTY
    min_reached_at: Optional[float] = None
    last_commit: coordinator_pb2.CommitRecord = dataclasses.field(default_factory=coordinator_pb2.CommitRecord)
    finished: bool = False
    stopped: bool = False

    def live(self) -> List[Worker]:
        """The live workers in join order."""
        return sorted((w for w in self.workers.values() if w.alive), key=lambda w: w.join_order)

    def live_count(self) -> int:
        return sum(1 for w in self.workers.values() if w.alive)

    def replaced(self, worker_id: str, incarnation: str) -> bool:
        """Whether a newer process than ``incarnation`` registered as ``worker_id``."""
        worker = self.workers.get(worker_id)
        return bool(worker is not None and worker.incarnation and incarnation and worker.incarnation != incarnation)
