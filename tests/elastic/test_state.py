"""Elastic state on a single worker: commit/restore/values, checkpoints written atomically."""

import os

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy import elastic, runtime
from elasticdl_strategy.data import ElasticRecords, Position
from elasticdl_strategy.elastic.checkpoint import CheckpointStore
from elasticdl_strategy.errors import UsageError, WorkerLeft
from elasticdl_strategy.transport.protos import coordinator_pb2

pytestmark = pytest.mark.usefixtures("single_worker")


def test_restore_rolls_variables_values_and_position_back_to_a_commit():
    w = tf.Variable([1.0, 2.0])
    records = ElasticRecords(num_records=10, batch_size=2)
    state = elastic.State(variables=[w], records=records, epoch=0)
    state.epoch = 1
    records.advance()
    state.commit()
    committed = state.commit_id
    w.assign([5.0, 6.0])
    state.epoch = 9
    records.advance()
    state.restore(committed)
    assert w.numpy().tolist() == [1.0, 2.0]
    assert state.epoch == 1
    assert records.position == Position(epoch=0, batch=1, cursor=2)


def test_a_commit_copies_into_the_memory_of_the_snapshot_it_drops_and_every_kept_one_restores():
    w = tf.Variable(np.zeros(1000, np.float32))
    state = elastic.State(variables=[w])
    arrays = {}
    for value in (1.0, 2.0, 3.0, 4.0):
        w.assign(np.full(1000, value, np.float32))
        state.commit()
        arrays[state.commit_id] = state._snapshots[state.commit_id].arrays[0]
    assert sorted(state._snapshots) == [3, 4]
    assert arrays[3] is arrays[1] and arrays[4] is arrays[2]  # no new memory after the first two
    for commit_id, value in ((3, 3.0), (4, 4.0), (3, 3.0)):
        w.assign(np.full(1000, -1.0, np.float32))
        state.restore(commit_id)
        assert (w.numpy() == value).all()
    state.commit_id = 3  # rolled back to #3: the next commit, #4 again, takes the memory of the one it replaces
    state.commit()
    assert state._snapshots[4].arrays[0] is arrays[4] and sorted(state._snapshots) == [3, 4]
    state.restore(3)
    assert (w.numpy() == 3.0).all()


def test_a_read_only_snapshot_array_is_not_written_a_new_one_is_made():
    w = tf.Variable(np.zeros(8, np.float32))
    state = elastic.State(variables=[w])
    state.commit()
    state.commit()
    read_only = state._snapshots[1].arrays[0]
    read_only.flags.writeable = False  # as a view of received bytes can be
    w.assign(np.ones(8, np.float32))
    state.commit()  # drops #1, whose array it cannot write
    assert state._snapshots[3].arrays[0] is not read_only and (state._snapshots[3].arrays[0] == 1.0).all()
    state.restore(2)
    assert (w.numpy() == 0.0).all()


def test_a_sync_on_a_single_worker_keeps_its_state_as_the_commit_to_roll_back_to():
    w = tf.Variable([1.0, 2.0])
    state = elastic.State(variables=[w], epoch=3)
    state.sync()
    w.assign([5.0, 6.0])
    state.epoch = 4
    state.restore(state.commit_id)
    assert w.numpy().tolist() == [1.0, 2.0] and state.epoch == 3


def test_reserved_value_names_and_bad_intervals_are_refused():
    with pytest.raises(UsageError, match="reserved"):
        elastic.State(commit_id=3)
    with pytest.raises(UsageError, match="checkpoint_every=0"):
        elastic.State(checkpoint_every=0)


def test_checkpoints_round_trip_and_a_crash_mid_write_leaves_the_previous_one(tmp_path):
    w = tf.Variable(np.arange(4, dtype=np.float32))
    records = ElasticRecords(num_records=10, batch_size=2)
    state = elastic.State(variables=[w], records=records, checkpoint_dir=str(tmp_path), checkpoint_every=1, step=3)
    records.advance()
    state.commit()  # checkpoint of commit 1
    # A writer that died half-way leaves a temporary directory: ignored on load.
    os.makedirs(tmp_path / ".tmp-commit-00000002-999")
    w.assign(np.zeros(4, np.float32))
    state.step = 100
    assert state.load_checkpoint()
    assert w.numpy().tolist() == [0.0, 1.0, 2.0, 3.0] and state.step == 3 and state.commit_id == 1
    assert records.position.cursor == 2


def test_only_the_newest_checkpoints_are_kept_and_latest_points_to_a_complete_one(tmp_path):
    w = tf.Variable([0.0])
    state = elastic.State(variables=[w], checkpoint_dir=str(tmp_path), checkpoint_every=1)
    for _ in range(4):
        w.assign_add([1.0])
        state.commit()
    store = CheckpointStore(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("commit-*")) == ["commit-00000003", "commit-00000004"]
    assert store.latest().endswith("commit-00000004")


def test_every_checkpoint_file_and_directory_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    w = tf.Variable(np.arange(4, dtype=np.float32))
    state = elastic.State(variables=[w], checkpoint_dir=str(tmp_path), checkpoint_every=1)
    monkeypatch.setattr(os, "fsync", fsync)
    state.commit()
    checkpoint = tmp_path / "commit-00000001"
    written = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert written and len(written) >= 3  # TensorFlow's index and data files, and our metadata
    # Synced under the temporary name, before the rename that makes them visible.
    synced_names = {os.path.relpath(p, tmp_path).split(os.sep, 1)[-1] for p in synced if ".tmp-" in p}
    assert {str(p.relative_to(checkpoint)) for p in written} <= synced_names
    assert str(tmp_path) in synced  # the directory holding the renamed checkpoint and "latest"


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    state = elastic.State(variables=[tf.Variable([1.0, 2.0])], checkpoint_dir=str(tmp_path), checkpoint_every=1)
    state.commit()
    other = elastic.State(variables=[tf.Variable([1.0, 2.0, 3.0])], checkpoint_dir=str(tmp_path))
    with pytest.raises(UsageError, match="belongs to another model"):
        other.load_checkpoint()


def test_a_sigterm_while_a_commit_waits_makes_the_worker_leave_at_the_next_commit():
    # The coordinator records a commit as the worker sent it: one sent as staying must not end
    # in the worker leaving (the others would carry on with it in their membership).
    state = elastic.State(step=0)
    worker = runtime.current_worker()
    sent = []

    class Client:
        def commit(self, version, commit_id, position, leaving_workers, timeout, on_unavailable):
            sent.append(list(leaving_workers))
            state.leave_requested = True  # SIGTERM arrives while the commit is being recorded
            return coordinator_pb2.CommitResponse(recorded=True, membership_version=version)

    assert worker.client is None  # a single worker: give it a coordinator for this test only
    worker._client = Client()
    try:
        state.commit()  # recorded with this worker staying: it stays
        with pytest.raises(WorkerLeft):
            state.commit()  # sent as leaving: it leaves here
    finally:
        worker._client = None
    assert sent == [[], [worker.worker_id]]
