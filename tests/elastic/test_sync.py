"""State.sync on three ranks (threads): everyone ends with rank 0's state, and the variables travel
only to members that may hold others."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy import elastic, runtime
from elasticdl_strategy.elastic import variable_sync
from tests.cluster import ThreadCluster

SIZE = 4096  # elements of the variable: its transfer is told apart from the small ones by size


@pytest.fixture
def cluster(monkeypatch):
    """Three ranks; ``runtime.communicator()`` answers each rank's thread with its own communicator,
    whose broadcasts and scatters are recorded (element counts received) in ``cluster.got[rank]``."""
    local = threading.local()
    monkeypatch.setattr(runtime, "communicator", lambda: local.communicator)
    with ThreadCluster(3) as c:
        c.got = [[] for _ in range(c.size)]

        def on_rank(fn):
            def run(communicator):
                local.communicator = communicator
                for name in ("broadcast", "scatter"):
                    real = getattr(communicator, name)

                    def recorded(*args, real=real, **kwargs):
                        result = real(*args, **kwargs)
                        c.got[communicator.rank].append(result.size)
                        return result

                    setattr(communicator, name, recorded)
                try:
                    return fn(communicator.rank)
                finally:
                    del communicator.broadcast, communicator.scatter

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


def receivers(cluster):
    """The ranks other than 0 that received the variable since the last call."""
    got = {rank for rank, counts in enumerate(cluster.got) if rank != 0 and SIZE in counts}
    for counts in cluster.got:
        counts.clear()
    return got


def test_members_holding_the_commit_they_rolled_back_to_exchange_no_variables(cluster):
    states = make_states([1.0, 2.0, 3.0])
    cluster.on_rank(lambda rank: states[rank].sync())  # nobody holds a commit yet: rank 0's everywhere
    assert receivers(cluster) == {1, 2}
    assert all((variable(s) == 1.0).all() and s.step == 0 for s in states)

    def train_then_roll_back(rank):
        states[rank].variables()[0].assign(np.full(SIZE, 9.0 + rank, np.float32))
        states[rank].step = 7
        states[rank].restore(states[rank].commit_id)
        states[rank].sync()

    cluster.on_rank(train_then_roll_back)
    assert receivers(cluster) == set()
    assert all((variable(s) == 1.0).all() and s.step == 0 for s in states)


def test_a_variable_a_reset_callback_changed_on_one_member_comes_from_rank_0_to_it_alone(cluster):
    states = make_states([1.0, 1.0, 1.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    receivers(cluster)
    changed = np.full(SIZE, 1.0, np.float32)
    changed[-1] = 5.0  # one element, on rank 2 only
    states[2].register_reset_callbacks([lambda: states[2].variables()[0].assign(changed)])

    def reset_and_sync(rank):
        states[rank].on_reset()
        states[rank].sync()

    cluster.on_rank(reset_and_sync)
    assert receivers(cluster) == {2}
    assert all((variable(s) == 1.0).all() for s in states)


def test_a_variable_a_reset_callback_changed_on_rank_0_goes_to_everyone(cluster):
    states = make_states([1.0, 1.0, 1.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    receivers(cluster)
    states[0].register_reset_callbacks([lambda: states[0].variables()[0].assign(np.full(SIZE, 3.0, np.float32))])

    def reset_and_sync(rank):
        states[rank].on_reset()
        states[rank].sync()

    cluster.on_rank(reset_and_sync)
    assert receivers(cluster) == {1, 2}
    assert all((variable(s) == 3.0).all() for s in states)


def test_a_sign_of_zero_is_a_difference(cluster):
    states = make_states([0.0, 0.0, 0.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    receivers(cluster)
    states[1].variables()[0].assign(np.full(SIZE, -0.0, np.float32))  # == 0.0, other bits
    cluster.on_rank(lambda rank: states[rank].sync())
    assert receivers(cluster) == {1}
    assert not np.signbit(variable(states[1])).any()


def test_a_newcomer_without_the_commit_alone_receives_every_variable(cluster):
    states = make_states([1.0, 1.0, 1.0])
    cluster.on_rank(lambda rank: states[rank].sync())
    receivers(cluster)
    newcomer = elastic.State(variables=[tf.Variable(np.full(SIZE, 4.0, np.float32))], step=2)
    states[2] = newcomer  # a new process in rank 2's place: it holds no commit
    cluster.on_rank(lambda rank: states[rank].sync())
    assert receivers(cluster) == {2}
    assert (variable(newcomer) == 1.0).all() and newcomer.step == 0

    def train_then_roll_back(rank):  # the snapshot the sync kept is rank 0's state on every rank
        states[rank].variables()[0].assign(np.full(SIZE, 7.0, np.float32))
        states[rank].restore(states[rank].commit_id)

    cluster.on_rank(train_then_roll_back)
    assert all((variable(s) == 1.0).all() for s in states)


@pytest.mark.parametrize("send_to_at_most", [2, 1], ids=["scatter", "broadcast"])
def test_variables_travel_in_groups_of_one_dtype_and_a_large_one_alone(cluster, monkeypatch, send_to_at_most):
    """Rank 0 sends a variable of GROUP_BYTES or more as it is (no second copy of the whole state),
    smaller ones of one dtype fused up to GROUP_BYTES; every receiver ends with rank 0's values,
    sent to each (scatter) or to all at once (broadcast)."""
    monkeypatch.setattr(variable_sync, "GROUP_BYTES", 2 * SIZE * 4)
    monkeypatch.setattr(variable_sync, "SEND_TO_AT_MOST", send_to_at_most)
    shapes = [(4, SIZE), (SIZE,), (SIZE,), (SIZE,)]

    def make(rank):
        rng = np.random.default_rng(rank)
        floats = [tf.Variable(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]
        return elastic.State(variables=[*floats, tf.Variable(rng.integers(0, 9, 3))])

    states = [make(rank) for rank in range(3)]
    expected = [v.numpy() for v in states[0].variables()]
    cluster.on_rank(lambda rank: states[rank].sync())  # nobody holds a commit: all from rank 0
    for rank in (1, 2):
        assert cluster.got[rank][-6:-2] == [4 * SIZE, 2 * SIZE, SIZE, 3]  # then the values: length, pickle
        for got, want in zip(states[rank].variables(), expected, strict=True):
            np.testing.assert_array_equal(got.numpy(), want)


def test_after_a_rollback_the_sync_compares_only_the_variables_written_since(cluster, monkeypatch):
    """A restore pins the variables' buffers; TensorFlow copies a variable it writes while shared, so
    one still in its pinned buffer holds the snapshot and is not compared (50 MB: ~15 ms saved)."""
    from elasticdl_strategy.elastic import state as state_module

    compared = []
    real = state_module._same_bits
    monkeypatch.setattr(
        state_module, "_same_bits", lambda value, array: compared.append(value.size) or real(value, array)
    )

    def make():  # the small variable in a dtype of its own: the SIZE one travels alone (receivers())
        return elastic.State(
            variables=[tf.Variable(np.full(SIZE, 1.0, np.float32)), tf.Variable([0.0], dtype=tf.float64)]
        )

    states = [make() for _ in range(3)]
    cluster.on_rank(lambda rank: states[rank].sync())  # keeps the snapshot to roll back to
    receivers(cluster)

    def train_roll_back_and_sync(rank, changed_rank=None):
        for variable in states[rank].variables():
            variable.assign_add(tf.ones_like(variable))  # a training step
        states[rank].restore(states[rank].commit_id)
        if rank == changed_rank:
            states[rank].variables()[1].assign([5.0])  # after the rollback: say, by a reset callback
        states[rank].sync()

    compared.clear()
    cluster.on_rank(train_roll_back_and_sync)
    assert compared == [] and receivers(cluster) == set()
    assert all((variable(s) == 1.0).all() and s.variables()[1].numpy()[0] == 0.0 for s in states)
    cluster.on_rank(lambda rank: train_roll_back_and_sync(rank, changed_rank=2))
    assert compared == [1]  # the variable written after the restore, on rank 2 alone
    assert receivers(cluster) == {2}
    assert all((variable(s) == 1.0).all() and s.variables()[1].numpy()[0] == 0.0 for s in states)
