"""The one place that adapts Keras internals to AllReduceStrategy, version-checked.

- ``predict``: Keras 3 gathers outputs across workers only for
  MultiWorkerMirroredStrategy (``keras/src/backend/tensorflow/trainer.py``:
  ``reduce_per_replica(..., reduction="concat")``); each worker would return
  just its own rows. Under an AllReduceStrategy of several workers "concat"
  becomes an all-gather along the batch axis: every worker's rows in rank
  order, which is the input order because each global batch is split into
  contiguous shares.
- Per-step logs of ``fit``/``evaluate`` (what the progress bar and batch
  callbacks see): averaged over the workers with one fused all-reduce per
  step (Keras does it for MultiWorkerMirroredStrategy only); each worker's
  running means cover equal shares of every batch, so their mean is the
  global value. Epoch logs come from the sync-on-read metric variables.
- Building before ``fit``/``evaluate``: Keras takes a first batch to build
  the model and metrics, and for a distributed dataset averages it over the
  replicas, a collective whose shapes differ when the workers' shares of a
  batch do (say 86/85/85 rows). Only shapes matter there, so under an
  AllReduceStrategy each worker builds from its own batch.
- Epoch length: for a dataset of unknown length Keras learns the number of
  steps from the first epoch and stops later epochs there. Under an
  AllReduceStrategy epochs legitimately differ in length (an elastic job
  resumes mid-epoch, or continues with a different number of workers), so
  every epoch runs until its dataset ends.
- ``Model.save`` / ``save_weights`` (and so ``ModelCheckpoint``): written by
  rank 0 only, unless the strategy was made with ``save_on_all_ranks=True``;
  the other workers return without writing.

- Gradient aggregation: in a job of several workers, the Keras optimizer's
  gradient all-reduce refuses to run outside an AllReduceStrategy replica
  context (a model, optimizer or train step outside ``strategy.scope()`` /
  ``strategy.run``), where Keras would silently skip it and each worker
  would train on its own data.

Other reductions, other strategies and models outside an AllReduceStrategy are left to Keras.
"""

from __future__ import annotations

import contextlib
import functools
import logging

logger = logging.getLogger(__name__)

# Keras minor versions this adaptation is tested with.
SUPPORTED_KERAS_MINOR_VERSIONS = ("3.15",)

_installed = False


def install(strategy_class: type) -> bool:
    """Installs the predict adaptation once; returns whether it is active."""
    global _installed
    if _installed:
        return True
    import keras
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    minor = ".".join(keras.__version__.split(".")[:2])
    original = getattr(trainer, "reduce_per_replica", None)
    if minor not in SUPPORTED_KERAS_MINOR_VERSIONS or original is None:
        logger.warning(
            "Keras %s is not one elasticdl_strategy is tested with (%s): model.predict under "
            "AllReduceStrategy returns only this worker's rows",
            keras.__version__,
            ", ".join(SUPPORTED_KERAS_MINOR_VERSIONS),
        )
        return False

    def reduce_per_replica(values, strategy, reduction):
        if isinstance(strategy, strategy_class) and strategy.num_replicas_in_sync > 1:
            if reduction == "concat":
                return tree.map_structure(lambda value: strategy.gather(value, axis=0), values)
            if reduction in ("auto", "mean"):
                # Per-step logs: one fused all-reduce of every value, averaged over the workers.
                return strategy.reduce("MEAN", values, axis=None)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica
    for name in ("save", "save_weights"):
        setattr(keras.Model, name, _written_once(getattr(keras.Model, name), strategy_class))
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    TFOptimizer._all_reduce_sum_gradients = _checked_gradient_reduction(
        TFOptimizer._all_reduce_sum_gradients, strategy_class
    )
    from keras.src.trainers.epoch_iterator import EpochIterator

    trainer.TensorFlowTrainer._maybe_symbolic_build = _build_from_local_batch(
        trainer.TensorFlowTrainer._maybe_symbolic_build, strategy_class
    )

    EpochIterator.catch_stop_iteration = _epochs_of_any_length(EpochIterator.catch_stop_iteration, strategy_class)
    _installed = True
    return True


def _checked_gradient_reduction(reduce_gradients, strategy_class: type):
    """Wraps the Keras optimizer's gradient all-reduce with a check that it reaches the ring."""
    import tensorflow as tf

    from elasticdl_strategy import collective
    from elasticdl_strategy.errors import ConfigError

    @functools.wraps(reduce_gradients)
    def wrapper(optimizer, grads_and_vars):
        if collective.is_initialized() and collective.size() > 1:
            if not isinstance(optimizer._distribution_strategy, strategy_class):
                raise ConfigError(
                    f"the optimizer {optimizer.name} was created outside AllReduceStrategy.scope(): its gradients "
                    "would not be reduced across the workers. Create the model and optimizer (and compile) "
                    "under strategy.scope()"
                )
            if not isinstance(tf.distribute.get_strategy(), strategy_class) or not tf.distribute.get_replica_context():
                raise ConfigError(
                    "apply_gradients ran outside strategy.run (or the model was built outside "
                    "AllReduceStrategy.scope()): gradients would not be reduced across the workers. "
                    "Call it inside strategy.run(step_fn, ...), and build the model under strategy.scope()"
                )
        return reduce_gradients(optimizer, grads_and_vars)

    return wrapper


def _build_from_local_batch(maybe_symbolic_build, strategy_class: type):
    """Builds from this worker's first batch instead of one averaged over the workers."""
    import tensorflow as tf
    from keras.src import tree

    @functools.wraps(maybe_symbolic_build)
    def wrapper(model, iterator=None, data_batch=None):
        strategy = model._distribute_strategy
        if iterator is None or not isinstance(strategy, strategy_class):
            return maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: x.values[0] if isinstance(x, tf.distribute.DistributedValues) else x, batch
            )
            break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    return wrapper


def _epochs_of_any_length(catch_stop_iteration, strategy_class: type):
    """Keeps Keras from fixing the epoch length after the first epoch of an AllReduceStrategy fit."""

    @contextlib.contextmanager
    def wrapper(iterator):
        strategy = getattr(iterator, "_distribute_strategy", None)
        ours = isinstance(strategy, strategy_class) and iterator.steps_per_epoch is None
        if ours:  # an epoch ending with its data is expected here, not worth a warning
            iterator._interrupted_warning = lambda: None
        with catch_stop_iteration(iterator):
            yield
        if ours:
            iterator._num_batches = iterator.data_adapter.num_batches  # None unless the length is known

    return wrapper


def _written_once(save, strategy_class: type):
    """Wraps a Model saving method so that only rank 0 of an AllReduceStrategy writes."""

    @functools.wraps(save)
    def wrapper(model, *args, **kwargs):
        strategy = getattr(model, "_distribute_strategy", None)
        if isinstance(strategy, strategy_class) and not strategy.writes_files:
            logger.debug("rank %d: %s skipped (rank 0 writes)", strategy.rank, save.__name__)
            return None
        return save(model, *args, **kwargs)

    return wrapper
