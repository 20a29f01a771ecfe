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
- numpy/pandas inputs with ``shuffle=True``: the same order of rows on every
  worker, new every epoch (Keras' unseeded shuffle drew one per worker).
- numpy/pandas inputs: each worker gathers only its rows of every batch
  (Keras gathers the whole global batch on every worker, and the strategy
  then kept 1/N of it).
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
- Callbacks that write files (``TensorBoard``, ``CSVLogger``, ``BackupAndRestore``):
  rank 0 writes; see :func:`_callbacks_write_on_rank_0`.
- ``Model.save`` / ``save_weights`` (and so ``ModelCheckpoint``): written by
  rank 0 only, unless the strategy was made with ``save_on_all_ranks=True``;
  the other workers return without writing.

- Loss scale for distribution: Keras multiplies each worker's loss by
  1/replicas computed in float32 (1/3 off by 3e-8 in a float64 model);
  under an AllReduceStrategy the factor is computed in the loss's dtype.
- Loss scaling (``LossScaleOptimizer``, mixed precision): gradients are
  all-reduced before the finiteness check, so every worker applies or skips
  the step alike (Keras 3 judges each worker's own gradients).
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
from typing import Any, Callable, Dict, List, Tuple

from elasticdl_strategy.strategy.thread_flag import ThreadFlag

logger = logging.getLogger(__name__)

# Keras minor versions this adaptation is tested with.
SUPPORTED_KERAS_MINOR_VERSIONS = ("3.15",)

_installed: Dict[str, bool] = {}


def install(strategy_class: type) -> Dict[str, bool]:
    """Installs every adaptation once; returns which are active, by name.

    Each adaptation is installed on its own: one whose Keras internals are
    missing or changed (a Keras version not tested) is left out with a
    warning naming what is lost, and the others still apply. The check that
    gradients reach the ring falls back to a conservative form on the public
    ``Optimizer.apply`` when the private method it wraps is gone.
    """
    if _installed:
        return dict(_installed)
    import keras

    minor = ".".join(keras.__version__.split(".")[:2])
    if minor not in SUPPORTED_KERAS_MINOR_VERSIONS:
        logger.warning(
            "Keras %s is not one elasticdl_strategy is tested with (%s): adaptations whose Keras internals "
            "are missing are left out (each is named below if so)",
            keras.__version__,
            ", ".join(SUPPORTED_KERAS_MINOR_VERSIONS),
        )
    for name, adapt, lost in _ADAPTATIONS:
        try:
            adapt(strategy_class)
            _installed[name] = True
        except (AttributeError, ImportError, TypeError) as e:
            _installed[name] = False
            logger.warning("Keras %s: %s is not adapted (%s): %s", keras.__version__, name, e, lost)
    if not _installed["gradient check"]:
        _install_conservative_gradient_check(strategy_class)
    return dict(_installed)


def _require(owner, name: str):
    """``owner.name``, or AttributeError naming what is missing (a changed Keras)."""
    value = getattr(owner, name, None)
    if value is None:
        raise AttributeError(f"{getattr(owner, '__name__', owner)}.{name} not found")
    return value


def _adapt_per_replica_reduction(strategy_class: type) -> None:
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    original = _require(trainer, "reduce_per_replica")

    def reduce_per_replica(values, strategy, reduction):
        if isinstance(strategy, strategy_class) and strategy.num_replicas_in_sync > 1:
            if reduction == "concat":
                return tree.map_structure(lambda value: strategy.gather(value, axis=0), values)
            if reduction in ("auto", "mean"):
                # Per-step logs: one fused all-reduce of every value, averaged over the workers.
                return strategy.reduce("MEAN", values, axis=None)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica


def _adapt_saving(strategy_class: type) -> None:
    import keras

    for name in ("save", "save_weights"):
        setattr(keras.Model, name, _written_once(_require(keras.Model, name), strategy_class))


def _adapt_gradient_check(strategy_class: type) -> None:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    reduce = _require(TFOptimizer, "_all_reduce_sum_gradients")
    TFOptimizer._all_reduce_sum_gradients = _checked_gradient_reduction(reduce, strategy_class)


def _install_conservative_gradient_check(strategy_class: type) -> None:
    """The gradient check on the public ``Optimizer.apply`` (a Keras whose private reduction moved)."""
    import keras

    apply = keras.optimizers.Optimizer.apply
    check = _checked_gradient_reduction(lambda optimizer, grads_and_vars: None, strategy_class)

    @functools.wraps(apply)
    def wrapper(optimizer, grads, trainable_variables=None):
        check(optimizer, [])
        return apply(optimizer, grads, trainable_variables)

    keras.optimizers.Optimizer.apply = wrapper


def _adapt_loss_scale(strategy_class: type) -> None:
    from keras.src.losses import loss as loss_module

    scale = _require(loss_module, "scale_loss_for_distribution")
    loss_module.scale_loss_for_distribution = _exact_loss_scale(scale, strategy_class)


def _adapt_loss_scaling(strategy_class: type) -> None:
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    for name in ("check_finite", "_stateful_handle_finite_grads", "_stateful_handle_non_finite_grads"):
        _require(LossScaleOptimizer, name)
    LossScaleOptimizer._tf_apply = _loss_scaling_on_reduced_gradients(
        _require(LossScaleOptimizer, "_tf_apply"), strategy_class
    )


def _adapt_numpy_shuffle(strategy_class: type) -> None:
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    ArrayDataAdapter.get_tf_dataset = _shuffled_alike_on_every_worker(_require(ArrayDataAdapter, "get_tf_dataset"))


def _adapt_numpy_rows(strategy_class: type) -> None:
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    ArrayDataAdapter.get_tf_dataset = _only_this_workers_rows(_require(ArrayDataAdapter, "get_tf_dataset"))


def _adapt_local_build(strategy_class: type) -> None:
    from keras.src.backend.tensorflow import trainer

    build = _require(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    trainer.TensorFlowTrainer._maybe_symbolic_build = _build_from_local_batch(build, strategy_class)


def _adapt_epoch_length(strategy_class: type) -> None:
    from keras.src.trainers.epoch_iterator import EpochIterator

    catch = _require(EpochIterator, "catch_stop_iteration")
    EpochIterator.catch_stop_iteration = _epochs_of_any_length(catch, strategy_class)


def _checked_gradient_reduction(reduce_gradients, strategy_class: type):
    """Wraps the Keras optimizer's gradient all-reduce with a check that it reaches the ring."""
    import tensorflow as tf

    from elasticdl_strategy import runtime
    from elasticdl_strategy.errors import UsageError

    @functools.wraps(reduce_gradients)
    def wrapper(optimizer, grads_and_vars):
        if _gradients_reduced.is_set:
            return list(grads_and_vars)
        if runtime.is_initialized() and runtime.size() > 1:
            if not isinstance(optimizer._distribution_strategy, strategy_class):
                raise UsageError(
                    f"the optimizer {optimizer.name} was created outside AllReduceStrategy.scope(): its gradients "
                    "would not be reduced across the workers. Create the model and optimizer (and compile) "
                    "under strategy.scope()"
                )
            if not isinstance(tf.distribute.get_strategy(), strategy_class) or not tf.distribute.get_replica_context():
                raise UsageError(
                    "apply_gradients ran outside strategy.run (or the model was built outside "
                    "AllReduceStrategy.scope()): gradients would not be reduced across the workers. "
                    "Call it inside strategy.run(step_fn, ...), and build the model under strategy.scope()"
                )
        return reduce_gradients(optimizer, grads_and_vars)

    return wrapper


def _exact_loss_scale(scale_loss_for_distribution, strategy_class: type):
    """Scales a loss by 1/replicas in the loss's dtype: Keras makes the factor a float32 tensor
    first, so a float64 model on 3 workers trained with gradients 3e-8 too large."""
    import tensorflow as tf

    @functools.wraps(scale_loss_for_distribution)
    def wrapper(value):
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, strategy_class) and strategy.num_replicas_in_sync > 1:
            return value * tf.constant(1.0 / strategy.num_replicas_in_sync, dtype=value.dtype)
        return scale_loss_for_distribution(value)

    return wrapper


def _shuffled_alike_on_every_worker(get_tf_dataset):
    """numpy/pandas inputs to ``fit(shuffle=True)``: one order of the rows per epoch, the same on every worker.

    Keras shuffles them with an unseeded ``tf.random.shuffle`` (of the row
    indices per epoch, or within each batch for ``shuffle="batch"``): every
    worker drew its own order, and of each global batch it kept its share of
    its own order, so some rows trained twice an epoch and others never. In a
    job of several workers the shuffles of the dataset built here are
    stateless shuffles seeded by rank 0's random seed (broadcast once, when
    ``fit`` builds its dataset), the number of the epoch's iterator and the
    batch's place in it: a new order every epoch, as in one process, identical
    on every worker however far each prefetched, so each row is used once per
    epoch. The user seeds nothing.
    """
    import numpy as np
    import tensorflow as tf

    from elasticdl_strategy import runtime
    from elasticdl_strategy.strategy.tf_compat import resource_variable_ops

    @functools.wraps(get_tf_dataset)
    def wrapper(adapter):
        if not adapter._shuffle or not runtime.is_initialized() or runtime.size() == 1:
            return get_tf_dataset(adapter)
        mine = np.random.default_rng().integers(0, 2**62, size=1, dtype=np.int64)
        seed = tf.constant(int(runtime.communicator().broadcast(mine, root=0)[0]), tf.int64)
        batch_size = tf.constant(adapter._batch_size, tf.int64)
        with tf.init_scope(), tf.device("/cpu:0"):
            epochs = resource_variable_ops.ResourceVariable(0, dtype=tf.int64, trainable=False)

        def shuffle(value, *_ignored, **_ignored_too):
            # Keras shuffles once per iterator (all the rows, or every batch of rows in order). A
            # counter of shuffles would depend on how far each worker's discarded iterators (a peek
            # at the first batch) had prefetched: the key is the iterator's number, counted at its
            # first batch, and the batch's place in the epoch.
            place = tf.reduce_min(value) // batch_size if adapter._shuffle == "batch" else tf.constant(0, tf.int64)
            epoch = tf.cond(tf.equal(place, 0), lambda: epochs.assign_add(1), epochs.read_value)
            return tf.random.experimental.stateless_shuffle(value, seed=tf.stack([seed + epoch, place]))

        unseeded, tf.random.shuffle = tf.random.shuffle, shuffle
        try:  # Keras traces its dataset functions here, reading tf.random.shuffle as it does
            return get_tf_dataset(adapter)
        finally:
            tf.random.shuffle = unseeded

    return wrapper


def _only_this_workers_rows(get_tf_dataset):
    """numpy/pandas inputs: each worker gathers its rows of every global batch, and only those.

    Keras builds a dataset of row-index batches (``batch_size`` indices each)
    and zips it with the arrays, so that one ``tf.gather`` per batch takes the
    rows. In a job of several workers the index batches it zips are this
    worker's share of each (``np.array_split``, as the strategy splits any
    global batch), so a worker gathers and converts 1/N of the rows instead of
    all of them; the dataset is then distributed as it is (``mark_per_worker``).
    """
    import tensorflow as tf

    from elasticdl_strategy import runtime
    from elasticdl_strategy.strategy import input_sharding

    zip_ = vars(tf.data.Dataset)["zip"]  # the staticmethod, to put back as it was

    @functools.wraps(get_tf_dataset)
    def wrapper(adapter):
        if not runtime.is_initialized() or runtime.size() == 1:
            return get_tf_dataset(adapter)
        rank, size, zipped = runtime.rank(), runtime.size(), []

        def zip_my_rows(datasets, *args, **kwargs):
            if isinstance(datasets, tuple) and len(datasets) == 2 and not zipped:
                zipped.append(datasets)
                datasets = (input_sharding.split_global_batches(datasets[0], rank, size), datasets[1])
            return zip_.__func__(datasets, *args, **kwargs)

        tf.data.Dataset.zip = staticmethod(zip_my_rows)
        try:  # Keras zips its index batches with the arrays here, through tf.data.Dataset.zip
            dataset = get_tf_dataset(adapter)
        finally:
            tf.data.Dataset.zip = zip_
        # Without that zip (another Keras) the strategy takes this worker's rows of each batch.
        return input_sharding.mark_per_worker(dataset) if zipped else dataset

    return wrapper


def _other_rank(callback, strategy_class: type) -> bool:
    """Whether ``callback`` runs on a worker other than rank 0 of an AllReduceStrategy job."""
    strategy = getattr(getattr(callback, "model", None), "_distribute_strategy", None)
    if not isinstance(strategy, strategy_class):
        return False
    ours: Any = strategy
    return ours.num_replicas_in_sync > 1 and not ours.extended.should_checkpoint


def _callbacks_write_on_rank_0(strategy_class: type) -> None:
    """Keras callbacks that write files write them once, on rank 0.

    - ``TensorBoard`` and ``CSVLogger``: the other workers' hooks do nothing
      (every worker would write the same, global, logs: TensorBoard showed every
      point twice, and CSVLogger wrote every row once per worker).
    - ``BackupAndRestore``: rank 0 writes the backup and deletes it at the end;
      the others do neither (one of them deleted it while rank 0 still wrote).
      When ``fit`` starts, rank 0 restores the backup and broadcasts the
      weights, the optimizer's state and the epoch to resume at, so the others
      need not see its directory.
    - ``ModelCheckpoint`` writes through ``Model.save``/``save_weights``, which
      rank 0 alone does already.
    """
    import keras

    def on_rank_0(hook):
        @functools.wraps(hook)
        def wrapper(callback, *args, **kwargs):
            if _other_rank(callback, strategy_class):
                return None
            return hook(callback, *args, **kwargs)

        return wrapper

    def model_set_on_rank_0(set_model):  # TensorBoard's writes the model's summary
        @functools.wraps(set_model)
        def wrapper(callback, model):
            keras.callbacks.Callback.set_model(callback, model)
            if _other_rank(callback, strategy_class):
                return None
            return set_model(callback, model)

        return wrapper

    for cls in (keras.callbacks.TensorBoard, keras.callbacks.CSVLogger):
        for name in [n for n in vars(cls) if n.startswith("on_")]:
            setattr(cls, name, on_rank_0(getattr(cls, name)))
        if "set_model" in vars(cls):
            cls.set_model = model_set_on_rank_0(cls.set_model)
    backup = keras.callbacks.BackupAndRestore
    backup._save_model = on_rank_0(backup._save_model)
    backup.on_train_end = on_rank_0(backup.on_train_end)
    backup.on_train_begin = _restored_on_rank_0(on_rank_0(backup.on_train_begin), strategy_class)


def _restored_on_rank_0(on_train_begin, strategy_class: type):
    import numpy as np

    @functools.wraps(on_train_begin)
    def wrapper(callback, logs=None):
        on_train_begin(callback, logs)  # rank 0 reads the backup
        model = callback.model
        strategy = model._distribute_strategy
        if not isinstance(strategy, strategy_class) or strategy.num_replicas_in_sync == 1:
            return
        from elasticdl_strategy import runtime

        epoch = np.array([model._initial_epoch or 0], np.int64)
        model._initial_epoch = int(runtime.communicator().broadcast(epoch, root=0)[0])
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])
        strategy.broadcast_variables([getattr(v, "value", v) for v in variables])

    return wrapper


