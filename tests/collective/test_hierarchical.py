"""Hierarchical all-reduce: ranks grouped by host, reduced to one leader per host, a ring among the
leaders, the result sent back; the same bits on every rank, the bytes each rank sends as the
algorithm says, and the flat ring when it does not apply or is switched off."""

import dataclasses

import numpy as np
import pytest

from elasticdl_strategy.collective import cost_model, hierarchical
from elasticdl_strategy.errors import CommunicationError
from tests.cluster import ThreadCluster, transport_options
from tests.collective.reference import assert_close, assert_identical, make_input, reduce_reference

LARGE = 3 << 20  # bytes: the ring's size, one piece, divisible by 2 and 3 hosts in any dtype


def test_host_groups_keep_rank_order_and_apply_only_across_hosts_with_several_workers():
    assert hierarchical.host_groups(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert hierarchical.applies([[0, 2], [1, 3]])
    assert not hierarchical.applies([[0, 1, 2, 3]])  # one host
    assert not hierarchical.applies([[0], [1], [2]])  # one worker per host


@pytest.mark.parametrize(
    "hosts, nbytes",
    [
        (("a", "a", "b", "b"), LARGE),
        (("a", "b", "a", "b"), LARGE),
        (("a", "a", "b"), LARGE),
        (("a", "a", "a", "b"), LARGE),
        (("a", "b", "b", "c"), LARGE),
        (("a", "a", "b", "b"), 10 << 20),  # in pieces of 4, 4 and 2 MiB
        (("a", "a", "a", "b"), 10 << 20),
    ],
)
@pytest.mark.parametrize("transport", ["shared-memory", "data-socket"])
def test_every_rank_gets_the_same_bits_and_sends_what_the_hierarchy_says(hosts, nbytes, transport):
    n = len(hosts)
    groups = hierarchical.host_groups(hosts)
    assert cost_model.choose(nbytes, n) == "ring"
    with ThreadCluster(n, transport_options(transport), hosts=hosts) as cluster:
        for op, dtype in (("sum", "float32"), ("max", "int64")):
            inputs = [make_input(7, r, (nbytes // np.dtype(dtype).itemsize,), dtype, op) for r in range(n)]
            before = [c.p2p.bytes_sent for c in cluster.communicators]
            results = cluster.run(lambda c: c.allreduce(inputs[c.rank], op=op))
            sent = [c.p2p.bytes_sent - b for c, b in zip(cluster.communicators, before)]
            assert_identical(results)
            assert_close(results[0], reduce_reference(inputs, op))
            for group in groups:
                for member in group[1:]:
                    assert sent[member] == nbytes, (hosts, sent)  # its array to the leader, nothing else
                ring = 2 * (len(groups) - 1) * nbytes // len(groups)
                assert sent[group[0]] == (len(group) - 1) * nbytes + ring, (hosts, sent)


def test_switched_off_or_on_one_host_it_is_the_flat_ring():
    flat = 2 * 3 * LARGE // 4  # 2(N-1)/N of the array, from every rank
    for options, hosts in (
        (dataclasses.replace(transport_options("shared-memory"), hierarchical=False), ("a", "a", "b", "b")),
        (transport_options("shared-memory"), ("a", "a", "a", "a")),
    ):
        with ThreadCluster(4, options, hosts=hosts) as cluster:
            cluster.run(lambda c: c.barrier())  # on one host, the ranks agree on a host segment here
            before = [c.p2p.bytes_sent for c in cluster.communicators]
            cluster.run(lambda c: c.allreduce(np.ones(LARGE // 4, np.float32)))
            assert [c.p2p.bytes_sent - b for c, b in zip(cluster.communicators, before)] == [flat] * 4


def test_small_arrays_keep_their_latency_algorithm():
    with ThreadCluster(4, transport_options("shared-memory"), hosts=("a", "a", "b", "b")) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(1024, c.rank + 1, np.float32)))
        assert_identical(results)
        assert results[0][0] == 10
        # Recursive doubling: log2(4) = 2 arrays from every rank (the hierarchy: 4 KiB from members).
        assert [c.p2p.bytes_sent for c in cluster.communicators] == [2 * 4096] * 4


@pytest.mark.parametrize("gone", [1, 2], ids=["a-member", "a-leader"])
def test_a_member_or_leader_that_leaves_fails_the_all_reduce_on_every_other_rank(gone):
    with ThreadCluster(4, transport_options("shared-memory", timeout_s=10), hosts=("a", "a", "b", "b")) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(LARGE // 4, np.float32)))  # every stream open
        cluster.communicators[gone].close(timeout=2.0)

        def survive(c):
            if c.rank != gone:
                return c.allreduce(np.ones(LARGE // 4, np.float32))

        outcomes = cluster.run_outcomes(survive)
    others = [o for r, o in enumerate(outcomes) if r != gone]
    assert all(isinstance(o, CommunicationError) for o in others), outcomes
