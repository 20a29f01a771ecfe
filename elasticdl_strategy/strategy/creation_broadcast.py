"""Whether a variable created under the strategy takes rank 0's value at creation.

Every worker creates the model's variables with its own initial values; rank
0's are broadcast at creation so that all replicas start identical. Two
exceptions: a worker that joined a running job (its state arrives by the
``elastic`` sync while the others are not creating variables), and code that
syncs variables itself (a restored checkpoint, an elastic state's own
counters), which creates them inside :func:`no_broadcast_at_creation`.
"""

from __future__ import annotations

from elasticdl_strategy import runtime
from elasticdl_strategy.strategy.thread_flag import ThreadFlag

_suspended = ThreadFlag()


def enabled() -> bool:
    """False on a worker that joined a running job, and inside :func:`no_broadcast_at_creation`."""
    if _suspended.is_set:
        return False
    return not runtime.joined_running_job()


def no_broadcast_at_creation():
    """Creates variables without the creation-time broadcast (the caller syncs them itself).

    Example::

        with no_broadcast_at_creation():
            counter = tf.Variable(0)
    """
    return _suspended()
