"""TensorFlow's checkpoint writers under AllReduceStrategy: one writer per job, the same answers everywhere.

Every worker holds the same variables, and TensorFlow's tutorials call the
writers on every worker. TensorFlow assumes one writer per path: two workers
saving into one directory write the same ``*_temp`` directory and fail in
``SaveV2`` or ``MergeV2Checkpoints``. (MultiWorkerMirroredStrategy leaves
that to its users: its guides have the other workers write into a temporary
directory of their own and delete it.) In a job of several workers, here:

- ``tf.train.Checkpoint.write`` / ``save`` and ``tf.train.CheckpointManager.save``
  (all three go through ``Checkpoint._write``): rank 0 writes. The other ranks
  write nothing, but run the write's bookkeeping — ``save_counter``, the
  returned path, the manager's list of checkpoints, ``latest_checkpoint`` and
  its ``max_to_keep`` sweep — with every file change left out (the
  ``checkpoint`` state file and the deletions are rank 0's), so every rank
  returns the same path and holds the same state.
- ``tf.saved_model.save`` (and so Keras' ``model.export``): rank 0 writes, the
  others return at once.
- A checkpoint's ``save_counter``, made the first time a checkpoint is saved,
  is created without the creation-time broadcast of variables, so a save that
  only rank 0 makes (guarded by ``strategy.extended.should_checkpoint``,
  inside ``strategy.scope()`` or not) starts no collective the others never
  join.

Nothing here is a collective: a save called on rank 0 alone is as right as one
called everywhere. Hence a worker that *reads* a checkpoint right after it was
saved must first know that rank 0 finished writing (e.g. ``runtime.barrier()``),
and reads by other ranks need a directory they share. Writes inside a
``tf.function`` are left to TensorFlow.
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from elasticdl_strategy import runtime
from elasticdl_strategy.strategy.creation_broadcast import no_broadcast_at_creation
from elasticdl_strategy.strategy.thread_flag import ThreadFlag

logger = logging.getLogger(__name__)

_installed = False
# Set while another rank runs a write's bookkeeping: the files are rank 0's.
_without_file_changes = ThreadFlag()


def _other_rank_of_a_job() -> bool:
    """True on a worker other than rank 0 of a job of several workers."""
    return runtime.is_initialized() and runtime.size() > 1 and runtime.rank() != 0


def install() -> None:
    """Adapts the writers (once per process; called by ``AllReduceStrategy()``)."""
    global _installed
    if _installed:
        return
    from tensorflow.python.checkpoint import checkpoint, checkpoint_management

    checkpoint.Checkpoint._write = _written_by_rank_0(checkpoint.Checkpoint._write)
    checkpoint.Checkpoint._maybe_create_save_counter = _created_without_broadcast(
        checkpoint.Checkpoint._maybe_create_save_counter
    )
    for name in ("update_checkpoint_state_internal", "_delete_file_if_exists"):
        setattr(checkpoint_management, name, _skipped_without_file_changes(getattr(checkpoint_management, name)))
    tf.saved_model.save = _saved_model_by_rank_0(tf.saved_model.save)
    _installed = True


def _written_by_rank_0(write):
    @functools.wraps(write)
    def wrapper(self, file_prefix, options=None):
        if tf.inside_function() or not _other_rank_of_a_job():
            return write(self, file_prefix, options=options)
        from tensorflow.python.checkpoint import checkpoint_options

        output = str(file_prefix)
        callbacks = (options or checkpoint_options.CheckpointOptions()).experimental_write_callbacks or []
        with _without_file_changes():
            for callback in callbacks:
                callback(output)
        logger.debug("checkpoint %s: written by rank 0", output)
        return output

    return wrapper


def _created_without_broadcast(create):
    @functools.wraps(create)
    def wrapper(self):
        with no_broadcast_at_creation():
            return create(self)

    return wrapper


def _skipped_without_file_changes(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if _without_file_changes.is_set:
            return None
        return function(*args, **kwargs)

    return wrapper


def _saved_model_by_rank_0(save):
    @functools.wraps(save)
    def wrapper(obj, export_dir, *args, **kwargs):
        if _other_rank_of_a_job():
            logger.debug("SavedModel %s: written by rank 0", export_dir)
            return None
        return save(obj, export_dir, *args, **kwargs)

    return wrapper
