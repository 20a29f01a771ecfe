"""Gradient buckets: the planner, the bucket reduction, the graph's order, and training at N = 2.

The planner and the bucket reduction are tested in-process (the reduction against a fake
communicator of 2 ranks); the order in which a ``tf.function`` runs the buckets is checked in
its traced graph; one launcher job of 2 workers trains with several buckets per step.
"""

import concurrent.futures
import os
import re
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.strategy import bridge
from elasticdl_strategy.strategy.bridge import Bucket, bucket_layout, plan_buckets
from tests.launch import read_reports, run_alone, run_job, worker_script

F32, F64, I32 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)


# ---- planner ------------------------------------------------------------------------------


def _check_plan(sizes, dtypes, bucket_bytes, buckets):
    members = [i for b in buckets for i in b.members]
    assert sorted(members) == list(range(len(sizes)))  # every tensor exactly once
    for bucket in buckets:
        assert all(np.dtype(dtypes[i]) == bucket.dtype for i in bucket.members)  # one dtype per bucket
        known = [sizes[i] for i in bucket.members]
        if len(bucket.members) > 1:
            _, length = bucket_layout(known, bucket.dtype)
            assert length * bucket.dtype.itemsize <= bucket_bytes  # threshold, alignment included


def test_plan_packs_in_reverse_order_up_to_the_threshold():
    sizes = [100, 100, 100, 100]  # 400 bytes each as float32 (448 with 64-byte alignment)
    buckets = plan_buckets(sizes, [F32] * 4, bucket_bytes=1000)
    assert buckets == [Bucket(F32, (3, 2)), Bucket(F32, (1, 0))]
    _check_plan(sizes, [F32] * 4, 1000, buckets)
    assert plan_buckets(sizes, [F32] * 4, bucket_bytes=1000, reverse=False) == [
        Bucket(F32, (0, 1)),
        Bucket(F32, (2, 3)),
    ]
    assert plan_buckets(sizes, [F32] * 4, bucket_bytes=1 << 20) == [Bucket(F32, (3, 2, 1, 0))]


def test_plan_is_deterministic_and_every_element_is_placed_once():
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 5000, 60)]
    dtypes = [[F32, F64, I32][int(k)] for k in rng.integers(0, 3, 60)]
    for bucket_bytes in (64, 1000, 4096, 20000, 1 << 30):
        plans = [plan_buckets(list(sizes), list(dtypes), bucket_bytes) for _ in range(3)]
        assert plans[0] == plans[1] == plans[2]
        _check_plan(sizes, dtypes, bucket_bytes, plans[0])
        for bucket in plans[0]:  # inside a bucket: reverse order
            assert list(bucket.members) == sorted(bucket.members, reverse=True)
        # Element level: the layouts of the buckets cover every element of every tensor once.
        for bucket in plans[0]:
            offsets, length = bucket_layout([sizes[i] for i in bucket.members], bucket.dtype)
            covered = np.zeros(length, np.int64)
            for i, offset in zip(bucket.members, offsets, strict=True):
                assert offset * bucket.dtype.itemsize % 64 == 0  # aligned for zero-copy outputs
                covered[offset : offset + sizes[i]] += 1
            assert covered.max(initial=0) <= 1 and covered.sum() == sum(sizes[i] for i in bucket.members)


def test_an_oversized_tensor_gets_its_own_bucket_and_buckets_go_in_completion_order():
    sizes = [10, 5000, 10, 10]  # as float32: 5000 elements = 20000 bytes > 1024
    buckets = plan_buckets(sizes, [F32] * 4, bucket_bytes=1024)
    # 3 and 2 open a bucket, 1 is alone (complete at position 2), 0 joins the open bucket (complete at 3).
    assert buckets == [Bucket(F32, (1,)), Bucket(F32, (3, 2, 0))]
    assert plan_buckets([None, 10], [F32, F32], bucket_bytes=1024) == [Bucket(F32, (1,)), Bucket(F32, (0,))]


