"""The worker's reactions to what the coordinator tells it in heartbeats."""

import types

import numpy as np
import pytest

from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.errors import PeerFailureError
from elasticdl_strategy.runtime.worker import Worker
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2
from tests.cluster import ThreadCluster


def test_a_worker_told_it_was_replaced_fails_its_collectives_at_once():
    with ThreadCluster(2) as cluster:
        membership = Membership(1, tuple(Member(f"w{r}", a) for r, a in enumerate(cluster.addresses)), "formed")
        replaced = Worker(membership, "w0", cluster.communicators[0])
        replaced._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=1, replaced=True))
        with pytest.raises(PeerFailureError, match="w0 was replaced by a new process"):
            cluster.communicators[0].allreduce(np.ones(4, np.float32), timeout=5)


class FakeCoordinator:
    """What a worker asks the coordinator from its heartbeat handler."""

    def __init__(self, latest: Membership):
        self.latest = latest
        self.registrations = 0

    def get_membership(self):
        return self.latest

    def register(self, *args, **kwargs):
        self.registrations += 1


def _worker(cluster, latest, elastic, peer_address=None):
    addresses = list(cluster.addresses)
    if peer_address is not None:
        addresses[1] = peer_address
    membership = Membership(1, tuple(Member(f"w{r}", a) for r, a in enumerate(addresses)), "formed")
    env = types.SimpleNamespace(transport=TransportOptions(), peer_host="127.0.0.1", rendezvous_timeout_s=5)
    server = types.SimpleNamespace(port=1)
    worker = Worker(membership, "w0", cluster.communicators[0], server, FakeCoordinator(latest), env)
    if elastic:
        worker.enter_elastic_loop()
    return worker


def _without_w1(cluster):
    return Membership(2, (Member("w0", cluster.addresses[0]),), "w1 missed heartbeats")


def test_a_job_that_is_not_elastic_keeps_a_peer_the_coordinator_dropped_while_it_answers(caplog):
    with ThreadCluster(2) as cluster:
        worker = _worker(cluster, _without_w1(cluster), elastic=False)
        for _ in range(2):  # probed once, warned once
            worker._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=2, known=True))
        for result in cluster.run(lambda c: c.allreduce(np.full(3, c.rank + 1.0), timeout=5)):
            np.testing.assert_array_equal(result, [3.0, 3.0, 3.0])
        assert sum("answers its health check" in r.getMessage() for r in caplog.records) == 1


def test_a_job_that_is_not_elastic_fails_a_dropped_peer_that_does_not_answer():
    with ThreadCluster(2) as cluster:
        worker = _worker(cluster, _without_w1(cluster), elastic=False, peer_address="127.0.0.1:1")
        worker._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=2, known=True))
        with pytest.raises(PeerFailureError, match="removed it in membership version 2"):
            cluster.communicators[0].allreduce(np.ones(4, np.float32), timeout=5)


def test_an_elastic_job_follows_the_coordinator_at_once():
    with ThreadCluster(2) as cluster:
        worker = _worker(cluster, _without_w1(cluster), elastic=True)
        worker._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=2, known=True))
        with pytest.raises(PeerFailureError, match="removed it in membership version 2"):
            cluster.communicators[0].allreduce(np.ones(4, np.float32), timeout=5)


def test_an_elastic_worker_declared_dead_stops_training_in_the_old_membership():
    # Every member declared dead at once (say, a coordinator too busy to take heartbeats): none
    # of their streams breaks, yet each must leave the membership the coordinator abandoned.
    with ThreadCluster(2) as cluster:
        worker = _worker(cluster, Membership(2, (), "all missed heartbeats"), elastic=True)
        worker._on_heartbeat(coordinator_pb2.HeartbeatResponse(membership_version=2, known=False))
        assert worker.client.registrations == 1  # it registers again, to rejoin
        with pytest.raises(PeerFailureError, match="declared this worker dead"):
            cluster.communicators[0].allreduce(np.ones(4, np.float32), timeout=5)
