"""runtime.tracing_for: another membership shape, in one thread, where nothing may communicate."""

import threading

import pytest

from elasticdl_strategy import runtime
from elasticdl_strategy.errors import UsageError

pytestmark = pytest.mark.usefixtures("single_worker")


def test_only_the_tracing_thread_sees_the_other_shape_and_it_cannot_communicate():
    seen_elsewhere = []
    with runtime.tracing_for(3, 2):
        assert (runtime.size(), runtime.rank()) == (3, 2)
        with pytest.raises(UsageError, match="while tracing ahead for 3 workers"):
            runtime.communicator()
        other = threading.Thread(target=lambda: seen_elsewhere.append((runtime.size(), runtime.rank())))
        other.start()
        other.join(10)
    assert seen_elsewhere == [(1, 0)]
    assert (runtime.size(), runtime.rank()) == (1, 0) and runtime.communicator().size == 1
