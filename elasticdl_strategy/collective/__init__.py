"""Layer 2: point-to-point messaging and collectives between the ranks of one membership, numpy-level.

A :class:`Communicator` holds this rank's links to its peers (built by
:class:`~elasticdl_strategy.collective.p2p.PointToPoint` over the transport)
and runs the collectives on them: the bandwidth-optimal ring all-reduce
(:mod:`~elasticdl_strategy.collective.ring`), reduce, broadcast, gathers,
scatters, barriers, with optional 16-bit compression. Every rank gets a
bitwise-identical result; a dead peer, a mismatched call or a passed deadline
raises a :class:`~elasticdl_strategy.errors.CommunicationError` on every rank.

This layer knows nothing of the coordinator or of processes joining a job:
:mod:`elasticdl_strategy.runtime` builds a communicator for each membership
and offers the process-level API (``runtime.init()``, ``runtime.allreduce``).
It imports only :mod:`~elasticdl_strategy.transport` and
:mod:`~elasticdl_strategy.errors`.
"""

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.collective.p2p import PointToPoint, Request

__all__ = ["Communicator", "PointToPoint", "Request"]
