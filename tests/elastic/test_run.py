"""elastic.run's recovery decisions, with a fake worker (no processes)."""

import types

import pytest
import tensorflow as tf

from elasticdl_strategy import elastic
from elasticdl_strategy.elastic.run import Action, _recover, _Reset, classify
from elasticdl_strategy.errors import (
    CollectiveMismatchError,
    ElasticDLError,
    JobFinished,
    MembershipChangedInterrupt,
    PeerFailureError,
    RendezvousTimeoutError,
    WorkerLeft,
)

pytestmark = pytest.mark.usefixtures("single_worker")


def fake_worker(rank, last_commit_id):
    return types.SimpleNamespace(
        worker_id="w",
        reform=lambda *args, **kwargs: 0.0,
        client=types.SimpleNamespace(last_commit=lambda: types.SimpleNamespace(commit_id=last_commit_id)),
        communicator=types.SimpleNamespace(rank=rank),
    )


FAILURE = _Reset("rank 1 failed", failed=True, started=0.0)


def test_a_survivor_rolls_back_to_the_recorded_commit():
    w = tf.Variable([1.0])
    state = elastic.State(variables=[w])
    state.commit()
    w.assign([9.0])
    _recover(fake_worker(rank=0, last_commit_id=1), state, FAILURE)
    assert w.numpy().tolist() == [1.0]


def test_a_new_rank_0_that_never_held_the_last_commit_refuses_to_go_on_without_a_checkpoint():
    state = elastic.State(variables=[tf.Variable([0.0])])  # joined after commit 5: no snapshot of it
    with pytest.raises(ElasticDLError, match="no remaining worker holds the state of commit #5"):
        _recover(fake_worker(rank=0, last_commit_id=5), state, FAILURE)


def test_a_new_rank_0_recovers_the_last_commit_from_the_checkpoint(tmp_path):
    w = tf.Variable([3.0])
    writer = elastic.State(variables=[w], checkpoint_dir=str(tmp_path), checkpoint_every=1)
    writer.commit()  # checkpoint of commit 1
    w.assign([0.0])
    joiner = elastic.State(variables=[w], checkpoint_dir=str(tmp_path))
    _recover(fake_worker(rank=0, last_commit_id=1), joiner, FAILURE)
    assert w.numpy().tolist() == [3.0] and joiner.commit_id == 1


def test_a_rank_without_the_snapshot_that_is_not_rank_0_waits_for_the_sync():
    w = tf.Variable([7.0])
    state = elastic.State(variables=[w])
    _recover(fake_worker(rank=1, last_commit_id=5), state, FAILURE)  # no error: rank 0's sync follows
    assert w.numpy().tolist() == [7.0] and state.commit_id == 0  # left as it was for the sync to overwrite


def classify_on(error, failure=None, client=True):
    worker = types.SimpleNamespace(
        client=object() if client else None, communicator=types.SimpleNamespace(failure=failure)
    )
    return classify(error, worker)


def wrapped(cause):
    """An error as TensorFlow raises it out of a tf.function: the collective's error is its cause."""
    try:
        raise RuntimeError("graph execution error") from cause
    except RuntimeError as e:
        return e


PEER_DIED = PeerFailureError("rank 1 died", peer_rank=1, rank=0)


@pytest.mark.parametrize(
    "error, failure, client, action",
    [
        (WorkerLeft("left the job gracefully at commit #3"), None, True, Action.LEAVE),
        (JobFinished("finished"), None, True, Action.LEAVE),
        (MembershipChangedInterrupt("b joins", membership_version=3), None, True, Action.SWITCH),
        (PEER_DIED, None, True, Action.RECOVER),
        (wrapped(PEER_DIED), None, True, Action.RECOVER),
        (ValueError("a wrapped failure lost its cause"), PEER_DIED, True, Action.RECOVER),
        (CollectiveMismatchError("different ops", ranks=[1]), None, True, Action.RAISE),
        (wrapped(CollectiveMismatchError("different ops", ranks=[1])), PEER_DIED, True, Action.RAISE),
        (ValueError("x"), CollectiveMismatchError("different ops", ranks=[1]), True, Action.RAISE),
        (RendezvousTimeoutError("too few workers"), None, True, Action.RAISE),
        (ValueError("a bug in the training function"), None, True, Action.RAISE),
        (PEER_DIED, None, False, Action.RAISE),  # a single worker has nobody to re-form with
    ],
)
def test_classify_decides_what_run_does_about_each_error(error, failure, client, action):
    decision = classify_on(error, failure, client)
    assert decision.action is action
    if action is Action.RECOVER:
        assert decision.failure is PEER_DIED and decision.reason == "rank 1 died"
    if action is Action.LEAVE and isinstance(error, WorkerLeft):
        assert decision.reason == "left the job gracefully at commit #3"
