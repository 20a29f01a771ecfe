"""Keras callbacks that keep an elastic state in step with ``model.fit``."""

from __future__ import annotations

import keras

from elasticdl_strategy.errors import UsageError


class CommitStateCallback(keras.callbacks.Callback):
    """After every training batch: advances the state's records, counts the batch, and commits
    every ``batches_per_commit`` batches, or at once on every worker when one was asked to leave
    (with ``batches_per_commit > 1`` the workers vote on that after every batch, one all-reduce
    of one integer: see :meth:`State.leave_pending`).

    Keeps ``state.batch`` / ``state.epoch`` up to date when the state has such
    values (``KerasState(model, epoch=0, batch=0)``), so that ``fit`` inside
    ``elastic.run`` resumes at the right epoch: pass
    ``initial_epoch=records.epoch`` (or ``state.epoch``).

    Example::

        model.fit(dataset, epochs=5, initial_epoch=records.epoch,
                  callbacks=[elastic.CommitStateCallback(state, batches_per_commit=10)])
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise UsageError(f"batches_per_commit={batches_per_commit} must be at least 1")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._since_commit = 0

    def _values(self):
        return self.state.__dict__.get("_values", {})

    def on_train_begin(self, logs=None):
        steps = getattr(self.model, "steps_per_execution", 1) or 1
        if int(steps) != 1:
            raise UsageError(
                f"CommitStateCallback needs compile(steps_per_execution=1), not {int(steps)}: Keras calls batch "
                "callbacks once per execution, so the data position would fall behind the steps taken"
            )

    def on_train_batch_end(self, batch, logs=None):
        if self.state.records is not None:
            self.state.records.advance()
        if "batch" in self._values():
            self.state.batch += 1
        self._since_commit += 1
        if self._since_commit >= self.batches_per_commit or self.state.leave_pending():
            self._since_commit = 0
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        values = self._values()
        if "epoch" in values:
            self.state.epoch = epoch + 1
        if "batch" in values:
            self.state.batch = 0
        self._since_commit = 0
        self.state.commit()
