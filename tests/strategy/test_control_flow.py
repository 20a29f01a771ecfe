"""Collectives inside TensorFlow control flow run in program order on every rank.

In-process: the ordering token serializes collectives across a nested function call, a
``tf.cond`` and while-loop iterations (a fake communicator sees which calls overlap). Through
the launcher: Keras and TensorFlow code that puts collectives in such places trains like one
process on the global batch (``tests/workers/strategy_control_flow.py``), on 3 workers.
"""

import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy.strategy import bridge, ordering
from tests.launch import read_reports, run_alone, run_job, worker_script


class OverlapDetector:
    """A communicator of 2 ranks (a sum doubles) that records the order of its calls and
    whether one started while another was running. Each call waits up to ``linger`` seconds
    for another to start beside it, so an executor free to overlap them does."""

    size = 2

    def __init__(self, linger: float = 0.05):
        self.linger = linger
        self.order = []
        self.running = 0
        self.overlapped = False
        self._condition = threading.Condition()

    def allreduce(self, array, op="sum", out=None, timeout=None, **kwargs):
        with self._condition:
            self.running += 1
            self.overlapped |= self.running > 1
            self.order.append(array.size)
            self._condition.notify_all()
            self._condition.wait_for(lambda: self.running > 1, timeout=self.linger)
            self.running -= 1
        np.multiply(array, 2, out=out)
        return out

    def reads_pieces(self, nbytes, count):  # the bridge packs every bucket and calls allreduce
        return False


@pytest.fixture
def detector(monkeypatch):
    communicator = OverlapDetector()
    monkeypatch.setattr(bridge.runtime, "communicator", lambda: communicator)
    return communicator


def _program(variable):
    """A while loop whose body calls a tf.function holding one all-reduce (of 3 elements) inside
    a cond, next to an all-reduce (of 1 element) that does not depend on it."""

    @tf.function
    def inner(x):
        (y,) = bridge.all_reduce_tensors([x * 2.0], "sum")
        variable.assign_add(y)
        return y

    @tf.function
    def loop(steps):
        def body(i):
            tf.cond(i >= 0, lambda: inner(tf.ones(3)), lambda: tf.zeros(3))
            bridge.all_reduce_tensors([tf.cast(i, tf.float32)[None]], "sum")
            return (i + 1,)

        return tf.while_loop(lambda i: i < steps, body, [tf.constant(0)])

    return loop


def test_collectives_in_conds_nested_functions_and_loop_iterations_run_one_at_a_time_in_program_order(
    detector,
):
    variable = tf.Variable(tf.zeros(3))
    _program(variable)(tf.constant(4))
    assert not detector.overlapped
    assert detector.order == [3, 1] * 4
    np.testing.assert_array_equal(variable.numpy(), [16.0] * 3)


def test_without_the_token_the_executor_overlaps_them(detector, monkeypatch):
    # The control: the same program, collectives not ordered. Shows what the test above guards.
    monkeypatch.setattr(ordering, "ordered", lambda make: list(make()))
    detector.linger = 2.0  # ends as soon as a second call starts beside the first
    _program(tf.Variable(tf.zeros(3)))(tf.constant(4))
    assert detector.overlapped


def test_the_token_is_made_outside_any_graph_and_without_variable_creators():
    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    token = ordering.OrderingToken()
    with tf.variable_creator_scope(creator):

        @tf.function
        def f():
            return token.variable.read_value()

        assert int(f()) == 0  # made while f is traced, outside its graph
    assert created == []
    assert token.variable is token.variable  # one token, captured by every function


# ---- through the launcher -----------------------------------------------------------------

SCENARIOS = ["plain_fit", "spe2", "spe4", "accumulate", "batchnorm_sync", "mixed_fit", "loss_scale_loop", "while_loop"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    result = run_alone([sys.executable, worker_script("strategy_control_flow.py"), str(out), *SCENARIOS], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_reports(out, [0])[0]


@pytest.mark.slow
def test_keras_and_tf_control_flow_train_like_one_process(tmp_path, reference):
    # 3 workers: the shares of the loss (1/3) are inexact in binary, unlike 1/2.
    n = 3
    command = [sys.executable, worker_script("strategy_control_flow.py"), str(tmp_path), *SCENARIOS]
    job = run_job(n, command, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = read_reports(tmp_path, range(n))
    for name in SCENARIOS:
        for other in workers[1:]:
            assert other[name]["weights"] == workers[0][name]["weights"], name  # bitwise identical
        # float64 scenarios: round-off only. float16 compute: within its precision.
        tolerance = 1e-4 if name in ("mixed_fit", "loss_scale_loop") else 1e-9
        for ours, theirs in zip(workers[0][name]["weights"], reference[name]["weights"], strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=tolerance, atol=tolerance, err_msg=name)
    # The overflowing batch (in the last worker's rows only) was skipped everywhere, as by one process.
    scales = reference["loss_scale_loop"]["scales"]
    assert scales[2] == scales[1] / 2
    assert [w["loss_scale_loop"]["scales"] for w in workers] == [scales] * n
    assert [w["while_loop"]["rows"] for w in workers] == [reference["while_loop"]["rows"]] * n
    np.testing.assert_allclose(workers[0]["while_loop"]["losses"], reference["while_loop"]["losses"], rtol=1e-9)
