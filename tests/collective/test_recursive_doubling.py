"""Recursive doubling against numpy, N = 2..7 (powers of two and the fold), with every rank's bits
identical and each rank's bytes as the algorithm says."""

import math

import numpy as np
import pytest

from elasticdl_strategy.collective import cost_model
from tests.cluster import ThreadCluster, transport_options
from tests.collective.reference import assert_close, assert_identical, make_input, reduce_reference


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(cost_model, "choose", lambda nbytes, size, path=None: "recursive_doubling")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_rank_gets_the_same_bits_of_the_reduction(forced, n):
    with ThreadCluster(n, transport_options("shared-memory")) as cluster:
        for op, dtype in (("sum", "float32"), ("max", "int64"), ("prod", "float64")):
            inputs = [make_input(n, r, (1001,), dtype, op) for r in range(n)]
            results = cluster.run(lambda c: c.allreduce(inputs[c.rank], op=op))
            assert_identical(results)
            assert_close(results[0], reduce_reference(inputs, op))


@pytest.mark.parametrize("n", [3, 4, 6])
def test_each_rank_sends_log2_n_arrays_and_the_fold_one_more(forced, n):
    core = 1 << (n.bit_length() - 1)
    nbytes = 4 * 4096
    with ThreadCluster(n, transport_options("data-socket")) as cluster:
        cluster.run(lambda c: c.barrier())  # the ranks agree on a host segment (none here) first
        before = [(c.p2p.bytes_sent, c.p2p.bytes_received) for c in cluster.communicators]
        cluster.run(lambda c: c.allreduce(np.ones(4096, np.float32)))
        moved = [(c.p2p.bytes_sent - s, c.p2p.bytes_received - r) for c, (s, r) in zip(cluster.communicators, before)]
    for rank, (sent, received) in enumerate(moved):
        if rank >= core:
            expected = (nbytes, nbytes)  # its array out, the result back
        else:
            fold = nbytes if rank + core < n else 0
            expected = (int(math.log2(core)) * nbytes + fold, int(math.log2(core)) * nbytes + fold)
        assert (sent, received) == expected, (rank, moved)
