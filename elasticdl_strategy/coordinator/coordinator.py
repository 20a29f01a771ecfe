"""The coordinator: rendezvous, membership versions, heartbeats, commits and data shards.

One coordinator runs per job, in its own process (the local launcher starts it;
on Kubernetes the master pod runs it). Every decision is a pure function of its
state and an event (:mod:`~elasticdl_strategy.coordinator.transitions`, where the
rules are written down); :class:`Coordinator` is the thin executor around them:
it holds the current :class:`~elasticdl_strategy.coordinator.state.JobState`,
reads the clock, applies one event at a time, logs, and wakes waiting calls.
The gRPC service (:mod:`~elasticdl_strategy.coordinator.service`) turns calls
into events, waits and probes in an event loop, so a long poll holds no thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import grpc

from elasticdl_strategy.coordinator import events
from elasticdl_strategy.coordinator.changes import Changes
from elasticdl_strategy.coordinator.membership import Membership
from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.shards import DatasetSpec, ShardTables
from elasticdl_strategy.coordinator.state import JobState
from elasticdl_strategy.coordinator.transitions import transition
from elasticdl_strategy.errors import UsageError
from elasticdl_strategy.transport.protos import coordinator_pb2

logger = logging.getLogger(__name__)


class Coordinator:
    """Applies events to a job's state, one at a time, from any thread.

    Example:

    >>> from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
    >>> from elasticdl_strategy.transport.protos import coordinator_pb2 as pb
    >>> c = Coordinator(CoordinatorParams(WorkerCounts.of(2)))
    >>> for worker_id in ("a", "b"):
    ...     _ = c.handle(events.Register(pb.RegisterRequest(worker_id=worker_id, address=f"h:{worker_id}")))
    >>> c.membership.version, [m.worker_id for m in c.membership.members]
    (1, ['a', 'b'])
    >>> c.handle(events.Poll(pb.GetMembershipRequest(worker_id="a", after_version=1)))
    Wait()
    """

    def __init__(self, params: CoordinatorParams, clock: Callable[[], float] = time.monotonic):
        self.params = params
        self._clock = clock
        self._lock = threading.Lock()
        self._state = JobState()
        self.changes = Changes()  # notified whenever a waiting call may have its answer
        self.shards = ShardTables()

    def handle(self, event: events.Event) -> Optional[events.Answer]:
        """Applies ``event`` now; returns the answer to its call (``None`` for events without one)."""
        with self._lock:
            step = transition(self.params, self._state, event, self._clock())
            self._state = step.state
            for level, message, args in step.logs:  # under the lock: lines in the order of the changes
                logger.log(level, message, *args)
        if step.wake:
            self.changes.notify()
        return step.answer

    @property
    def state(self) -> JobState:
        """The current state (immutable: a snapshot)."""
        return self._state

    @property
    def membership(self) -> Membership:
        return self._state.membership

    @property
    def finished(self) -> bool:
        """Whether a worker reported that training finished (``Leave(finished=True)``)."""
        return self._state.finished

    @property
    def last_commit(self) -> coordinator_pb2.CommitRecord:
        """A copy of the last recorded commit."""
        return coordinator_pb2.CommitRecord.FromString(self._state.last_commit.SerializeToString())

    def reap(self) -> None:
        """Lets time pass: workers silent past the heartbeat timeout die, a pending membership may form."""
        self.handle(events.Tick())

    def stop(self) -> None:
        """Ends every wait: callers waiting for a change get their answer now."""
        self.handle(events.Stop())

    def get_shards(self, request) -> events.Answer:
        """The shards of ``request.epoch`` of the job's dataset (registered by the first call); a
        spec that is invalid or differs from the registered one is refused (``INVALID_ARGUMENT``)."""
        s = request.spec
        try:
            spec = DatasetSpec(s.num_records, s.shard_size, s.seed, s.shuffle, s.fingerprint)
            starts, ends = self.shards.get(spec, request.epoch)
        except UsageError as e:
            return events.Refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return events.Reply(coordinator_pb2.GetShardsResponse(starts=starts.tolist(), ends=ends.tolist()))
