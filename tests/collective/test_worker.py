"""The worker's reactions to what the coordinator tells it in heartbeats."""

import numpy as np
import pytest

from elasticdl_strategy.collective.worker import Worker
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.errors import PeerFailureError
from elasticdl_strategy.transport.protos import coordinator_pb2
from tests.cluster import ThreadCluster


def test_a_worker_told_it_was_replaced_fails_its_collectives_at_once():
    with ThreadCluster(2) as cluster:
        membership = Membership(1, tuple(Member(f"w{r}", a) for r, a in enumerate(cluster.addresses)), "formed")
        replaced = Worker(membership, "w0", cluster.communicators[0])
        replaced._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=1, replaced=True))
        with pytest.raises(PeerFailureError, match="w0 was replaced by a new process"):
            cluster.communicators[0].allreduce(np.ones(4, np.float32), timeout=5)
