"""The order of collectives inside TensorFlow graphs: program order, on every rank.

Ranks pair their collectives by call order (the communicator numbers them and
checks each against its peers'). Eagerly that is the order of the Python
code. Inside a ``tf.function`` each collective is a stateful
``numpy_function``, and TensorFlow's executor does not promise the run order
of stateful ops that share no resource: automatic control dependencies chain
them only within one function graph, so a function call, a ``tf.cond`` branch
or a ``tf.while_loop`` that contains collectives runs beside the collectives
around it, and while-loop iterations overlap. Keras puts gradient all-reduces
in such places (loss scaling, ``steps_per_execution``, gradient
accumulation), beside the distributed iterator's "has data" reduction and the
per-step log reduction: without an order, one rank ran the gradients first
and another the log value first.

The design, after TensorFlow's NCCL path (its ``ordering_token``): every
collective op in a graph is put between two writes to one resource
variable, the *ordering token* — ``open = token.assign_add(1)``, then the
collective with a control dependency on ``open``, then ``close =
token.assign_add(1)`` with a control dependency on the collective's outputs.
Automatic control dependencies run the ops that write one resource in
program order (that is what makes ``v.assign(1); v.assign(2)`` end with 2),
and a function call, ``cond`` or ``while_loop`` whose body touches the token
captures it, so it is ordered like any other writer: it starts after the
previous writer and its token writes complete before the next one starts,
iteration after iteration. Thus a collective starts only after the previous
one (in program order) has completed, on every rank alike, whatever the
executor's threads do; and collectives still need nothing but their own
inputs and the token, so a gradient bucket is still reduced while backprop
computes the earlier layers.

Why not TensorFlow's other mechanism, collectives matched by keys fixed at
trace time and run as asynchronous kernels? A ``numpy_function`` is a
synchronous kernel that holds an executor thread while it waits for the
peers: with keys but no order, two ranks could each fill their (few) threads
with collectives the other has not started, and wait forever. One order, and
one collective at a time per rank, cannot deadlock that way, and the
communicator keeps detecting any remaining difference between ranks
(``CollectiveMismatchError``).

Eager collectives need no token: Python runs them in order.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import tensorflow as tf

from elasticdl_strategy.strategy.tf_compat import resource_variable_ops


class OrderingToken:
    """The resource that orders the collective ops of every graph of this process.

    Example::

        token = OrderingToken()

        @tf.function
        def f(x):
            (y,) = token.ordered(lambda: [tf.numpy_function(reduce, [x], x.dtype, stateful=True)])
            return y
    """

    def __init__(self) -> None:
        self._variable: Optional[tf.Variable] = None
        self._lock = threading.Lock()

    @property
    def variable(self) -> tf.Variable:
        """The token: an int64 resource variable on the CPU, made on first use.

        It is made with the ``ResourceVariable`` constructor itself, so no
        variable creator runs (under ``strategy.scope()`` ours would broadcast
        it), and outside any graph (``init_scope``), so every function captures
        the same one.
        """
        with self._lock:
            if self._variable is None:
                with tf.init_scope(), tf.device("/cpu:0"):
                    self._variable = resource_variable_ops.ResourceVariable(
                        0, dtype=tf.int64, trainable=False, name="elasticdl_collective_order"
                    )
            return self._variable

    def ordered(self, make_collective: Callable[[], List[tf.Tensor]]) -> List[tf.Tensor]:
        """Builds the collective op(s) of ``make_collective`` between two writes of the token.

        Returns:
            the tensors ``make_collective`` returned; they are available as soon
            as the collective completes (the closing write runs beside their consumers).
        """
        token = self.variable
        opened = token.assign_add(1, read_value=False)
        with tf.control_dependencies([opened]):
            outputs = list(make_collective())
        with tf.control_dependencies(outputs):
            token.assign_add(1, read_value=False)
        return outputs


_token = OrderingToken()


def ordered(make_collective: Callable[[], List[tf.Tensor]]) -> List[tf.Tensor]:
    """:meth:`OrderingToken.ordered` with the process's token (one for all strategies and graphs)."""
    return _token.ordered(make_collective)
