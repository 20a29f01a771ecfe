"""``AllReduceStrategy``: a ``tf.distribute.Strategy`` whose replicas are worker processes.

Each worker process is one replica (its rank is the replica id); gradients and
other cross-replica reductions go through the gRPC ring of
:mod:`elasticdl_strategy.collective`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Iterable, Optional

import numpy as np
import tensorflow as tf

from elasticdl_strategy import runtime
from elasticdl_strategy.errors import CollectiveMismatchError, ConfigError, UsageError
from elasticdl_strategy.strategy import (
    bridge,
    checkpoints,
    creation_broadcast,
    devices,
    input_sharding,
    keras_compat,
    variable_agreement,
)
from elasticdl_strategy.strategy.tf_compat import (
    device_util,
    distribute_lib,
    distribute_utils,
    distribute_values,
    exclude_from_autograph,
    input_lib,
    input_util,
    nest,
    ops,
    reduce_util,
)

logger = logging.getLogger(__name__)

# What a traced step calls of this library (runtime.size(), the bridge, ...) is plain Python to it:
# AutoGraph converting it took ~0.16 s of a process's first trace (a joining worker's first step).
exclude_from_autograph(__name__.partition(".")[0])


class AllReduceStrategy(distribute_lib.Strategy):
    """Synchronous data parallelism over worker processes, reduced by a gRPC ring all-reduce.

    Start N copies of the script with ``elasticdl-strategy run --workers N -- python train.py``;
    every copy is one replica. Model code is unchanged::

        import tensorflow as tf, keras
        from elasticdl_strategy import AllReduceStrategy

        strategy = AllReduceStrategy()           # joins the job (runtime.init())
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        # A dataset of *global* batches: each worker trains on its 1/N of every batch.
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
        model.fit(dataset, epochs=2)

    ``num_replicas_in_sync`` is the number of workers, so Keras scales losses
    for the global batch; variables created under ``scope()`` start with rank
    0's values on every worker.

    Constructing it joins the job (:func:`~elasticdl_strategy.runtime.init`). A
    worker joining a job that is already training returns once registered and
    is admitted at the members' next commit while it builds its model; what
    needs the membership (``num_replicas_in_sync``, collectives, the elastic
    sync) waits for the admission. (Where the host's workers outnumber its
    cores it returns once admitted: its building would slow the members.)

    Each replica runs on one GPU when TensorFlow sees one, else on the CPU
    (``strategy.extended.worker_devices`` names it; the rule is in
    ``strategy/devices.py``). Configure TensorFlow's GPUs (memory growth, ...)
    before creating the strategy: it initializes TensorFlow.

    Args:
        timeout: deadline in seconds of each cross-worker reduction (default ``EDL_TIMEOUT``).
        sparse_as_dense: reduce sparse gradients (``tf.IndexedSlices``, e.g. of
            embeddings) as dense tensors in the fused all-reduce, instead of
            all-gathering their rows. Dense is faster when most rows are touched.
        save_on_all_ranks: let every worker write files in ``Model.save`` /
            ``save_weights`` / ``ModelCheckpoint``. By default only rank 0
            writes (all ranks hold the same weights) and the others skip.
        log_all_ranks: let every worker print Keras progress bars and messages.
            By default only rank 0 does: the others call
            ``keras.config.disable_interactive_logging()``, which sends Keras'
            messages to the (quiet by default) absl log instead of stdout.
        bucket_bytes: most bytes fused into one ring all-reduce (default 64 MiB,
            a positive int). Gradients are grouped by dtype into buckets of at
            most this size, last layers first, and a larger tensor gets a bucket
            of its own; in a ``tf.function`` each bucket is reduced as soon as its
            gradients exist, while backprop computes the earlier layers'.
            Smaller buckets start sooner but each costs a ring round trip.
        compression: ``"fp16"`` or ``"bf16"`` to send float32/float64 tensors
            all-reduced in replica context (gradients) as 16-bit values on the
            wire; the additions stay in the tensors' dtype. Integer and 16-bit
            tensors, and ``strategy.reduce`` (losses, metrics), are never
            compressed. Default ``None``: full precision.
    """

    def __init__(
        self,
        timeout: Optional[float] = None,
        sparse_as_dense: bool = False,
        save_on_all_ranks: bool = False,
        log_all_ranks: bool = False,
        bucket_bytes: int = bridge.DEFAULT_BUCKET_BYTES,
        compression: Optional[str] = None,
    ):
        if timeout is not None and not timeout > 0:
            raise ConfigError(
                f"AllReduceStrategy(timeout={timeout!r}): the timeout must be a positive number of seconds"
            )
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes <= 0:
            raise ConfigError(
                f"AllReduceStrategy(bucket_bytes={bucket_bytes!r}): the bucket size must be a positive integer "
                "number of bytes"
            )
        if compression is not None and not (isinstance(compression, str) and compression in bridge.COMPRESSIONS):
            raise ConfigError(f"AllReduceStrategy(compression={compression!r}): expected None, 'fp16' or 'bf16'")
        # A worker joining a running job is admitted at the members' next commit: it builds its
        # model meanwhile (what needs the membership waits for it).
        runtime.init(admit_in_background=True)
        super().__init__(_AllReduceExtended(self, timeout, sparse_as_dense, int(bucket_bytes), compression))
        distribute_lib.distribution_strategy_gauge.get_cell("V2").set("AllReduceStrategy")
        # A joiner is admitted after the members already training: never rank 0 then.
        if (runtime.joined_running_job() or runtime.rank() != 0) and not log_all_ranks:
            import keras

            keras.config.disable_interactive_logging()
        keras_compat.install(AllReduceStrategy)
        checkpoints.install()
        self._save_on_all_ranks = save_on_all_ranks

    @property
    def rank(self) -> int:
        """This worker's rank, which is also its replica id."""
        return runtime.rank()

    @property
    def writes_files(self) -> bool:
        """Whether this worker writes in ``Model.save``/``save_weights``/``ModelCheckpoint``."""
        return self._save_on_all_ranks or runtime.rank() == 0

    _warned_run_v2 = False

    def experimental_run_v2(self, fn, args=(), kwargs=None, options=None):
        """TensorFlow 2.0 and 2.1's name for :meth:`run`; warns once that it is deprecated.

        Example (the step of TensorFlow 2.0's distributed training guide)::

            per_replica_losses = strategy.experimental_run_v2(step_fn, args=(dist_inputs,))
        """
        if not AllReduceStrategy._warned_run_v2:
            AllReduceStrategy._warned_run_v2 = True
            warnings.warn(
                "experimental_run_v2 is TensorFlow 2.0's name for run (renamed in TensorFlow 2.2): call strategy.run",
                DeprecationWarning,
                stacklevel=2,
            )
        return self.run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_make_numpy_dataset(self, numpy_input, session=None) -> tf.data.Dataset:
        """A dataset of ``numpy_input``'s rows (TF 1.x API, as MultiWorkerMirroredStrategy has it); eager only.

        Example::

            dataset = strategy.experimental_make_numpy_dataset((x, y)).batch(64)
            for batch in strategy.experimental_distribute_dataset(dataset): ...
        """
        return self.extended.experimental_make_numpy_dataset(numpy_input, session=session)

    def broadcast_variables(self, variables: Iterable[tf.Variable], root: int = 0) -> None:
        """Assigns ``root``'s values of ``variables`` on every worker (same order everywhere)."""
        for variable in variables:
            _broadcast_variable(variable, root)


