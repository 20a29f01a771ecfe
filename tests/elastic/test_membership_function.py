"""elastic.function: one trace per (number of workers, rank), kept across re-formations."""

import pytest
import tensorflow as tf

from elasticdl_strategy import elastic, runtime
from elasticdl_strategy.elastic import membership_function


@pytest.fixture
def membership(monkeypatch):
    """The (size, rank) that runtime reports, as a dict the test changes."""
    now = {"size": 3, "rank": 0}
    monkeypatch.setattr(runtime, "size", lambda: now["size"])
    monkeypatch.setattr(runtime, "rank", lambda: now["rank"])
    return now


def test_a_membership_shape_seen_before_runs_its_trace_again(membership):
    traces = []

    @elastic.function
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
    @elastic.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def double(x):
        return 2 * x

    with pytest.raises(TypeError, match="Binding inputs"):
        double(tf.constant(1.5))  # not the signature's dtype
    for size in range(1, membership_function.MAX_MEMBERSHIP_SHAPES + 3):
        membership.update(size=size)
        assert int(double(tf.constant(size))) == 2 * size
    assert len(double.traced) == membership_function.MAX_MEMBERSHIP_SHAPES
    assert double.traced[0] == (3, 0) and double.traced[-1] == (membership_function.MAX_MEMBERSHIP_SHAPES + 2, 0)
