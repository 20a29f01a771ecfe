"""Elastic state: what is committed, rolled back and synced when the membership changes.

A state holds variables (TensorFlow or Keras), plain Python values and, if
given, the :class:`~elasticdl_strategy.data.ElasticRecords` position.

* :meth:`State.commit` snapshots it in memory and records the commit with the
  coordinator, atomically across the workers: the members agree on it by a
  collective vote (the same commit id and data position), then rank 0 records
  it for all (:mod:`~elasticdl_strategy.elastic.agreement`).
* :meth:`State.restore` rolls back to the last commit the job recorded.
* :meth:`State.sync` copies rank 0's state (the oldest member) to everyone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from elasticdl_strategy import runtime
from elasticdl_strategy.data.records import ElasticRecords, Position
from elasticdl_strategy.elastic import agreement, variable_sync
from elasticdl_strategy.elastic.checkpoint import CheckpointStore
from elasticdl_strategy.elastic.snapshot import Snapshot
from elasticdl_strategy.errors import (
    CollectiveMismatchError,
    CommitAbortedError,
    MembershipChangedInterrupt,
    UsageError,
    WorkerLeft,
)
from elasticdl_strategy.strategy import variable_agreement
from elasticdl_strategy.transport.protos import coordinator_pb2

logger = logging.getLogger(__name__)

# Snapshots kept: the last commit's and the one before it (a commit whose outcome is unknown needs both).
KEPT_SNAPSHOTS = 2


class State:
    """Variables and Python values that survive membership changes.

    Python values are attributes: ``State(epoch=0)`` gives ``state.epoch``,
    committed, restored and synced with the variables.

    Example::

        state = elastic.State(variables=[w, b], records=records, epoch=0)

        @elastic.run
        def train(state):
            for indices in records.dataset():
                strategy.run(step, (indices,))
                records.advance()
                if records.batch % 10 == 0:
                    state.commit()

    Args:
        variables: ``tf.Variable``/``keras.Variable`` objects, in the same order on every worker.
        records: the data position to commit with the state.
        checkpoint_dir: where rank 0 writes durable checkpoints (every
            ``checkpoint_every`` commits); a job started again after all
            workers died resumes from the newest one.
        checkpoint_every: commits between checkpoints.
        **values: picklable Python values.
    """

    def __init__(
        self,
        variables: Sequence = (),
        records: Optional[ElasticRecords] = None,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 10,
        **values: Any,
    ):
        if checkpoint_every < 1:
            raise UsageError(f"checkpoint_every={checkpoint_every} must be at least 1")
        reserved = {"commit_id", "records", "variables"} & set(values)
        if reserved:
            raise UsageError(f"state value names {sorted(reserved)} are reserved")
        object.__setattr__(self, "_values", dict(values))
        self._variables = list(variables)
        self.records = records
        self.commit_id = 0
        self._snapshots: Dict[int, Snapshot] = {}
        # (commit id, views of the variables' buffers) taken while the variables held that commit's
        # snapshot: after a restore, or at a commit the membership changes at; until the next sync
        # or commit. TensorFlow copies a variable that it writes while its buffer is shared, so a
        # variable still in its pinned buffer still holds the snapshot: the sync need not compare it.
        self._pinned: Optional[Tuple[int, List[np.ndarray]]] = None
        self._reset_callbacks: List[Callable[[], None]] = []
        self._checkpoints = CheckpointStore(checkpoint_dir) if checkpoint_dir else None
        self._checkpoint_every = checkpoint_every
        self.leave_requested = False

    # Python values as attributes --------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_values", {}):
            self._values[name] = value
        else:
            object.__setattr__(self, name, value)

    # What the state holds (subclasses add to it) ----------------------------------------------

    def variables(self) -> List:
        """The variables committed, restored and synced, in a fixed order."""
        return list(self._variables)

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Functions that every member calls before training in a membership: when ``elastic.run``
        starts and after every re-formation, newcomers included, after the rollback and before the
        state is synced from rank 0 (so what they set in the state ends as rank 0's everywhere).

        Example: keep the learning rate proportional to the global batch::

            state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(0.01 * runtime.size())])
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Calls the reset callbacks (``elastic.run`` does, on every member alike)."""
        for callback in self._reset_callbacks:
            callback()

    def leave_pending(self) -> bool:
        """Whether any member was asked to leave (SIGTERM) and waits for a commit to do it.

        A vote of all members (an all-reduce of one integer): call it on every
        member at the same point of the loop, say after every step; all get the
        same answer. Committing when it is true lets the leavers go at that
        commit, within a step of the signal, and the others re-form without
        them, nothing rolled back::

            if step % 10 == 0 or state.leave_pending():
                state.commit()

        Without it a leaver leaves at the next commit the loop makes anyway.
        """
        communicator = runtime.communicator()
        if communicator.size == 1:
            return self.leave_requested
        votes = communicator.allreduce(np.array([int(self.leave_requested)], np.int64), op="sum")
        return bool(votes[0])

    # Snapshots --------------------------------------------------------------------------------

    def _snapshot(self, arrays: Optional[List[np.ndarray]] = None) -> Snapshot:
        """The state now, of commit ``commit_id``; ``arrays``: the variables' values, when held
        already (else copied, into the arrays of a snapshot that keeping this one drops, where they
        fit: memory in use takes a copy in about half the time new arrays' pages do)."""
        position = self.records.position if self.records is not None else Position()
        if arrays is None:
            arrays = _copied([_value_of(v) for v in self.variables()], self._dropped_by_keeping(self.commit_id))
        return Snapshot(arrays, copy.deepcopy(self._values), position, self.commit_id)

    def _kept_after_keeping(self, commit_id: int) -> List[int]:
        """The commit ids kept once a snapshot of ``commit_id`` is kept: the newest :data:`KEPT_SNAPSHOTS`."""
        return sorted({*self._snapshots, commit_id})[-KEPT_SNAPSHOTS:]

    def _dropped_by_keeping(self, commit_id: int) -> List[Snapshot]:
        """The kept snapshots that keeping one of ``commit_id`` drops (:meth:`_keep`): one of that
        id, which it replaces, and those no longer among the newest."""
        kept = self._kept_after_keeping(commit_id)
        return [snapshot for i, snapshot in self._snapshots.items() if i == commit_id or i not in kept]

    def _apply(self, snapshot: Snapshot) -> None:
        for variable, array in zip(self.variables(), snapshot.arrays, strict=True):
            variable.assign(array)
        object.__setattr__(self, "_values", copy.deepcopy(snapshot.values))
        if self.records is not None:
            self.records.position = snapshot.position
        self.commit_id = snapshot.commit_id
        self._pin()

    def _pin(self) -> None:
        """Pins the variables' buffers (``_pinned``): they hold the snapshot of ``commit_id`` now."""
        self._pinned = (self.commit_id, [_value_of(v) for v in self.variables()])

    def _holds(self, snapshot: Snapshot, values: List[np.ndarray]) -> bool:
        """Whether the variables (``values``: their values now) hold ``snapshot`` bit for bit: those
        still in the buffer pinned with it need no comparison."""
        views: List[Optional[np.ndarray]] = [None] * len(values)
        if self._pinned is not None and self._pinned[0] == snapshot.commit_id and len(self._pinned[1]) == len(values):
            views = list(self._pinned[1])
        return all(
            _same_buffer(value, was) or _same_bits(value, array)
            for value, was, array in zip(values, views, snapshot.arrays, strict=True)
        )

    def _keep(self, snapshot: Snapshot) -> None:
        """Keeps ``snapshot`` and the one before it (:data:`KEPT_SNAPSHOTS`)."""
        kept = self._kept_after_keeping(snapshot.commit_id)
        self._snapshots[snapshot.commit_id] = snapshot
        for old in [i for i in self._snapshots if i not in kept]:
            del self._snapshots[old]

    # commit / restore / sync ------------------------------------------------------------------

    def commit(self) -> None:
        """Snapshots the state and records the commit (a barrier of all members: :mod:`.agreement`).

        Raises:
            CommitAbortedError: the membership changed before every member
                committed; ``elastic.run`` rolls back to the previous commit.
            MembershipChangedInterrupt: the commit was recorded and workers join
                or leave here; ``elastic.run`` re-forms without rolling back.
        """
        worker = runtime.current_worker()
        self._pinned = None
        self.commit_id += 1
        snapshot = self._snapshot()
        self._keep(snapshot)
        version = worker.membership.version
        # Read once: a SIGTERM that arrives while this commit waits for the others must not make
        # this worker leave at a commit the coordinator recorded without its leaving (the others
        # would carry on with it in the membership); it leaves at the next commit instead.
        leaving = self.leave_requested
        if leaving:
            worker.request_leave()
        if worker.client is None:  # a single worker: nobody to agree with
            response = coordinator_pb2.CommitResponse(recorded=True, membership_version=version)
        else:
            response = agreement.commit_for_all(worker, self.commit_id, snapshot.position, leaving)
        if not response.recorded:
            raise CommitAbortedError(
                f"worker {worker.worker_id}: commit #{self.commit_id} not recorded: {response.reason}",
                membership_version=response.membership_version,
                rank=worker.communicator.rank,
            )
        worker.record_commit(
            coordinator_pb2.CommitRecord(
                commit_id=self.commit_id, membership_version=version, position=snapshot.position.to_proto()
            )
        )
        if self._checkpoints is not None and worker.communicator.rank == 0:
            if self.commit_id % self._checkpoint_every == 0:
                self._checkpoints.save(self.variables(), snapshot)
        if leaving:
            raise WorkerLeft(f"left the job gracefully at commit #{self.commit_id}")
        if response.membership_version != version:
            self._pin()  # the variables hold this commit until the sync after the re-formation
            raise MembershipChangedInterrupt(
                f"membership changes at commit #{self.commit_id}: {response.reason}",
                membership_version=response.membership_version,
            )

    def has_snapshot(self, commit_id: int) -> bool:
        """Whether this worker holds the state of commit ``commit_id``."""
        return commit_id in self._snapshots

    def restore(self, commit_id: int) -> None:
        """Rolls back to commit ``commit_id`` (the job's last recorded one).

        A worker without that snapshot (it joined later) keeps its state: the
        sync that follows gives it rank 0's.
        """
        snapshot = self._snapshots.get(commit_id)
        if snapshot is None:
            logger.info("no snapshot of commit #%d here; the sync from rank 0 provides the state", commit_id)
            return
        self._apply(snapshot)

    def load_checkpoint(self) -> bool:
        """Loads the newest durable checkpoint, if any; returns whether one was loaded."""
        if self._checkpoints is None:
            return False
        self._prepare_sync()
        snapshot = self._checkpoints.load(self.variables())
        if snapshot is None:
            return False
        self._apply(snapshot)
        self._keep(snapshot)
        logger.info(
            "resumed from checkpoint of commit #%d at %s",
            snapshot.commit_id,
            snapshot.position,
        )
        return True

    def sync(self) -> None:
        """Makes every worker's state rank 0's (variables, values, position, commit id).

        The variables are sent only where some member may hold others: when every member
        still holds, bit for bit, the snapshot of one same commit (survivors rolled back to
        the last commit, or members re-forming at the commit they just made, whose reset
        callbacks changed no variable), they already are rank 0's: commits keep every
        member's state identical. A newcomer, or a callback that changed a variable on
        any member, makes every variable come from rank 0.

        Raises:
            CollectiveMismatchError: the workers hold different variables (names, shapes or dtypes).
            CommunicationError: a peer failed during the sync (``elastic.run`` retries).
        """
        self._prepare_sync()
        communicator = runtime.communicator()
        variables = self.variables()
        kept: Optional[Snapshot] = None
        received: Optional[List[np.ndarray]] = None
        if communicator.size > 1:
            self._check_same_variables(communicator, variables)
            kept, received = self._sync_variables(communicator, variables)
            position = self.records.position if self.records is not None else Position()
            payload = pickle.dumps((self._values, position, self.commit_id))
            length = communicator.broadcast(np.array([len(payload)], np.int64), root=0)
            buffer = np.frombuffer(payload, np.uint8) if communicator.rank == 0 else np.zeros(int(length[0]), np.uint8)
            values, position, commit_id = pickle.loads(communicator.broadcast(buffer, root=0).tobytes())
            object.__setattr__(self, "_values", values)
            if self.records is not None:
                self.records.position = position
            self.commit_id = commit_id
        self._pinned = None
        self._snapshots.clear()
        # The variables hold the kept or received arrays' values: they are the snapshot, without a copy.
        self._keep(self._snapshot(kept.arrays if kept is not None else received))

    def _sync_variables(self, communicator, variables) -> Tuple[Optional[Snapshot], Optional[List[np.ndarray]]]:
        """Gives every member rank 0's variables, sending them only to members whose variables do
        not hold rank 0's commit already (:mod:`.variable_sync`). Returns the kept snapshot this
        worker's variables hold (``None`` if they hold none), and the values it received
        (``None`` if it received none)."""
        values = [_value_of(v) for v in variables]
        kept = self._snapshots.get(self.commit_id)
        if kept is not None and not self._holds(kept, values):
            kept = None
        transfer = variable_sync.plan(
            variable_sync.held_commits(communicator, self.commit_id if kept is not None else variable_sync.NO_COMMIT)
        )
        received = variable_sync.send(communicator, values, transfer)
        if received is None:
            return kept, None
        for variable, value in zip(variables, received, strict=True):
            variable.assign(value)
        return None, received

    def _prepare_sync(self) -> None:
        """Hook: create what must exist before syncing (e.g. optimizer slots)."""

    @staticmethod
    def _check_same_variables(communicator, variables) -> None:
        differing = variable_agreement.ranks_that_differ(communicator, variable_agreement.describe(variables))
        if differing:
            raise CollectiveMismatchError(
                f"rank {communicator.rank}: ranks {differing} hold different state variables than rank 0 "
                f"({len(variables)} here); every worker must build the same model and state",
                ranks=differing,
                rank=communicator.rank,
            )


