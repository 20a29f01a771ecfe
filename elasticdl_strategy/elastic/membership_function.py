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
a worker leaving, the size after it). After its first call in a shape it also
traces, in a thread of its own, for the shapes after one member fails or leaves
(once the shape has run a few seconds), and has TensorFlow instantiate those
traces without running them (:func:`~elasticdl_strategy.strategy.tf_compat.instantiate_without_running`),
so that the first step of a recovery finds its trace ready and costs what a later one does.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from elasticdl_strategy import runtime
from elasticdl_strategy.strategy import tf_compat

logger = logging.getLogger(__name__)

# (size, rank) pairs whose traces are kept; the least recently used beyond this are dropped.
MAX_MEMBERSHIP_SHAPES = 8
# Tracing ahead starts once a shape has run this long: not while a membership is still forming or
# failing (a trace takes a CPU for ~0.2-0.5 s and competes for the GIL; a recovery it overlapped
# on a loaded 2-core machine took 2 s longer).
TRACE_AHEAD_AFTER_S = 5.0

Shape = Tuple[int, int]


def shapes_after_one_leaves(size: int, rank: int) -> List[Shape]:
    """The (size, rank) of this worker after one other member leaves or dies: ranks follow join
    order, so a rank above this one's leaves it as it is, one below moves it down by one.

    >>> shapes_after_one_leaves(3, 0), shapes_after_one_leaves(3, 1), shapes_after_one_leaves(3, 2)
    ([(2, 0)], [(2, 1), (2, 0)], [(2, 1)])
    >>> shapes_after_one_leaves(1, 0)
    []
    """
    return [(size - 1, r) for r in (rank, rank - 1) if 0 <= r < size - 1]


class MembershipFunction:
    """A ``tf.function`` of ``fn`` per (number of workers, rank), made on first call in each.

    Once it has run in a shape for :data:`TRACE_AHEAD_AFTER_S`, it traces, in a thread of its own,
    for the shapes this worker is in after one member fails or leaves (``trace_ahead``), and
    instantiates those traces without running them: a recovery then runs a trace ready for it.
    That thread sees the other shape (:func:`~elasticdl_strategy.runtime.tracing_for`); a trace
    that fails there is left to the call that needs it. ``clock``: for tests.

    Attributes:
        traced: the (size, rank) pairs it holds a ``tf.function`` for, least recently used first.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        trace_ahead: bool = True,
        clock: Callable[[], float] = time.monotonic,
        **tf_function_kwargs: Any,
    ):
        self._fn = fn
        self._kwargs = tf_function_kwargs
        self._trace_ahead = trace_ahead
        self._functions: "collections.OrderedDict[Shape, Any]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ahead: Optional[threading.Thread] = None
        self._clock = clock
        self._first_called: Dict[Shape, float] = {}  # when each shape was first called
        self._traced_ahead: Set[Shape] = set()  # shapes it traced ahead from
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shape = (runtime.size(), runtime.rank())
        function, _ = self._function_for(shape)
        result = function(*args, **kwargs)
        if self._trace_ahead and shape not in self._traced_ahead:
            now = self._clock()
            ran_long_enough = now - self._first_called.setdefault(shape, now) >= TRACE_AHEAD_AFTER_S
            if ran_long_enough and self._start_tracing_ahead(shapes_after_one_leaves(*shape), args, kwargs):
                self._traced_ahead.add(shape)
        return result

    @property
    def traced(self) -> Tuple[Shape, ...]:
        with self._lock:
            return tuple(self._functions)

    def wait_for_traces_ahead(self, timeout: float) -> bool:
        """Waits for the tracing ahead in progress, if any; returns whether none is left."""
        thread = self._ahead
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _function_for(self, shape: Shape) -> Tuple[Any, bool]:
        """The ``tf.function`` of ``shape``, and whether it was made now."""
        with self._lock:
            function = self._functions.get(shape)
            new = function is None
            if new:
                import tensorflow as tf

                function = self._functions[shape] = tf.function(self._fn, **self._kwargs)
                while len(self._functions) > MAX_MEMBERSHIP_SHAPES:
                    self._functions.popitem(last=False)
            self._functions.move_to_end(shape)
            return function, new

    def _start_tracing_ahead(self, shapes: List[Shape], args: tuple, kwargs: dict) -> bool:
        """Starts tracing the ``shapes`` not yet traced; False while an earlier tracing ahead runs."""
        with self._lock:
            if self._ahead is not None and self._ahead.is_alive():
                return False
            shapes = [s for s in shapes if s not in self._functions]
            if shapes:
                self._ahead = threading.Thread(
                    target=self._trace_shapes, args=(shapes, args, kwargs), name="edl-trace-ahead", daemon=True
                )
                self._ahead.start()
            return True

    def _trace_shapes(self, shapes: List[Shape], args: tuple, kwargs: dict) -> None:
        for shape in shapes:
            function, new = self._function_for(shape)
            if not new:
                continue
            try:
                with runtime.tracing_for(*shape):
                    concrete = function.get_concrete_function(*args, **kwargs)
                tf_compat.instantiate_without_running(concrete, args, kwargs)
            except Exception as e:  # noqa: BLE001 - a guess: the call in that shape traces itself
                name = getattr(self._fn, "__name__", "a function")
                logger.debug("tracing %s ahead for %d workers (rank %d) failed: %s", name, *shape, e)


def function(fn: Optional[Callable[..., Any]] = None, trace_ahead: bool = True, **tf_function_kwargs: Any):
    """Like ``tf.function``, but traced once per (number of workers, rank) and kept across
    re-formations: create it once, outside the function :func:`~elasticdl_strategy.elastic.run`
    calls. ``trace_ahead``: once it has run in a shape for :data:`TRACE_AHEAD_AFTER_S`, trace and
    instantiate, in the background, for the shapes after one member fails or leaves (the first step
    of a recovery then costs what a later one does). ``tf_function_kwargs`` go to ``tf.function``
    (``jit_compile``, ``input_signature``, ...).

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
                step(indices)  # traced in the first membership of each shape, then reused
                ...

    Python values the function reads while tracing, other than the number of workers and the rank,
    are those of its first call in that membership shape, as with any ``tf.function``; tracing must
    not communicate (it does not, unless the function calls collectives eagerly while tracing).
    """
    if fn is None:
        return lambda f: MembershipFunction(f, trace_ahead, **tf_function_kwargs)
    return MembershipFunction(fn, trace_ahead, **tf_function_kwargs)
