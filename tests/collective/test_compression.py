"""All-reduce with a 16-bit wire (``compression="fp16"`` / ``"bf16"``), N = 1..4 ranks in one process.

Error bound used throughout (per element, derived from the algorithm): the
ring adds a segment up along a chain of N ranks; each of the N-1 sends rounds
a partial sum to 16 bits (relative error <= u: 2^-11 fp16, 2^-8 bf16, plus
2^-24 for float64 -> bf16, which rounds through float32), each of the N-1
additions rounds in the array's dtype (<= e: 2^-24 float32, 2^-53 float64),
and the owner rounds the total once more. Every partial sum is bounded by
A = sum_r |x_r| (to first order), so

    |result - exact| <= (N u + (N-1) e) A (1 + 2 N u) + N t

where t is half the smallest fp16 subnormal (2^-25; 2^-134 for bf16), the
absolute error of rounding a value below fp16's normal range. The broken
implementations at the end (truncating instead of rounding, dropping the
incoming values, the owner keeping its unrounded segment) fail these checks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from elasticdl_strategy import runtime
from elasticdl_strategy.collective import compression, ring
from elasticdl_strategy.collective.dtypes import REDUCE_UFUNCS, dtype_name
from elasticdl_strategy.errors import CollectiveMismatchError, UsageError
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import peer_pb2
from tests.cluster import ThreadCluster
from tests.collective.reference import assert_identical

SIZES = (1, 2, 3, 4)
ELEMENTS = (0, 1, 7, 1001, 1 << 20)  # 1001: not divisible by 2, 3 or 4
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
ADD_ROUNDOFF = {np.float32: 2.0**-24, np.float64: 2.0**-53}
TINY = {"fp16": 2.0**-25, "bf16": 2.0**-134}


@pytest.fixture(scope="module")
def clusters():
    # Without single copy: the plain all-reduces that the byte counts compare with take the ring.
    options = TransportOptions(timeout_s=20.0, connect_timeout_s=5.0, single_copy=False)
    made = {n: ThreadCluster(n, options) for n in SIZES}
    yield made
    for cluster in made.values():
        cluster.close()


def make_inputs(n, elements, dtype, seed=0):
    """Normal values over a few orders of magnitude (some below fp16's normal range, none near its max)."""
    out = []
    for rank in range(n):
        rng = np.random.default_rng([seed, n, elements, rank])
        scale = np.exp(rng.uniform(-9, 4, elements))
        out.append((rng.standard_normal(elements) * scale).astype(dtype))
    return out


def error_bound(inputs, op, codec):
    n, dtype = len(inputs), inputs[0].dtype.type
    u = UNIT_ROUNDOFF[codec] + (2.0**-24 if codec == "bf16" and dtype is np.float64 else 0.0)
    e = ADD_ROUNDOFF[dtype]
    total_abs = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    bound = (n * u + (n - 1) * e) * total_abs * (1 + 2 * n * u) + n * TINY[codec]
    if op == "mean":
        bound = bound / n + 2 * e * total_abs / n
    return bound


def allreduce_all(cluster, inputs, op="sum", compression_=None):
    return cluster.run(lambda c: c.allreduce(inputs[c.rank], op=op, compression=compression_))


def check_compressed_allreduce(cluster, inputs, op, codec):
    """Every property of one compressed all-reduce; raises AssertionError on any violation."""
    n = cluster.size
    results = allreduce_all(cluster, inputs, op, codec)
    assert_identical(results)
    result = results[0]
    assert result.dtype == inputs[0].dtype and result.shape == inputs[0].shape
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    if op == "mean":
        exact = exact / n
    if n == 1:  # no wire: exact
        assert result.tobytes() == inputs[0].tobytes()
        return result
    error = np.abs(result.astype(np.float64) - exact)
    bound = error_bound(inputs, op, codec)
    worst = int(np.argmax(error - bound)) if result.size else 0
    assert np.all(error <= bound), (
        f"element {worst}: error {error[worst]:.3g} > bound {bound[worst]:.3g} "
        f"(result {result[worst]!r}, exact {exact[worst]!r})"
    )
    if result.size >= 7:  # the values did travel in 16 bits
        plain = allreduce_all(cluster, inputs, op)[0]
        assert result.tobytes() != plain.tobytes()
        assert np.all(np.isfinite(result))
    return result


# ---- results -------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
def test_identical_on_every_rank_and_within_the_bound(clusters, n, dtype, codec, op):
    for elements in ELEMENTS:
        inputs = make_inputs(n, elements, dtype)
        check_compressed_allreduce(clusters[n], inputs, op, codec)


def emulate_ring(inputs, op, codec):
    """The compressed ring, element by element: segment j is added up along ranks j, j+1, ..., j+N-1
    (each sending its partial sum rounded to 16 bits), then its owner rounds the total."""
    n, dtype, wire = len(inputs), inputs[0].dtype, compression.WIRE_DTYPES[codec]
    ufunc = REDUCE_UFUNCS[op]
    out = np.empty_like(inputs[0])
    with np.errstate(over="ignore"):
        for j, (a, b) in enumerate(ring.even_bounds(out.size, n)):
            partial = inputs[j][a:b].copy()
            for k in range(1, n):
                partial = ufunc(inputs[(j + k) % n][a:b], partial.astype(wire).astype(dtype))
            out[a:b] = partial.astype(wire).astype(dtype)
    if op == "mean":
        out /= n
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_an_emulation_of_the_ring_bit_for_bit(clusters, n, codec, dtype):
    """Round once per send, reduce in the array's dtype, round the total once: nothing more, nothing less."""
    for op in ("sum", "mean", "min", "max"):
        for elements in (7, 1001):
            inputs = make_inputs(n, elements, dtype, seed=1)
            results = allreduce_all(clusters[n], inputs, op, codec)
            assert_identical(results)
            assert results[0].tobytes() == emulate_ring(inputs, op, codec).tobytes(), (op, elements)


def test_none_is_the_uncompressed_path(clusters):
    inputs = make_inputs(3, 1001, np.float32)
    plain = allreduce_all(clusters[3], inputs)
    for value in (None, "none"):
        assert allreduce_all(clusters[3], inputs, "sum", value)[0].tobytes() == plain[0].tobytes()


@pytest.mark.parametrize("shape", [(), (3, 4, 5), (0, 3)])
def test_any_shape(clusters, shape):
    inputs = [x.reshape(shape) for x in make_inputs(3, int(np.prod(shape)), np.float32)]
    result = check_compressed_allreduce(clusters[3], inputs, "mean", "fp16")
    assert result.shape == shape


def test_special_values():
    with ThreadCluster(2) as cluster:
        nan_inf = [np.array([np.nan, 1.0, np.inf, 2.0], np.float32), np.array([1.0, np.nan, 1.0, 3.0], np.float32)]
        for codec in ("fp16", "bf16"):
            result = allreduce_all(cluster, nan_inf, "sum", codec)[0]
            assert np.isnan(result[0]) and np.isnan(result[1]) and result[2] == np.inf and result[3] == 5.0
        big = [np.full(3, 40000.0, np.float32), np.full(3, 40000.0, np.float32)]
        assert np.all(allreduce_all(cluster, big, "sum", "fp16")[0] == np.inf)  # beyond fp16's 65504
        huge = [np.full(3, 1e37, np.float32), np.full(3, 2e37, np.float32)]
        result = allreduce_all(cluster, huge, "sum", "bf16")[0]
        np.testing.assert_allclose(result, 3e37, rtol=2**-7)
        # min/max pick one rounded input
        inputs = make_inputs(2, 100, np.float32)
        for op, fn in (("min", np.minimum), ("max", np.maximum)):
            result = allreduce_all(cluster, inputs, op, "bf16")[0]
            expected = fn(*inputs).astype(ml_dtypes.bfloat16).astype(np.float32)
            assert result.tobytes() == expected.tobytes()


def test_in_place_and_staging_buffers_are_reused(clusters):
    cluster = clusters[2]
    inputs = make_inputs(2, 5000, np.float32)
    expected = allreduce_all(cluster, inputs, "sum", "bf16")[0]
    buffers = [c._staging._send for c in cluster.communicators]
    work = [x.copy() for x in inputs]
    results = cluster.run(lambda c: c.allreduce(work[c.rank], out=work[c.rank], compression="bf16"))
    assert all(r is work[i] and r.tobytes() == expected.tobytes() for i, r in enumerate(results))
    small = make_inputs(2, 100, np.float32)
    allreduce_all(cluster, small, "sum", "fp16")
    assert [c._staging._send for c in cluster.communicators] == buffers  # same objects, not reallocated
    bigger = make_inputs(2, 1 << 20, np.float32)
    check_compressed_allreduce(cluster, bigger, "sum", "fp16")
    assert all(c._staging._send.size >= 1 << 20 for c in cluster.communicators)


# ---- bytes on the wire -----------------------------------------------------------------------


def traffic(cluster, inputs, codec):
    before = [(c.p2p.bytes_sent, c.p2p.bytes_received) for c in cluster.communicators]
    allreduce_all(cluster, inputs, "sum", codec)
    return [
        (c.p2p.bytes_sent - s, c.p2p.bytes_received - r)
        for c, (s, r) in zip(cluster.communicators, before, strict=True)
    ]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_rank_sends_and_receives_2_n_minus_1_over_n_of_the_16_bit_bytes(clusters, n):
    cluster = clusters[n]
    for dtype in (np.float32, np.float64):
        # Above 4 MiB (a host segment's largest default slots): the plain all-reduce takes the ring too.
        for elements in (n * 1_100_000, 1_100_001):
            inputs = make_inputs(n, elements, dtype)
            plain = traffic(cluster, inputs, None)
            for codec in ("fp16", "bf16"):
                counted = traffic(cluster, inputs, codec)
                # 16-bit values instead of 32/64-bit ones: exactly half (float32) or a quarter (float64)
                assert counted == [(s * 2 // dtype().itemsize, r * 2 // dtype().itemsize) for s, r in plain]
                wire_bytes = 2 * elements
                if elements % n == 0:
                    assert all(s == r == 2 * (n - 1) * wire_bytes // n for s, r in counted)
                assert sum(s for s, _ in counted) == sum(r for _, r in counted) == 2 * (n - 1) * wire_bytes


# ---- agreement and argument checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "n, mine, odd",
    [(2, "bf16", None), (2, None, "fp16"), (3, "fp16", "bf16"), (4, "bf16", "none")],
)
def test_ranks_with_different_compression_all_raise_mismatch(n, mine, odd):
    def program(c):
        value = odd if c.rank == n - 1 else mine
        return c.allreduce(np.ones(1001, np.float32), compression=value)

    with ThreadCluster(n) as cluster:
        outcomes = cluster.run_outcomes(program, timeout=30)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, CollectiveMismatchError), (rank, outcome)
        assert "compression" in str(outcome), outcome


@pytest.mark.parametrize(
    "array, op, value, named",
    [
        (np.ones(4, np.int32), "sum", "fp16", "int32"),
        (np.ones(4, np.int64), "sum", "bf16", "int64"),
        (np.ones(4, np.float16), "sum", "bf16", "float16"),
        (np.ones(4, ml_dtypes.bfloat16), "sum", "fp16", "bfloat16"),
        (np.ones(4, np.float32), "sum", "fp8", "'fp8'"),
        (np.ones(4, np.float32), "sum", "FP16", "'FP16'"),
        (np.ones(4, np.float32), "sum", True, "True"),
        (np.ones(4, np.float32), "prod", "fp16", "'prod'"),
        (np.ones(4, np.float64), "prod", "bf16", "'prod'"),
    ],
)
def test_bad_arguments_raise_usage_error_before_communicating(clusters, array, op, value, named):
    cluster = clusters[2]
    with pytest.raises(UsageError) as raised:
        cluster.communicators[0].allreduce(array, op=op, compression=value)  # rank 0 alone: no peer takes part
    message = str(raised.value)
    assert named in message and "\n" not in message
    # nothing was sent and no sequence number was used: the next collective works on every rank
    inputs = make_inputs(2, 10, np.float32)
    assert_identical(allreduce_all(cluster, inputs, "sum", "bf16"))


def test_single_rank_checks_arguments_too(clusters):
    with pytest.raises(UsageError):
        clusters[1].communicators[0].allreduce(np.ones(3, np.int32), compression="bf16")


def test_descriptor_carries_compression():
    from elasticdl_strategy.collective.communicator import _describe, _differences

    mine = peer_pb2.CollectiveDescriptor(op="allreduce", dtype="float32", shape=[4], reduce_op="sum", root=-1)
    theirs = peer_pb2.CollectiveDescriptor()
    theirs.CopyFrom(mine)
    theirs.compression = "bf16"
    assert _differences(mine, theirs) == ["compression"]
    assert "compression=bf16" in _describe(theirs) and "compression" not in _describe(mine)


def test_module_level_allreduce_passes_compression(monkeypatch):
    calls = []

    class Fake:
        def allreduce(self, array, **kwargs):
            calls.append(kwargs)
            return array

    monkeypatch.setattr(runtime, "communicator", lambda: Fake())
    runtime.allreduce(np.ones(2, np.float32), op="mean", compression="fp16")
    runtime.allreduce(np.ones(2, np.float32))
    assert calls[0]["compression"] == "fp16" and calls[0]["op"] == "mean"
    assert calls[1]["compression"] is None


# ---- the sink on its own ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_widening_sink_accepts_chunks_split_anywhere(codec, dtype):
    wire = compression.WIRE_DTYPES[codec]
    rng = np.random.default_rng(3)
    incoming = rng.standard_normal(501).astype(wire)
    acc0 = rng.standard_normal(501).astype(dtype)
    expected = acc0 + incoming.astype(dtype)
    payload = incoming.tobytes()
    header = peer_pb2.MessageHeader(nbytes=len(payload), dtype=dtype_name(wire))
    for trial in range(20):
        cuts = sorted(rng.choice(np.arange(1, len(payload)), size=trial % 7, replace=False).tolist())
        if trial % 2:
            cuts = sorted({c & ~1 for c in cuts} - {0})  # even offsets only
        acc = acc0.copy()
        sink = compression.WideningReduceSink(0, acc, np.add, wire)
        sink.begin(1, header)
        pieces = list(zip([0] + cuts, cuts + [len(payload)], strict=True))
        for a, b in reversed(pieces) if trial % 3 == 0 else pieces:  # order of chunks does not matter either
            sink.write(a, memoryview(payload)[a:b])
        assert acc.tobytes() == expected.tobytes(), cuts


def test_widening_sink_rejects_a_segment_of_the_wrong_size_or_format():
    acc = np.zeros(10, np.float32)
    sink = compression.WideningReduceSink(0, acc, np.add, np.float16)
    with pytest.raises(CollectiveMismatchError):
        sink.begin(1, peer_pb2.MessageHeader(nbytes=40, dtype="float32"))
    with pytest.raises(CollectiveMismatchError):
        sink.begin(1, peer_pb2.MessageHeader(nbytes=20, dtype="bfloat16"))
    sink.begin(1, peer_pb2.MessageHeader(nbytes=20, dtype="float16"))


# ---- the checks above catch broken implementations ------------------------------------------------


def _truncating_encode(values, wire):
    """bf16 by cutting off the low 16 bits (round toward zero) instead of rounding to nearest."""
    bits = values.astype(np.float32).view(np.uint32) >> 16
    wire.view(np.uint16)[...] = bits.astype(np.uint16)


def _owner_keeps_unrounded(call, flat, ufunc, send16, recv16):
    bounds = ring.even_bounds(flat.size, call.p2p.size)
    ring.reduce_scatter_compressed(call, flat, bounds, ufunc, send16, owned=1)
    own_a, own_b = bounds[(call.p2p.rank + 1) % call.p2p.size]
    compression.encode(flat[own_a:own_b], send16[own_a:own_b])  # sent rounded, but kept unrounded
    ring.allgather_compressed(call, flat, bounds, send16, recv16, owned=1)


def _replace_instead_of_reduce(self, offset, data):
    incoming = np.frombuffer(data, self._wire_dtype)
    self._acc[offset // 2 : offset // 2 + len(incoming)] = incoming


@pytest.mark.parametrize(
    "target, name, broken, expect",
    [
        (compression, "encode", _truncating_encode, "bound"),
        (ring, "allreduce_compressed", _owner_keeps_unrounded, "differs from rank 0"),
        (compression.WideningReduceSink, "write", _replace_instead_of_reduce, "bound"),
    ],
)
def test_broken_implementations_fail_these_checks(monkeypatch, target, name, broken, expect):
    with ThreadCluster(2) as cluster:
        inputs = make_inputs(2, 100_000, np.float32, seed=5)
        monkeypatch.setattr(target, name, broken)
        with pytest.raises(AssertionError) as failed:
            check_compressed_allreduce(cluster, inputs, "sum", "bf16")
        assert (expect == "bound" and "> bound" in str(failed.value)) or expect in str(failed.value)
        monkeypatch.undo()
        check_compressed_allreduce(cluster, inputs, "sum", "bf16")