def _broadcast_variable(variable: tf.Variable, root: int) -> None:
    """Checks that every worker creates the same variable here, then copies root's value.

    A variable created while a ``tf.function`` is traced (e.g. optimizer slots
    built at the first step of a custom loop) gets its initial value from the
    function's graph, after this runs: it is checked but not copied. Such
    initializers are deterministic (zeros) in Keras; for others, call
    ``strategy.broadcast_variables`` after the first step.
    """
    if not creation_broadcast.enabled():  # first: a joiner still waiting to be admitted need not wait here
        return
    communicator = runtime.communicator()
    if communicator.size == 1:
        return
    created_in_function = tf.inside_function()
    with tf.init_scope():
        differing = variable_agreement.ranks_that_differ(communicator, variable_agreement.describe([variable]), root)
        if differing:
            raise CollectiveMismatchError(
                f"rank {communicator.rank}: ranks {differing} created a different variable than rank {root} "
                f"at this point (here: {variable.name}, shape {variable.shape}, {variable.dtype.name}); "
                "every worker must create the same variables in the same order",
                ranks=differing,
                rank=communicator.rank,
            )
        if not created_in_function:
            variable.assign(communicator.broadcast(variable.numpy(), root=root))


def _single_device_input_options(options: Optional[distribute_lib.InputOptions]) -> distribute_lib.InputOptions:
    """Input options that make TensorFlow iterate a worker's dataset with a plain iterator.

    TensorFlow's default (``PER_WORKER``, or fetching to devices) wraps every dataset in a
    ``MultiDeviceIterator``, whose background prefetch thread can touch the iterator after
    it was freed when the iterator is dropped right after its end (TensorFlow 2.21: a
    segmentation fault in ``MultiDeviceBuffer::BackgroundThread``, seen with Keras'
    cached validation iterator, ``fit(..., validation_split=...)``). A worker has one
    device, so that iterator only adds a thread; ``PER_REPLICA`` without fetching to the
    device iterates the dataset itself. The user's other options are kept.
    """
    options = options or distribute_lib.InputOptions()
    return distribute_lib.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=distribute_lib.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=options.experimental_place_dataset_on_device,
        experimental_per_replica_buffer_size=options.experimental_per_replica_buffer_size,
    )


