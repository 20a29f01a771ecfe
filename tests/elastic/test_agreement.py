"""The commit vote: members agree by an all-reduce, rank 0 alone records the commit, all get its answer."""

import types

import numpy as np
import pytest

from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.coordinator.position import Position
from elasticdl_strategy.elastic import agreement
from elasticdl_strategy.errors import CollectiveMismatchError, CollectiveTimeoutError
from elasticdl_strategy.transport.protos import coordinator_pb2
from tests.cluster import ThreadCluster

IDS = ["w0", "w1", "w2"]


class Coordinator:
    """What rank 0 calls: records every commit it is sent, answers ``response`` (or raises ``error``)."""

    def __init__(self, response=None, error=None):
        self.sent = []
        self.response = response or coordinator_pb2.CommitResponse(recorded=True, membership_version=4)
        self.error = error

    def commit(self, version, commit_id, position, leaving_workers, timeout, on_unavailable):
        self.sent.append((version, commit_id, Position.from_proto(position), list(leaving_workers)))
        if self.error is not None:
            raise self.error
        return self.response


@pytest.fixture(scope="module")
def cluster():
    with ThreadCluster(3) as cluster:
        yield cluster


def _worker(communicator, coordinator):
    membership = Membership(3, tuple(Member(w, f"h:{w}") for w in IDS), "formed")
    return types.SimpleNamespace(
        communicator=communicator, membership=membership, client=coordinator, reregister=lambda: None
    )


def _commit_on_every_rank(cluster, coordinator, commit_ids=(7, 7, 7), positions=None, leaving=()):
    positions = positions or [Position(1, 3, 96)] * 3

    def commit(communicator):
        rank = communicator.rank
        worker = _worker(communicator, coordinator)
        return agreement.commit_for_all(worker, commit_ids[rank], positions[rank], rank in leaving)

    return cluster.run_outcomes(commit)


def test_rank_0_alone_records_the_agreed_commit_naming_the_leavers_and_all_get_its_answer(cluster):
    coordinator = Coordinator()
    outcomes = _commit_on_every_rank(cluster, coordinator, leaving=(1, 2))
    assert coordinator.sent == [(3, 7, Position(1, 3, 96), ["w1", "w2"])]
    assert [(o.recorded, o.membership_version) for o in outcomes] == [(True, 4)] * 3


def test_members_committing_different_ids_all_raise_mismatch_and_nothing_is_recorded(cluster):
    coordinator = Coordinator()
    outcomes = _commit_on_every_rank(cluster, coordinator, commit_ids=(7, 8, 7))
    assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
    assert all("different ids (#7 to #8" in str(o) for o in outcomes)
    assert coordinator.sent == []


def test_members_at_different_data_positions_all_raise_mismatch(cluster):
    coordinator = Coordinator()
    positions = [Position(1, 3, 96), Position(1, 3, 96), Position(1, 4, 96)]
    outcomes = _commit_on_every_rank(cluster, coordinator, positions=positions)
    assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
    assert all("from epoch 1, batch 3, record 96 to epoch 1, batch 4, record 96" in str(o) for o in outcomes)
    assert coordinator.sent == []


def test_when_rank_0_cannot_record_the_commit_the_others_learn_it_was_not_recorded(cluster):
    coordinator = Coordinator(error=CollectiveTimeoutError("commit #7 not recorded within 20s: unreachable"))
    outcomes = _commit_on_every_rank(cluster, coordinator)
    assert isinstance(outcomes[0], CollectiveTimeoutError)
    for other in outcomes[1:]:
        assert not other.recorded and other.membership_version == 3
        assert "rank 0 could not record it: commit #7 not recorded within 20s" in other.reason


def test_an_answer_too_long_to_share_keeps_its_start_and_says_it_was_cut():
    response = coordinator_pb2.CommitResponse(recorded=True, membership_version=9, reason="é" * 2000)
    shared = np.zeros(agreement.RESPONSE_BYTES, np.uint8)
    agreement.encode(response, shared)
    decoded = agreement.decode(shared)
    assert decoded.recorded and decoded.membership_version == 9
    assert decoded.reason.endswith("...") and decoded.reason.startswith("é" * 100)
    short = coordinator_pb2.CommitResponse(recorded=False, membership_version=2, reason="b left")
    agreement.encode(short, shared)
    assert agreement.decode(shared) == short