def test_dtypes_are_never_mixed():
    sizes = [10, 10, 10, 10, 10]
    dtypes = [F32, I32, F32, F64, I32]
    buckets = plan_buckets(sizes, dtypes, bucket_bytes=1 << 20)
    # In completion order: float64 (complete at reverse position 1), int32 (3), float32 (4).
    assert buckets == [Bucket(F64, (3,)), Bucket(I32, (4, 1)), Bucket(F32, (2, 0))]
    _check_plan(sizes, dtypes, 1 << 20, buckets)


# ---- the reduction, against a fake communicator -------------------------------------------


class FakeCommunicator:
    """Two ranks holding the same arrays: a sum doubles them. Records each call."""

    size = 2

    def __init__(self, reads_pieces=False):
        self.calls = []
        self._reads_pieces = reads_pieces

    def allreduce(self, array, op="sum", out=None, timeout=None, **kwargs):
        self.calls.append((threading.get_ident(), array.dtype, array.shape, op, kwargs.get("compression")))
        np.multiply(array, 2, out=out)
        if op == "mean":
            np.divide(out, 2, out=out, casting="unsafe")
        return out

    def reads_pieces(self, nbytes, count):
        return self._reads_pieces

    def allreduce_pieces(self, pieces, offsets, out, op="sum", timeout=None):
        """As one host's workers that read each other's memory: the pieces, never packed into ``out``."""
        self.calls.append((threading.get_ident(), out.dtype, out.shape, op, "pieces"))
        out.fill(np.nan if out.dtype.kind == "f" else 99)  # what a packing before this would have overwritten
        for piece, offset in zip(pieces, offsets, strict=True):
            np.multiply(piece.reshape(-1), 2, out=out[offset : offset + piece.size])
        if op == "mean":
            np.divide(out, 2, out=out, casting="unsafe")
        return out


@pytest.fixture
def fake(monkeypatch):
    communicator = FakeCommunicator()
    monkeypatch.setattr(bridge.runtime, "communicator", lambda: communicator)
    return communicator


def test_buckets_reduce_every_tensor_in_plan_order_on_the_calling_thread(fake):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(30, 20), (20,), (0,), (), (50, 3), (7,)]]
    arrays.insert(2, np.arange(12, dtype=np.int32).reshape(3, 4))
    results = bridge.allreduce_arrays(arrays, "sum", bucket_bytes=1024, compression="fp16")
    for array, result in zip(arrays, results, strict=True):
        assert result.shape == array.shape and result.dtype == array.dtype
        np.testing.assert_array_equal(result, 2 * array)
    plan = plan_buckets([a.size for a in arrays], [a.dtype for a in arrays], 1024)
    assert len(plan) >= 3
    lengths = [bucket_layout([arrays[i].size for i in b.members], b.dtype)[1] for b in plan]
    assert [(c[1], c[2]) for c in fake.calls] == [(b.dtype, (n,)) for b, n in zip(plan, lengths, strict=True)]
    assert {c[0] for c in fake.calls} == {threading.get_ident()}  # one thread talks to the communicator
    # Compression for floating-point buckets only.
    assert [c[4] for c in fake.calls] == ["fp16" if b.dtype.kind == "f" else None for b in plan]
    # Integer mean: the sum floor-divided by the number of workers.
    (mean,) = bridge.allreduce_arrays([np.array([3, 5], np.int32)], "mean")
    np.testing.assert_array_equal(mean, [3, 5])


def test_staging_buffers_are_reused_only_when_no_result_is_alive(fake):
    arrays = [np.full(1000, 1.0, np.float32), np.full(10, 2.0, np.float32)]
    bridge.allreduce_arrays(arrays, "sum")  # a buffer for this layout exists from here on
    allocations = bridge.counters()["staging_allocations"]
    for _ in range(3):
        bridge.allreduce_arrays(arrays, "sum")
    assert bridge.counters()["staging_allocations"] == allocations  # dropped results: reused
    kept = bridge.allreduce_arrays(arrays, "sum")
    again = bridge.allreduce_arrays([a * 3 for a in arrays], "sum")
    assert not np.shares_memory(kept[0], again[0])  # a result still alive is never overwritten
    np.testing.assert_array_equal(kept[0], 2 * arrays[0])
    np.testing.assert_array_equal(again[1], 6 * arrays[1])
    assert all(r.ctypes.data % 64 == 0 for r in kept + again)  # zero-copy for TensorFlow
    # Two buckets of the same layout in one call: two buffers.
    twins = [np.full(300, 1.0, np.float32), np.full(300, 5.0, np.float32)]
    first, second = bridge.allreduce_arrays(twins, "sum", bucket_bytes=1024)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, 2.0)
    np.testing.assert_array_equal(second, 10.0)