# Set while a LossScaleOptimizer applies gradients it has all-reduced itself.
_gradients_reduced = ThreadFlag()


def _loss_scaling_on_reduced_gradients(tf_apply, strategy_class: type):
    """Makes a LossScaleOptimizer's apply-or-skip decision global: judged on the reduced gradients.

    Keras 3 checks the finiteness of each worker's own gradients, then applies
    (and all-reduces) or skips: a worker whose gradients alone overflowed skipped
    the all-reduce the others were waiting in. Here the gradients are all-reduced
    first, every worker checks the same sums, and the inner optimizer applies
    them without reducing again, so all apply or all skip (and halve the scale).
    """
    import tensorflow as tf

    @functools.wraps(tf_apply)
    def wrapper(optimizer, grads, trainable_variables=None):
        strategy = tf.distribute.get_strategy()
        context = tf.distribute.get_replica_context()
        if not isinstance(strategy, strategy_class) or strategy.num_replicas_in_sync == 1 or context is None:
            return tf_apply(optimizer, grads, trainable_variables)
        variables = trainable_variables or optimizer._trainable_variables
        reduce = [
            i
            for i, (g, v) in enumerate(zip(grads, variables, strict=True))
            if g is not None and not optimizer._overwrite_variable_with_gradient(v)
        ]
        grads = list(grads)
        for i, reduced in zip(reduce, context.all_reduce("SUM", [grads[i] for i in reduce]), strict=True):
            grads[i] = reduced
        with _gradients_reduced():
            tf.cond(
                optimizer.check_finite(grads),
                lambda: optimizer._stateful_handle_finite_grads(grads, trainable_variables),
                optimizer._stateful_handle_non_finite_grads,
            )

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