class KerasState(State):
    """The state of a Keras model: weights, optimizer slots and step counters, plus Python values.

    Example::

        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="mse")
        records = data.ElasticRecords(num_records=len(x), batch_size=32)
        state = elastic.KerasState(model, records=records, checkpoint_dir="/ckpt")

        @elastic.run
        def train(state):
            dataset = records.dataset().map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
            model.fit(dataset, epochs=5, initial_epoch=records.epoch, callbacks=state.callbacks(batches_per_commit=10))

        train(state)

    After a re-formation the model's traced train/test/predict functions are
    dropped, so that Keras traces them again for the new number of workers.
    """

    def __init__(self, model, optimizer=None, records: Optional[ElasticRecords] = None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(records=records, **kwargs)

    def variables(self) -> List:
        variables = list(self.model.weights)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        return variables

    def _prepare_sync(self) -> None:
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        """Creates the optimizer's slots if Keras has not yet (a newcomer that has not trained)."""
        if self.optimizer is not None and not self.optimizer.built:
            from elasticdl_strategy.strategy.creation_broadcast import no_broadcast_at_creation

            strategy = getattr(self.model, "_distribute_strategy", None)
            with no_broadcast_at_creation(), strategy.scope() if strategy is not None else contextlib.nullcontext():
                self.optimizer.build(self.model.trainable_variables)

    def on_reset(self) -> None:
        self._build_optimizer()  # callbacks may set slots or hyperparameters
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        super().on_reset()

    def callbacks(self, batches_per_commit: int = 1) -> List:
        """The Keras callbacks that keep this state: advance the records, commit every ``batches_per_commit``."""
        from elasticdl_strategy.elastic.callbacks import CommitStateCallback

        return [CommitStateCallback(self, batches_per_commit)]


def _copied(values: List[np.ndarray], dropped: Sequence[Snapshot]) -> List[np.ndarray]:
    """Copies of ``values``: into the arrays of the first ``dropped`` snapshot whose arrays fit
    them (shapes, dtypes, writable), else new ones."""
    for snapshot in dropped:
        arrays = snapshot.arrays
        if len(arrays) == len(values) and all(_fits(a, v) for a, v in zip(arrays, values)):
            for array, value in zip(arrays, values):
                np.copyto(array, value)
            return arrays
    return [np.array(v, copy=True) for v in values]


def _fits(array: np.ndarray, value: np.ndarray) -> bool:
    return array.shape == value.shape and array.dtype == value.dtype and array.flags.writeable


def _value_of(variable) -> np.ndarray:
    """The variable's value now, without a copy where TensorFlow allows (a later write to the
    variable copies first: the array keeps this value)."""
    import tensorflow as tf

    return np.asarray(tf.convert_to_tensor(variable))


def _same_buffer(value: np.ndarray, was: Optional[np.ndarray]) -> bool:
    """Whether ``value`` views the memory ``was`` viewed (same start, shape and dtype)."""
    return (
        was is not None
        and value.shape == was.shape
        and value.dtype == was.dtype
        and value.__array_interface__["data"][0] == was.__array_interface__["data"][0]
    )


def _same_bits(value: np.ndarray, array: np.ndarray) -> bool:
    """Whether ``value`` holds exactly ``array``'s bytes (``-0.0`` is not ``0.0``, a NaN equals itself)."""
    value, array = np.ascontiguousarray(value), np.ascontiguousarray(array)
    if value.dtype != array.dtype or value.shape != array.shape:
        return False
    word = np.uint64 if value.nbytes % 8 == 0 else np.uint8  # 8 bytes per comparison where they divide
    return bool(np.array_equal(value.reshape(-1).view(word), array.reshape(-1).view(word)))
