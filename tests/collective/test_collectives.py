"""Every collective against numpy, N = 1..4 ranks, random shapes, dtypes and ops.

Ranks run as threads of this process, each with its own gRPC server and
streams (the same code path as separate processes), once for each payload path
(shared memory, direct data sockets, gRPC only); the multi-process runs are in
test_multiprocess.py.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticdl_strategy.collective.dtypes import SUPPORTED_DTYPES
from elasticdl_strategy.errors import UsageError
from tests.cluster import ThreadCluster, transport_options
from tests.collective.reference import assert_close, assert_identical, make_input, reduce_reference

SIZES = (1, 2, 3, 4)
OPS_FOR = {
    "bool": ["min", "max"],
    "int32": ["sum", "prod", "min", "max"],
    "int64": ["sum", "prod", "min", "max"],
    "uint8": ["sum", "prod", "min", "max"],
}
FLOAT_OPS = ["sum", "mean", "prod", "min", "max"]

PROPERTY_SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["host-segment", "shared-memory", "data-socket", "grpc"])
def clusters(request):
    """Clusters of every size, with payloads through shared memory and small all-reduces through
    a host segment (the default on one host), shared memory alone, direct data sockets (between
    hosts) or gRPC only."""
    options = transport_options(request.param)
    made = {n: ThreadCluster(n, options) for n in SIZES}
    yield made
    for cluster in made.values():
        cluster.close()


dtypes = st.sampled_from(sorted(SUPPORTED_DTYPES))
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
sizes = st.sampled_from(SIZES)
seeds = st.integers(0, 2**31 - 1)


@st.composite
def dtype_and_op(draw):
    dtype = draw(dtypes)
    return dtype, draw(st.sampled_from(OPS_FOR.get(dtype, FLOAT_OPS)))


@PROPERTY_SETTINGS
@given(n=sizes, shape=shapes, dop=dtype_and_op(), seed=seeds)
def test_allreduce_matches_numpy(clusters, n, shape, dop, seed):
    dtype, op = dop
    inputs = [make_input(seed, r, shape, dtype, op) for r in range(n)]
    results = clusters[n].run(lambda c: c.allreduce(inputs[c.rank], op=op))
    assert_identical(results)
    assert_close(results[0], reduce_reference(inputs, op))
    for r in range(n):  # inputs untouched
        assert inputs[r].tobytes() == make_input(seed, r, shape, dtype, op).tobytes()


@PROPERTY_SETTINGS
@given(n=sizes, shape=shapes, dop=dtype_and_op(), seed=seeds, data=st.data())
def test_reduce_matches_numpy(clusters, n, shape, dop, seed, data):
    dtype, op = dop
    root = data.draw(st.integers(0, n - 1))
    inputs = [make_input(seed, r, shape, dtype, op) for r in range(n)]
    results = clusters[n].run(lambda c: c.reduce(inputs[c.rank], root=root, op=op))
    assert all(results[r] is None for r in range(n) if r != root)
    assert_close(results[root], reduce_reference(inputs, op))


@PROPERTY_SETTINGS
@given(n=sizes, shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple), dop=dtype_and_op(), seed=seeds)
def test_reduce_scatter_matches_numpy(clusters, n, shape, dop, seed):
    dtype, op = dop
    inputs = [make_input(seed, r, shape, dtype, op) for r in range(n)]
    results = clusters[n].run(lambda c: c.reduce_scatter(inputs[c.rank], op=op))
    expected = np.array_split(reduce_reference(inputs, op), n, axis=0)
    for r in range(n):
        assert_close(results[r], expected[r])


def test_a_reduce_of_fewer_elements_than_ranks_goes_on_over_fresh_data_sockets():
    # Each message on the stream from rank 0 to rank 1 is an empty segment of the reduce-scatter: the
    # first payloads read on that socket are empty (no message before them has set its reading up).
    with ThreadCluster(2, transport_options("data-socket")) as cluster:
        results = cluster.run_outcomes(lambda comm: [comm.reduce(np.float64(1.0), root=0) for _ in range(50)])
    assert not any(isinstance(r, BaseException) for r in results), results
    assert [float(x) for x in results[0]] == [2.0] * 50 and results[1] == [None] * 50


@PROPERTY_SETTINGS
@given(n=sizes, shape=shapes, dtype=dtypes, seed=seeds, data=st.data())
def test_broadcast_matches_root(clusters, n, shape, dtype, seed, data):
    root = data.draw(st.integers(0, n - 1))
    inputs = [make_input(seed, r, shape, dtype) for r in range(n)]
    results = clusters[n].run(lambda c: c.broadcast(inputs[c.rank], root=root))
    assert_identical(results)
    assert results[0].tobytes() == inputs[root].tobytes()


@PROPERTY_SETTINGS
@given(n=sizes, rows=st.lists(st.integers(0, 5), min_size=4, max_size=4), rest=shapes, dtype=dtypes, seed=seeds)
def test_allgather_concatenates_varying_rows(clusters, n, rows, rest, dtype, seed):
    inputs = [make_input(seed, r, (rows[r],) + rest, dtype) for r in range(n)]
    results = clusters[n].run(lambda c: c.allgather(inputs[c.rank]))
    assert_identical(results)
    np.testing.assert_array_equal(results[0], np.concatenate(inputs, axis=0))


@PROPERTY_SETTINGS
@given(
    n=sizes,
    rows=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    rest=shapes,
    dtype=dtypes,
    seed=seeds,
    data=st.data(),
)
def test_gather_concatenates_on_root(clusters, n, rows, rest, dtype, seed, data):
    root = data.draw(st.integers(0, n - 1))
    inputs = [make_input(seed, r, (rows[r],) + rest, dtype) for r in range(n)]
    results = clusters[n].run(lambda c: c.gather(inputs[c.rank], root=root))
    assert all(results[r] is None for r in range(n) if r != root)
    np.testing.assert_array_equal(results[root], np.concatenate(inputs, axis=0))


@PROPERTY_SETTINGS
@given(n=sizes, shape=shapes, dtype=dtypes, seed=seeds, data=st.data())
def test_scatter_delivers_each_rank_its_array(clusters, n, shape, dtype, seed, data):
    root = data.draw(st.integers(0, n - 1))
    parts = [make_input(seed, i, shape, dtype) for i in range(n)]
    results = clusters[n].run(lambda c: c.scatter(parts if c.rank == root else None, root=root))
    for r in range(n):
        assert results[r].dtype == parts[r].dtype and results[r].shape == parts[r].shape
        assert results[r].tobytes() == parts[r].tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_barrier_and_sequences_of_collectives(clusters, n):
    def program(c):
        out = []
        for i in range(5):
            c.barrier()
            out.append(c.allreduce(np.full(7, c.rank + i, np.int64)))
        return out

    results = clusters[n].run(program)
    for i in range(5):
        expected = np.full(7, sum(range(n)) + n * i, np.int64)
        for r in range(n):
            np.testing.assert_array_equal(results[r][i], expected)


@pytest.mark.parametrize("n", [3, 4])
def test_a_ring_of_segments_larger_than_socket_buffers_completes_exactly(clusters, n):
    # Every rank writes its segment to its right neighbour while the left one writes to it: a
    # sender blocked on a full socket must have its own incoming segments read meanwhile.
    inputs = [make_input(r, r, (3 << 20,), "float32", "sum") for r in range(n)]  # 12 MiB each
    results = clusters[n].run(lambda c: c.allreduce(inputs[c.rank]))
    assert_identical(results)
    assert_close(results[0], reduce_reference(inputs, "sum"))


@pytest.mark.parametrize("n", [2, 3])
def test_large_broadcast_uses_scatter_allgather_path(clusters, n):
    data = np.arange(300_001, dtype=np.float64)  # > 256 KiB
    results = clusters[n].run(lambda c: c.broadcast(data if c.rank == 1 else np.zeros_like(data), root=1))
    for result in results:
        np.testing.assert_array_equal(result, data)


@pytest.mark.parametrize("nbytes", [64, 1 << 20])  # the direct path and the scatter-allgather one
def test_broadcast_into_out_and_in_place_without_reading_the_receivers_values(clusters, nbytes, monkeypatch):
    root = np.arange(nbytes // 8, dtype=np.float64)
    buffers = [root.copy() if r == 0 else np.full_like(root, np.nan) for r in range(3)]
    copies = []
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: copies.append(dst.nbytes) or real_copyto(dst, src, **kw))
    results = clusters[3].run(lambda c: c.broadcast(buffers[c.rank], root=0, out=buffers[c.rank]))
    for r in range(3):
        assert results[r] is buffers[r]
        np.testing.assert_array_equal(buffers[r], root)
    assert copies == []  # in place: nothing copied into the buffers first
    with pytest.raises(UsageError, match="C-contiguous array of shape"):
        clusters[3].run(lambda c: c.broadcast(root, root=0, out=np.empty(3)))


def test_allreduce_out_and_in_place(clusters):
    arrays = [np.full((3, 4), r + 1, np.float32) for r in range(3)]
    results = clusters[3].run(lambda c: c.allreduce(arrays[c.rank], out=arrays[c.rank]))
    for r in range(3):
        assert results[r] is arrays[r]
        np.testing.assert_array_equal(arrays[r], np.full((3, 4), 6, np.float32))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.allreduce(np.ones(3, np.int32), op="mean"), "floating dtype"),
        (lambda c: c.allreduce(np.ones(3, bool), op="sum"), "not defined for bool"),
        (lambda c: c.allreduce(np.ones(3), op="avg"), "unknown reduce op"),
        (lambda c: c.allreduce(np.ones(3, np.complex64)), "unsupported dtype"),
        (lambda c: c.allreduce(np.ones(3), out=np.ones(4)), "out must be"),
        (lambda c: c.broadcast(np.ones(3), root=5), "root=5"),
        (lambda c: c.allgather(np.float32(1)), "at least one dimension"),
        (lambda c: c.scatter([np.ones(1)], root=0), "needs a list of 2 arrays"),
    ],
)
def test_bad_arguments_raise_before_communicating(clusters, call, message):
    comm = clusters[2].communicators[0]
    sent = comm.p2p.messages_sent
    with pytest.raises(UsageError, match=message):
        call(comm)
    assert comm.p2p.messages_sent == sent