# (name, install, what a Keras that lacks its internals loses)
_ADAPTATIONS: List[Tuple[str, Callable[[type], None], str]] = [
    (
        "predict and per-step logs",
        _adapt_per_replica_reduction,
        "predict returns this worker's rows only and per-step logs are this worker's",
    ),
    ("saving on rank 0", _adapt_saving, "Model.save and save_weights write on every worker"),
    ("gradient check", _adapt_gradient_check, "a conservative check on Optimizer.apply is used instead"),
    ("loss scale", _adapt_loss_scale, "losses are scaled by 1/workers in float32"),
    (
        "loss scaling",
        _adapt_loss_scaling,
        "LossScaleOptimizer judges each worker's own gradients (an overflow on one worker desynchronizes)",
    ),
    ("numpy shuffle", _adapt_numpy_shuffle, "fit(x, y, shuffle=True) on numpy arrays repeats and skips rows"),
    ("numpy rows", _adapt_numpy_rows, "every worker gathers every row of numpy inputs and keeps 1/N of them"),
    ("file callbacks", _callbacks_write_on_rank_0, "TensorBoard, CSVLogger and BackupAndRestore write on every worker"),
    ("local build", _adapt_local_build, "building from a first batch may mismatch when shares differ"),
    ("epoch length", _adapt_epoch_length, "later epochs stop at the first epoch's length"),
]
