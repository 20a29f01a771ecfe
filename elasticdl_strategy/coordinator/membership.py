"""The membership a worker sees: who is in the job, in which order, at which version."""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Tuple

from elasticdl_strategy.transport.data_socket import host_of
from elasticdl_strategy.transport.protos import coordinator_pb2


@dataclasses.dataclass(frozen=True)
class Member:
    worker_id: str
    address: str
    host: str = ""  # what tells hosts apart (a Kubernetes node's name); "": the address's host


@dataclasses.dataclass(frozen=True)
class Membership:
    """A published membership. Ranks are positions in ``members`` (join order, oldest first).

    Example::

        m = Membership(3, (Member("a", "10.0.0.1:7000"), Member("b", "10.0.0.2:7000")))
        m.rank_of("b")   # 1
        m.size           # 2
    """

    version: int
    members: Tuple[Member, ...]
    reason: str = ""

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def addresses(self) -> Tuple[str, ...]:
        return tuple(m.address for m in self.members)

    @property
    def hosts(self) -> Tuple[str, ...]:
        """The host of every rank: the one it reported, else its address's.

        >>> Membership(1, (Member("a", "10.0.0.1:7000", "node-1"), Member("b", "10.0.0.2:7000"))).hosts
        ('node-1', '10.0.0.2')
        """
        return tuple(m.host or host_of(m.address) for m in self.members)

    def rank_of(self, worker_id: str) -> int:
        """Returns the rank of ``worker_id``, or -1 when it is not a member."""
        return self._ranks.get(worker_id, -1)

    def to_proto(self) -> coordinator_pb2.Membership:
        """A new message holding this membership."""
        return coordinator_pb2.Membership.FromString(self._serialized)

    # A coordinator answers every worker's long poll with the same membership: at a thousand
    # members, building it member by member for each answer dominated the time to form a job.
    @functools.cached_property
    def _ranks(self) -> Dict[str, int]:
        return {m.worker_id: rank for rank, m in enumerate(self.members)}

    @functools.cached_property
    def _serialized(self) -> bytes:
        return coordinator_pb2.Membership(
            version=self.version,
            members=[
                coordinator_pb2.Member(worker_id=m.worker_id, address=m.address, host=m.host) for m in self.members
            ],
            reason=self.reason,
        ).SerializeToString()

    @classmethod
    def from_proto(cls, proto: coordinator_pb2.Membership) -> "Membership":
        members = tuple(Member(m.worker_id, m.address, m.host) for m in proto.members)
        return cls(proto.version, members, proto.reason)


EMPTY = Membership(0, ())