def _as_reduce_op(reduce_op) -> reduce_util.ReduceOp:
    if isinstance(reduce_op, str):
        return reduce_util.ReduceOp(reduce_op.upper())
    if isinstance(reduce_op, tf.VariableAggregation):
        return reduce_util.ReduceOp.from_variable_aggregation(reduce_op)
    return reduce_op


def _local(value):
    """This worker's tensor of a (possibly per-replica) value."""
    if isinstance(value, distribute_values.DistributedValues):
        return value.values[0]
    return value


class _AllReduceExtended(distribute_lib.StrategyExtendedV1):
    """One replica per worker process, on its GPU or its CPU (``strategy/devices.py``).

    Variables and replica compute are placed on ``self._device``; datasets are read on
    that device's host CPU (``self._input_device``), and the ring reduces host copies
    whose results ``bridge`` places back on ``self._device``.
    """

    def __init__(
        self,
        container_strategy: AllReduceStrategy,
        timeout: Optional[float],
        sparse_as_dense: bool,
        bucket_bytes: int = bridge.DEFAULT_BUCKET_BYTES,
        compression: Optional[str] = None,
    ):
        super().__init__(container_strategy)
        self._timeout = timeout
        self._sparse_as_dense = sparse_as_dense
        self._bucket_bytes = bucket_bytes
        self._compression = compression
        self._device = devices.replica_device()
        self._input_device = device_util.get_host_for_device(self._device)

    # Rank and size follow the current membership: they change when an elastic job re-forms.
    @property
    def _rank(self) -> int:
        return runtime.rank()

    @property
    def _size(self) -> int:
        return runtime.size()

    # ---- placement and variables ----------------------------------------------------------

    def _input_workers_with_options(self, options=None):
        return input_lib.InputWorkers([(self._input_device, (self._device,))])

    @property
    def _input_workers(self):
        return self._input_workers_with_options()

    def _create_variable(self, next_creator, **kwargs):
        if not tf.executing_eagerly() and not tf.inside_function():
            raise UsageError(
                "AllReduceStrategy does not create variables in TF 1.x graph mode (tf.compat.v1 graphs and "
                "Sessions): create them eagerly (TF 2's default) or in a tf.function, under strategy.scope()"
            )
        kwargs.pop("colocate_with", None)
        with ops.device(self._device):
            variable = next_creator(**kwargs)
        if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
            # Per-worker accumulators (Keras metrics): read in cross-replica context they
            # are reduced over all workers, so epoch logs and evaluate() are global.
            aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
            return distribute_values.SyncOnReadVariable(self._container_strategy(), [variable], aggregation)
        _broadcast_variable(variable, root=0)
        return variable

    def _validate_colocate_with_variable(self, colocate_with_variable):
        distribute_utils.validate_colocate(colocate_with_variable, self)

    # ---- input ----------------------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        """This worker's part of a dataset every worker builds alike: see :mod:`.input_sharding`."""
        options = _single_device_input_options(options)
        workers, strategy = self._input_workers_with_options(options), self._container_strategy()
        plan = input_sharding.plan(dataset, self._size)
        if self._rank == 0 and plan.sharding is not input_sharding.Sharding.AS_IS:
            logger.info("input split over %d workers: %s", self._size, plan.reason)
        if plan.sharding is input_sharding.Sharding.TENSORFLOW:
            assert plan.policy is not None
            context = distribute_lib.InputContext(
                num_input_pipelines=self._size, input_pipeline_id=self._rank, num_replicas_in_sync=self._size
            )
            # Workers may run out of their files at different steps: those that have no batch
            # left feed empty ones until every worker is done (one int64 reduction per step).
            self.experimental_enable_get_next_as_optional = True
            try:
                return input_util.get_distributed_dataset(
                    input_sharding.with_policy(dataset, plan.policy),
                    workers,
                    strategy,
                    num_replicas_in_sync=self._size,
                    input_context=context,
                    options=options,
                )
            finally:
                self.experimental_enable_get_next_as_optional = False
        if plan.sharding is input_sharding.Sharding.ROWS:
            dataset = input_sharding.rows_of_global_batches(dataset, self._rank, self._size)
        return input_util.get_distributed_dataset(dataset, workers, strategy, options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        options = _single_device_input_options(options)
        context = distribute_lib.InputContext(
            num_input_pipelines=self._size, input_pipeline_id=self._rank, num_replicas_in_sync=self._size
        )
        return input_util.get_distributed_datasets_from_function(
            dataset_fn,
            self._input_workers_with_options(options),
            [context],
            self._container_strategy(),
            options=options,
        )

    # TF 1.x input APIs: the numpy dataset eagerly, as MultiWorkerMirroredStrategy makes it;
    # the graph-mode iterators only name their TF 2 replacements.

    def _experimental_make_numpy_dataset(self, numpy_input, session):
        if session is not None or not tf.executing_eagerly():
            raise UsageError(
                "experimental_make_numpy_dataset with a Session (TF 1.x graph mode) is not supported by "
                "AllReduceStrategy: call it eagerly, or use tf.data.Dataset.from_tensor_slices"
            )
        return tf.data.Dataset.from_tensor_slices(numpy_input)

    def _make_dataset_iterator(self, dataset):
        raise UsageError(
            "make_dataset_iterator is TF 1.x's graph-mode API, not supported by AllReduceStrategy: "
            "iterate iter(strategy.experimental_distribute_dataset(dataset)) instead"
        )

    def _make_input_fn_iterator(self, input_fn, replication_mode=None):
        raise UsageError(
            "make_input_fn_iterator is TF 1.x's graph-mode API, not supported by AllReduceStrategy: "
            "use iter(strategy.distribute_datasets_from_function(dataset_fn)); dataset_fn gets the same "
            "tf.distribute.InputContext"
        )

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(
            distribute_lib.ValueContext(replica_id_in_sync_group=self._rank, num_replicas_in_sync=self._size)
        )

    # ---- running and reducing -------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        args, kwargs = nest.map_structure(_local, (args, kwargs))
        with ops.device(self._device), _AllReduceReplicaContext(self._container_strategy(), self._rank):
            return fn(*args, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        # strategy.reduce and reads of sync-on-read variables (losses, metrics): never compressed.
        flat = nest.flatten(value)
        reduced = self._reduce_values(reduce_op, [_local(v) for v in flat], compression=None)
        return nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        # ReplicaContext.all_reduce (the Keras optimizers' gradient reduction) comes here.
        values = [_local(value) for value, _ in value_destination_pairs]
        return self._reduce_values(reduce_op, values, compression=self._compression)

    def _reduce_values(self, reduce_op, values, compression: Optional[str]):
        op = "mean" if _as_reduce_op(reduce_op) == reduce_util.ReduceOp.MEAN else "sum"
        if self._size == 1:
            return [v if isinstance(v, tf.IndexedSlices) else tf.identity(v) for v in values]
        sparse = [i for i, v in enumerate(values) if isinstance(v, tf.IndexedSlices) and not self._sparse_as_dense]
        dense = [i for i in range(len(values)) if i not in set(sparse)]
        results = [None] * len(values)
        reduced = bridge.all_reduce_tensors(
            [tf.convert_to_tensor(values[i]) for i in dense],
            op,
            self._timeout,
            self._bucket_bytes,
            compression,
            device=self._device,
        )
        for i, tensor in zip(dense, reduced, strict=True):
            results[i] = tensor
        for i in sparse:
            results[i] = bridge.all_reduce_indexed_slices(values[i], op, self._timeout, device=self._device)
        return results

    def _gather_to_implementation(self, value, destinations, axis, options):
        if self._size == 1:
            return _local(value)
        return bridge.all_gather_tensor(_local(value), axis, self._timeout, device=self._device)

    def _update(self, var, fn, args, kwargs, group):
        return self._update_non_slot(var, fn, (var,) + tuple(args), kwargs, group)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        with ops.device(self._device), distribute_lib.UpdateContext(self._device):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def read_var(self, replica_local_var):
        return tf.identity(replica_local_var)

    def _local_results(self, value):
        return (_local(value),)

    def value_container(self, value):
        return value

    # ---- properties tf.distribute and Keras ask for ---------------------------------------

    def _in_multi_worker_mode(self):
        return self._size > 1

    @property
    def _num_replicas_in_sync(self):
        return self._size

    @property
    def worker_devices(self):
        return (self._device,)

    @property
    def parameter_devices(self):
        return (self._device,)

    def non_slot_devices(self, var_list):
        return (self._device,)

    @property
    def experimental_should_init(self):
        return True

    @property
    def experimental_between_graph(self):
        return True

    @property
    def should_checkpoint(self):
        return self._rank == 0

    @property
    def should_save_summary(self):
        return self._rank == 0

    @property
    def _global_batch_size(self):
        return True

    @property
    def _support_per_replica_values(self):
        return False

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return 0


class _AllReduceReplicaContext(distribute_lib.ReplicaContext):
    """The replica context of this worker: replica id = rank."""

    def __init__(self, strategy: AllReduceStrategy, rank: int):
        distribute_lib.ReplicaContext.__init__(self, strategy, replica_id_in_sync_group=rank)

    @property
    def devices(self):
        return self._strategy.extended.worker_devices
