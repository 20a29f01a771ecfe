"""Worker of tests/strategy/test_api.py: the tf.distribute calls users make, eagerly and in tf.function.

Writes ``{results_dir}/rank{r}.json`` with what each call returned.
"""

import os
import sys
import warnings

import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report


def _graph_mode_variable(strategy):
    with tf.Graph().as_default(), strategy.scope():
        tf.Variable(1.0)


def main(results_dir: str) -> None:
    strategy = AllReduceStrategy()
    rank, n = runtime.rank(), runtime.size()
    out = {"rank": rank, "size": n}

    def replica_values():
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        return tf.fill([2], r + 1.0)  # [r+1, r+1]

    for label, run in [
        ("eager", lambda f: strategy.run(f)),
        ("graph", lambda f: tf.function(lambda: strategy.run(f))()),
    ]:
        per_replica = run(replica_values)
        out[f"{label}_sum"] = strategy.reduce("SUM", per_replica, axis=None).numpy().tolist()
        out[f"{label}_mean"] = strategy.reduce("MEAN", per_replica, axis=None).numpy().tolist()
        out[f"{label}_sum_axis0"] = float(strategy.reduce("SUM", per_replica, axis=0).numpy())
        out[f"{label}_mean_axis0"] = float(strategy.reduce("MEAN", per_replica, axis=0).numpy())

        def in_replica():
            ctx = tf.distribute.get_replica_context()
            r = tf.cast(ctx.replica_id_in_sync_group, tf.float64)
            total = ctx.all_reduce("sum", [tf.ones([3], tf.float64) * (r + 1), tf.fill([2], tf.cast(r, tf.int32))])
            rows = ctx.all_gather(tf.reshape(tf.range(rank + 1, dtype=tf.int64), [rank + 1, 1]) + 10 * rank, axis=0)
            merged = ctx.merge_call(lambda strategy, x: strategy.reduce("SUM", x, axis=None), args=(r,))
            return total[0], total[1], rows, merged

        t_float, t_int, rows, merged = run(in_replica)
        out[f"{label}_all_reduce"] = [t_float.numpy().tolist(), t_int.numpy().tolist()]
        out[f"{label}_all_gather"] = rows.numpy().ravel().tolist()
        out[f"{label}_merge_call"] = float(merged.numpy())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = strategy.experimental_run_v2(replica_values)  # TF 2.0's name, as its guides wrote it
        strategy.experimental_run_v2(replica_values)
    out["run_v2_sum"] = strategy.reduce("SUM", first, axis=None).numpy().tolist()
    out["run_v2_warnings"] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]

    out["gather"] = strategy.gather(strategy.run(lambda: tf.fill([rank + 1], rank)), axis=0).numpy().tolist()
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group * 10)
    out["values_from_function"] = int(strategy.experimental_local_results(values)[0])

    def dataset_fn(ctx):
        out["input_context"] = [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]
        return tf.data.Dataset.range(8).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)

    local = lambda batch: strategy.experimental_local_results(batch)[0].numpy().tolist()  # noqa: E731
    out["from_function"] = [local(b) for b in strategy.distribute_datasets_from_function(dataset_fn)]
    global_batches = tf.data.Dataset.range(10).batch(5)  # 5 rows per batch: split 3/2 between 2 workers
    out["distributed"] = [local(b) for b in strategy.experimental_distribute_dataset(global_batches)]
    # Every input is iterated with a plain tf.data iterator, whatever options ask for (TensorFlow's
    # MultiDeviceIterator can crash when dropped right after its end).
    per_worker = tf.distribute.InputOptions(experimental_fetch_to_device=True)
    out["iterator_kinds"] = [
        type(iter(dataset)._iterators[0]._iterator).__name__
        for dataset in [
            strategy.experimental_distribute_dataset(global_batches),
            strategy.experimental_distribute_dataset(global_batches, per_worker),
            strategy.distribute_datasets_from_function(dataset_fn),
            strategy.distribute_datasets_from_function(dataset_fn, per_worker),
        ]
    ]
    out["distributed_with_options"] = [
        local(b) for b in strategy.experimental_distribute_dataset(global_batches, per_worker)
    ]
    # TF 1.x entry points: the numpy dataset works; the graph-mode ones name their TF 2 replacement.
    numpy_dataset = strategy.experimental_make_numpy_dataset(np.arange(10, dtype=np.int64)).batch(5)
    out["numpy_dataset"] = [local(b) for b in strategy.experimental_distribute_dataset(numpy_dataset)]
    tf1 = {}
    for name, call in [
        ("make_dataset_iterator", lambda: strategy.make_dataset_iterator(numpy_dataset)),
        ("make_input_fn_iterator", lambda: strategy.make_input_fn_iterator(lambda ctx: numpy_dataset)),
        ("graph_variable", lambda: _graph_mode_variable(strategy)),
    ]:
        try:
            call()
            tf1[name] = None
        except Exception as e:  # the type and the message are what the test checks
            tf1[name] = [type(e).__name__, str(e)]
    out["tf1"] = tf1

    with strategy.scope():
        v = tf.Variable(np.full(3, float(rank)))  # rank 0's value wins at creation
    out["variable_at_creation"] = v.numpy().tolist()
    v.assign(np.full(3, float(rank + 5)))
    strategy.broadcast_variables([v], root=n - 1)
    out["variable_after_broadcast"] = v.numpy().tolist()

    # tf.train.Checkpoint: written once (the worker that should_checkpoint), restored everywhere.
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(tf.data.Dataset.from_tensors((tf.ones([4, 3]), tf.zeros([4, 2]))), epochs=2, verbose=0)
    # Model.save / ModelCheckpoint: only rank 0 writes (paths differ per rank to tell who wrote).
    model.save(os.path.join(results_dir, f"saved_by_rank{rank}.keras"))
    callback = keras.callbacks.ModelCheckpoint(
        os.path.join(results_dir, f"ckpt_by_rank{rank}.weights.h5"), save_weights_only=True
    )
    model.fit(
        tf.data.Dataset.from_tensors((tf.ones([4, 3]), tf.zeros([4, 2]))), epochs=1, verbose=0, callbacks=[callback]
    )
    out["wrote"] = sorted(f for f in os.listdir(results_dir) if f"by_rank{rank}." in f)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = os.path.join(results_dir, "ckpt")
    out["should_checkpoint"] = strategy.extended.should_checkpoint
    if strategy.extended.should_checkpoint:
        checkpoint.write(path)
    runtime.barrier()
    saved = [w.numpy().tolist() for w in model.weights]
    for w in model.weights:
        w.assign(tf.zeros_like(w))
    checkpoint.read(path).assert_existing_objects_matched()
    out["restored_equal"] = [w.numpy().tolist() for w in model.weights] == saved
    out["optimizer_iterations"] = int(model.optimizer.iterations.numpy())
    out["writes_files"] = strategy.writes_files

    write_report(results_dir, rank, out)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
