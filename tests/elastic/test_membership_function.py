"""elastic.function: one trace per (number of workers, rank), kept across re-formations."""

import threading

import pytest
import tensorflow as tf

from elasticdl_strategy import elastic, runtime
from elasticdl_strategy.elastic import membership_function
from elasticdl_strategy.strategy import tf_compat


class Communicator:
    size, rank = 3, 0

    def update(self, size=None, rank=None):
        self.size = self.size if size is None else size
        self.rank = self.rank if rank is None else rank


@pytest.fixture
def membership(monkeypatch):
    """The communicator whose size and rank runtime reports (the test changes them)."""
    communicator = Communicator()
    monkeypatch.setattr(runtime, "communicator", lambda: communicator)
    return communicator


def test_a_membership_shape_seen_before_runs_its_trace_again(membership):
    traces = []

    @elastic.function(trace_ahead=False)
    def global_batch(per_worker):
        traces.append((runtime.size(), runtime.rank()))  # runs only while tracing
        return per_worker * runtime.size()

    results = []
    for size, rank in [(3, 0), (2, 0), (3, 0), (2, 1), (2, 0)]:
        membership.update(size=size, rank=rank)
        results.append(int(global_batch(tf.constant(8))))
    assert results == [24, 16, 24, 16, 16]
    assert traces == [(3, 0), (2, 0), (2, 1)]
    assert global_batch.traced == ((3, 0), (2, 1), (2, 0))  # least recently used first


def test_tf_function_arguments_apply_and_the_oldest_shapes_are_dropped(membership):
    @elastic.function(trace_ahead=False, input_signature=[tf.TensorSpec([], tf.int32)])
    def double(x):
        return 2 * x

    with pytest.raises(TypeError, match="Binding inputs"):
        double(tf.constant(1.5))  # not the signature's dtype
    for size in range(1, membership_function.MAX_MEMBERSHIP_SHAPES + 3):
        membership.update(size=size)
        assert int(double(tf.constant(size))) == 2 * size
    assert len(double.traced) == membership_function.MAX_MEMBERSHIP_SHAPES
    assert double.traced[0] == (3, 0) and double.traced[-1] == (membership_function.MAX_MEMBERSHIP_SHAPES + 2, 0)


def test_the_shapes_after_a_member_leaves_are_traced_ahead_in_the_background(membership, monkeypatch):
    traces, now, instantiated = [], [0.0], []
    real_instantiate = tf_compat.instantiate_without_running

    def instantiate(concrete, args, kwargs):  # the traces made ahead are made ready to run, not run
        instantiated.append(int(args[0]))
        real_instantiate(concrete, args, kwargs)

    monkeypatch.setattr(tf_compat, "instantiate_without_running", instantiate)

    def global_batch_of(per_worker):
        traces.append((runtime.size(), runtime.rank()))
        return per_worker * runtime.size()

    global_batch = elastic.MembershipFunction(global_batch_of, clock=lambda: now[0])
    membership.update(size=3, rank=1)
    assert int(global_batch(tf.constant(8))) == 24
    now[0] += membership_function.TRACE_AHEAD_AFTER_S - 0.1
    global_batch(tf.constant(8))
    assert global_batch.wait_for_traces_ahead(timeout=30) and traces == [(3, 1)]  # not yet: the shape is new
    now[0] += 0.1
    global_batch(tf.constant(8))
    assert global_batch.wait_for_traces_ahead(timeout=30)
    assert sorted(traces) == [(2, 0), (2, 1), (3, 1)]  # after rank 2 leaves, or rank 0
    assert instantiated == [8, 8]  # each with the arguments of the call that started the tracing
    assert (runtime.size(), runtime.rank()) == (3, 1)  # only the tracing thread saw the other shapes
    for rank in (0, 1):
        membership.update(size=2, rank=rank)
        assert int(global_batch(tf.constant(8))) == 16  # the trace made ahead, with its own size
    now[0] += membership_function.TRACE_AHEAD_AFTER_S
    membership.update(size=2, rank=0)
    global_batch(tf.constant(8))
    assert global_batch.wait_for_traces_ahead(timeout=30)
    assert sorted(traces) == [(1, 0), (2, 0), (2, 1), (3, 1)]  # and, once used, from there on


def test_a_shape_whose_tracing_ahead_waited_for_another_is_traced_ahead_later(membership):
    traces, now, release = [], [0.0], threading.Event()

    def fn(x):
        traces.append((runtime.size(), runtime.rank()))
        if (runtime.size(), runtime.rank()) == (2, 0):
            assert release.wait(30)  # keeps the first tracing ahead busy
        return x

    function = elastic.MembershipFunction(fn, clock=lambda: now[0])
    for size in (3, 5):  # first calls
        membership.update(size=size, rank=0)
        function(tf.constant(1))
    now[0] += membership_function.TRACE_AHEAD_AFTER_S
    membership.update(size=3)
    function(tf.constant(1))  # traces (2, 0) ahead, which blocks
    membership.update(size=5)
    function(tf.constant(1))  # (4, 0) must wait: the thread is busy
    release.set()
    assert function.wait_for_traces_ahead(timeout=30) and (4, 0) not in traces
    function(tf.constant(1))
    assert function.wait_for_traces_ahead(timeout=30)
    assert sorted(set(traces)) == [(2, 0), (3, 0), (4, 0), (5, 0)]