def test_a_result_tensorflow_holds_keeps_its_buffer_leased_and_a_failed_call_gives_its_back(fake, monkeypatch):
    arrays = [np.full(256, 1.0, np.float32)]
    held = tf.convert_to_tensor(bridge.allreduce_arrays(arrays, "sum")[0])  # may alias the staging buffer
    for _ in range(3):
        bridge.allreduce_arrays([np.full(256, 7.0, np.float32)], "sum")
    np.testing.assert_array_equal(held.numpy(), 2.0)  # never overwritten while TensorFlow holds it
    # A reduction that fails (a peer died) ends its lease: the next call reuses the buffer.
    bridge.allreduce_arrays(arrays, "sum")
    allocations = bridge.counters()["staging_allocations"]

    def fail(*args, **kwargs):
        raise RuntimeError("peer failed")

    monkeypatch.setattr(fake, "allreduce", fail)
    with pytest.raises(RuntimeError):
        bridge.allreduce_arrays(arrays, "sum")
    monkeypatch.undo()
    monkeypatch.setattr(bridge.runtime, "communicator", lambda: fake)
    for _ in range(3):
        bridge.allreduce_arrays(arrays, "sum")
    assert bridge.counters()["staging_allocations"] == allocations


def test_the_counters_time_packing_and_the_ring_apart(fake, monkeypatch):
    ring_seconds = 0.05
    allreduce = fake.allreduce

    def slow_allreduce(*args, **kwargs):
        threading.Event().wait(ring_seconds)  # a ring that takes this long
        return allreduce(*args, **kwargs)

    monkeypatch.setattr(fake, "allreduce", slow_allreduce)
    before = bridge.counters()
    bridge.allreduce_arrays([np.ones(1 << 16, np.float32), np.ones(10, np.float32)], "sum", bucket_bytes=1024)
    after = bridge.counters()
    assert after["buckets"] - before["buckets"] == 2
    assert after["ring_s"] - before["ring_s"] >= 2 * ring_seconds
    assert 0 < after["pack_s"] - before["pack_s"] < ring_seconds


def test_where_the_communicator_reads_pieces_where_they_lie_no_bucket_is_packed(monkeypatch):
    communicator = FakeCommunicator(reads_pieces=True)
    monkeypatch.setattr(bridge.runtime, "communicator", lambda: communicator)
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(30, 20), (20,), (0,), (), (50, 3), (7,)]]
    arrays.insert(2, np.arange(12, dtype=np.int32).reshape(3, 4))
    before = bridge.counters()
    results = bridge.allreduce_arrays(arrays, "sum", bucket_bytes=1024)
    after = bridge.counters()
    for array, result in zip(arrays, results, strict=True):
        assert result.shape == array.shape and result.dtype == array.dtype
        np.testing.assert_array_equal(result, 2 * array)
    plan = plan_buckets([a.size for a in arrays], [a.dtype for a in arrays], 1024)
    assert [c[4] for c in communicator.calls] == ["pieces"] * len(plan)
    assert after["pack_s"] == before["pack_s"]
    # Compression goes by packing (the segment reduces full-width values only).
    communicator.calls.clear()
    bridge.allreduce_arrays(arrays, "sum", bucket_bytes=1024, compression="bf16")
    assert [c[4] for c in communicator.calls] == ["bf16" if b.dtype.kind == "f" else "pieces" for b in plan]
    (mean,) = bridge.allreduce_arrays([np.array([3, 5], np.int32)], "mean")  # the sum, floor-divided
    np.testing.assert_array_equal(mean, [3, 5])


