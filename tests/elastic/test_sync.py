"""State.sync on three ranks (threads): everyone ends with rank 0's state, and the variables travel
only when some member may hold others."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy import elastic, runtime
from tests.cluster import ThreadCluster

SIZE = 4096  # elements of the variable: a broadcast of it is told apart from the small ones by size


@pytest.fixture
def cluster(monkeypatch):
    """Three ranks; ``runtime.communicator()`` answers each rank's thread with its own communicator,
    whose broadcasts are recorded (element counts) in ``cluster.sent[rank]``."""
    local = threading.local()
    monkeypatch.setattr(runtime, "communicator", lambda: local.communicator)
    with ThreadCluster(3) as c:
        c.sent = [[] for _ in range(c.size)]

        def on_rank(fn):
            def run(communicator):
                local.communicator = communicator
                real = communicator.broadcast

                def broadcast(array, root=0, **kwargs):
                    c.sent[communicator.rank].append(np.asarray(array).size)
                    return real(array, root=root, **kwargs)

                communicator.broadcast = broadcast
                try:
                    return fn(communicator.rank)
                finally:
                    del communicator.broadcast

            return c.run(run)

        c.on_rank = on_rank
        yield c


def make_states(first_values):
    """A state per rank: one variable of SIZE elements starting at ``first_values[rank]``, and a value."""
    return [
        elastic.State(variables=[tf.Variable(np.full(SIZE, value, np.float32))], step=rank)
        for rank, value in enumerate(first_values)
    ]


def variable(state):
    return state.variables()[0].numpy()


def sent_variables(cluster):
    """Whether any rank broadcast the variable since the last call."""
    sent = any(count == SIZE for per_rank in cluster.sent for count in per_rank)
    for per_rank in cluster.sent:
        per_rank.clear()
    return sent


def test_members_holding_the_commit_they_rolled_back_to_exchange_no_variables(cluster):
    states = make_states([1.0, 2.0, 3.0])
    cluster.on_rank(lambda rank: states[rank].sync())  # nobody holds a commit yet: rank 0's everywhere
    assert sent_variables(cluster)
    assert all((variable(s) == 1.0).all() and s.step == 0 for s in states)

    def train_then_roll_back(rank):
        states[rank].variables()[0].assign(np.full(SIZE, 9.0 + rank, np.float32))
        states[rank].step = 7
        states[rank].restore(states[rank].commit_id)
        states[rank].sync()

    cluster.on_rank(train_then_roll_back)
    assert not sent_variables(cluster)
    assert all((variable(s) == 1.0).all() and s.step == 0 for s in states)


def test_a_variable_a_reset_callback_changed_on_one_member_comes_from_rank_0(cluster):
    states = make_states([1.0, 1.0, 1.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    sent_variables(cluster)
    changed = np.full(SIZE, 1.0, np.float32)
    changed[-1] = 5.0  # one element, on rank 2 only
    states[2].register_reset_callbacks([lambda: states[2].variables()[0].assign(changed)])

    def reset_and_sync(rank):
        states[rank].on_reset()
        states[rank].sync()

    cluster.on_rank(reset_and_sync)
    assert sent_variables(cluster)
    assert all((variable(s) == 1.0).all() for s in states)


def test_a_sign_of_zero_is_a_difference(cluster):
    states = make_states([0.0, 0.0, 0.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    sent_variables(cluster)
    states[1].variables()[0].assign(np.full(SIZE, -0.0, np.float32))  # == 0.0, other bits
    cluster.on_rank(lambda rank: states[rank].sync())
    assert sent_variables(cluster)
    assert not np.signbit(variable(states[1])).any()


def test_a_newcomer_without_the_commit_receives_every_variable(cluster):
    states = make_states([1.0, 1.0, 1.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    sent_variables(cluster)
    newcomer = elastic.State(variables=[tf.Variable(np.full(SIZE, 4.0, np.float32))], step=2)
    states[2] = newcomer  # a new process in rank 2's place: it holds no commit
    cluster.on_rank(lambda rank: states[rank].sync())
    assert sent_variables(cluster)
    assert (variable(newcomer) == 1.0).all() and newcomer.step == 0

    def train_then_roll_back(rank):  # the snapshot the sync kept is rank 0's state on every rank
        states[rank].variables()[0].assign(np.full(SIZE, 7.0, np.float32))
        states[rank].restore(states[rank].commit_id)

    cluster.on_rank(train_then_roll_back)
    assert all((variable(s) == 1.0).all() for s in states)
