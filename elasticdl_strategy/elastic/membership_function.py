"""``elastic.function``: a ``tf.function`` that keeps its traces across re-formations.

A traced graph holds what its Python code read while tracing: the number of
workers (``runtime.size()``, ``strategy.num_replicas_in_sync``, a global batch
computed from them) and this worker's rank (the replica id). So a step traced
in one membership is wrong in a membership of another size, and ``elastic.run``
asks for step functions to be created anew in the training function it calls
after every re-formation: each then traces again (~0.2-0.5 s for a model of a
few million parameters, most of a recovery). :func:`function` keeps one
``tf.function`` per (number of workers, rank): created once, outside the
training function, it traces once per pair and runs that trace whenever the
job comes back to it (a replacement joining restores the size before a failure;
a worker leaving, the size after it).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional, Tuple

from elasticdl_strategy import runtime

# (size, rank) pairs whose traces are kept; the least recently used beyond this are dropped.
MAX_MEMBERSHIP_SHAPES = 8


class MembershipFunction:
    """A ``tf.function`` of ``fn`` per (number of workers, rank), made on first call in each.

    Attributes:
        traced: the (size, rank) pairs it holds a ``tf.function`` for, least recently used first.
    """

    def __init__(self, fn: Callable[..., Any], **tf_function_kwargs: Any):
        self._fn = fn
        self._kwargs = tf_function_kwargs
        self._functions: "collections.OrderedDict[Tuple[int, int], Any]" = collections.OrderedDict()
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function_for(runtime.size(), runtime.rank())(*args, **kwargs)

    @property
    def traced(self) -> Tuple[Tuple[int, int], ...]:
        return tuple(self._functions)

    def _function_for(self, size: int, rank: int):
        key = (size, rank)
        function = self._functions.get(key)
        if function is None:
            import tensorflow as tf

            function = self._functions[key] = tf.function(self._fn, **self._kwargs)
            while len(self._functions) > MAX_MEMBERSHIP_SHAPES:
                self._functions.popitem(last=False)
        self._functions.move_to_end(key)
        return function


def function(fn: Optional[Callable[..., Any]] = None, **tf_function_kwargs: Any):
    """Like ``tf.function``, but traced once per (number of workers, rank) and kept across
    re-formations: create it once, outside the function :func:`~elasticdl_strategy.elastic.run`
    calls. ``tf_function_kwargs`` go to ``tf.function`` (``jit_compile``, ``input_signature``, ...).

    Returns:
        A :class:`MembershipFunction`, or a decorator making one when ``fn`` is not given.

    Example::

        strategy = AllReduceStrategy()
        ...

        @elastic.function
        def step(indices):
            def replica_step(indices):
                ...
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch * runtime.size())
                ...
            return strategy.run(replica_step, args=(indices,))

        @elastic.run
        def train(state):
            for indices in records.dataset():
                step(indices)  # traced in the first membership of each size, then reused
                ...

    Python values the function reads while tracing, other than the number of workers and the rank,
    are those of its first call in that membership shape, as with any ``tf.function``.
    """
    if fn is None:
        return lambda f: MembershipFunction(f, **tf_function_kwargs)
    return MembershipFunction(fn, **tf_function_kwargs)