def test_a_gpu_replicas_tensors_are_packed_not_read_where_they_lie(monkeypatch):
    # Their copies in host memory may be pinned (CUDA), which another process cannot read.
    communicator = FakeCommunicator(reads_pieces=True)
    monkeypatch.setattr(bridge.runtime, "communicator", lambda: communicator)
    tensors = [tf.ones((300,)), tf.ones((20, 3))]
    for device, kind in [(None, "pieces"), ("/job:localhost/replica:0/task:0/device:GPU:0", None)]:
        communicator.calls.clear()
        results = bridge.all_reduce_tensors(tensors, "sum", device=device)
        assert [c[4] for c in communicator.calls] == [kind]
        for tensor, result in zip(tensors, results, strict=True):
            np.testing.assert_array_equal(result.numpy(), 2 * tensor.numpy())


# ---- the order of the buckets in a tf.function ----------------------------------------------


def test_graph_has_one_numpy_function_per_bucket_chained_in_plan_order():
    shapes = [(8, 32), (32,), (32, 32), (32,), (32, 16), (16,), (16, 2), (2,)]
    variables = [tf.Variable(tf.ones(s, tf.float64)) for s in shapes]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for kernel, bias in zip(variables[::2], variables[1::2], strict=True):
                h = tf.tanh(h @ kernel + bias)
            loss = tf.reduce_sum(h)
        grads = tape.gradient(loss, variables)
        return bridge.all_reduce_tensors(grads, "sum", bucket_bytes=4096)

    graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.float64)).graph
    calls = [op for op in graph.get_operations() if op.type == "PyFunc"]
    plan = plan_buckets([int(np.prod(s)) for s in shapes], [np.float64] * len(shapes), 4096)
    assert len(calls) == len(plan) == 4
    for op, bucket in zip(calls, plan, strict=True):
        assert [tuple(t.shape) for t in op.inputs] == [shapes[i] for i in bucket.members]
    # TensorFlow's automatic control dependencies chain stateful ops without resource inputs in
    # program order: each bucket waits for the previous one, so every rank runs them in plan order.
    assert calls[0].control_inputs == [] or all(c.type != "PyFunc" for c in calls[0].control_inputs)
    for previous, op in zip(calls[:-1], calls[1:], strict=True):
        assert previous in op.control_inputs
    # Nothing else holds a bucket back: its data inputs are its own gradients only.
    assert all(op.inputs[0].op.type != "PyFunc" for op in calls)


def test_without_overlap_one_numpy_function_reduces_every_bucket(monkeypatch):
    monkeypatch.setattr(bridge, "_OVERLAP", False)

    @tf.function
    def reduce(a, b):
        return bridge.all_reduce_tensors([a, b], "sum", bucket_bytes=64)

    graph = reduce.get_concrete_function(tf.TensorSpec([20], tf.float32), tf.TensorSpec([20], tf.float32)).graph
    assert [op.type for op in graph.get_operations()].count("PyFunc") == 1


# ---- configuration errors ----------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, "64MiB", True, None])
def test_bad_bucket_bytes_is_refused_before_joining(value):
    from elasticdl_strategy import AllReduceStrategy, runtime

    with pytest.raises(ConfigError, match=re.escape(f"bucket_bytes={value!r}")):
        AllReduceStrategy(bucket_bytes=value)
    assert not runtime.is_initialized()


@pytest.mark.parametrize("value", ["fp8", "FP16", "none", 16, ["fp16"]])
def test_bad_compression_is_refused_before_joining(value):
    from elasticdl_strategy import AllReduceStrategy, runtime

    with pytest.raises(ConfigError, match=re.escape(f"compression={value!r}")) as error:
        AllReduceStrategy(compression=value)
    assert "\n" not in str(error.value)
    assert not runtime.is_initialized()


# ---- N = 2 through the launcher -------------------------------------------------------------

# tests/workers/strategy_buckets.py: 4 dense layers, float64, buckets of at most 4096 bytes.
SIZES = [8 * 32, 32, 32 * 32, 32, 32 * 16, 16, 16 * 2, 2]
BUCKET_BYTES = 4096


def _train_with_two_workers_and_alone(tmp_path, args, env=None):
    """Runs tests/workers/strategy_buckets.py (with ``args``) as a launcher job of 2 workers (``env``)
    and alone, side by side; returns (the reference's report, the two workers' reports)."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    command = [sys.executable, worker_script("strategy_buckets.py")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        job = pool.submit(run_job, 2, command + [str(tmp_path / "two"), *args], timeout=240, env=env)
        alone = pool.submit(run_alone, command + [str(tmp_path / "one"), *args], timeout=240)
        job, alone = job.result(), alone.result()
    assert job.returncode == 0, job.stderr[-3000:]
    assert alone.returncode == 0, alone.stderr[-3000:]
    return read_reports(tmp_path / "one", [0])[0], read_reports(tmp_path / "two", [0, 1])


@pytest.mark.slow
def test_training_with_several_buckets_matches_one_process(tmp_path):
    reference, workers = _train_with_two_workers_and_alone(tmp_path, [])

    plan = plan_buckets(SIZES, [np.float64] * len(SIZES), BUCKET_BYTES)
    lengths = [bucket_layout([SIZES[i] for i in b.members], np.float64)[1] for b in plan]
    expected_calls = [[[n], "float64", None] for n in lengths] + [[[1], "float64", None]]  # + the loss
    runs = ["fit", "graph", "eager"] + (["bf16"] if workers[0]["compression_supported"] else [])
    for run in runs:
        ours, other = workers[0][run], workers[1][run]
        assert ours["weights"] == other["weights"], run  # bitwise identical on both workers
        for mine, theirs in zip(ours["weights"], reference[run]["weights"], strict=True):
            # float64: only the order of a few additions differs (Adam amplifies it to ~1e-12);
            # bf16 on the wire: relative errors of 2^-8 in the gradients.
            tolerance = 1e-2 if run == "bf16" else 1e-9
            np.testing.assert_allclose(mine, theirs, rtol=tolerance, atol=tolerance)
        np.testing.assert_allclose(ours["losses"], reference[run]["losses"], rtol=1e-2 if run == "bf16" else 1e-6)
        if run == "fit":
            continue
        # One ring all-reduce per bucket, last layer's bucket first, the same on both ranks.
        assert ours["buckets_per_step"] == len(plan) + 1, run
        if run == "bf16":
            expected = [[c[0], c[1], "bf16"] for c in expected_calls[:-1]] + expected_calls[-1:]
        else:
            expected = expected_calls
        assert ours["calls_per_step"] == other["calls_per_step"] == expected, run
        # Staging buffers are kept between steps: none allocated after the warm-up steps.
        assert ours["staging_allocations_after_warmup"] == 0, run


@pytest.mark.slow
def test_training_with_buckets_read_where_they_lie_matches_one_process(tmp_path):
    # Slots of 4 KiB: the 8.4 KiB bucket (dense_1's kernel) is read where it lies in the other
    # worker's process (single copy), the smaller ones go through the slots.
    env = {**os.environ, "EDL_HOST_SEGMENT_BYTES": "4096"}
    reference, workers = _train_with_two_workers_and_alone(tmp_path, ["graph,eager"], env)
    plan = plan_buckets(SIZES, [np.float64] * len(SIZES), BUCKET_BYTES)
    lengths = [bucket_layout([SIZES[i] for i in b.members], np.float64)[1] for b in plan]
    expected = [[[n], "float64", "pieces" if n * 8 > 4096 else None] for n in lengths] + [[[1], "float64", None]]
    assert sum(c[2] == "pieces" for c in expected) == 1
    for run in ("graph", "eager"):
        ours, other = workers[0][run], workers[1][run]
        assert ours["weights"] == other["weights"], run  # bitwise identical on both workers
        for mine, theirs in zip(ours["weights"], reference[run]["weights"], strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(ours["losses"], reference[run]["losses"], rtol=1e-6)
        assert ours["calls_per_step"] == other["calls_per_step"] == expected, run
