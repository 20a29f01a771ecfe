"""Worker of tests/strategy/test_checkpoints.py: TensorFlow's checkpoint writers called the way
TensorFlow's guides call them, from every worker (and once from rank 0 alone).

Usage: strategy_checkpoints.py RESULTS_DIR CHECKPOINT_DIR
Writes ``{results_dir}/rank{r}.json`` with what each writer returned and what was restored.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report


def weights(model):
    return [w.numpy().ravel().tolist() for w in model.weights]


def main(results_dir: str, directory: str) -> None:
    strategy = AllReduceStrategy()
    keras.utils.set_random_seed(5 + runtime.rank())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(0.01)
        model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(0).standard_normal((32, 4))
    model.fit(x, x[:, :3], batch_size=8, epochs=1, verbose=0, shuffle=False)
    out = {"rank": runtime.rank()}

    # tf.train.Checkpoint.save and .write, from every worker, several times at the same moment.
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    out["saved"] = [checkpoint.save(os.path.join(directory, "plain", "ckpt")) for _ in range(4)]
    out["save_counter"] = int(checkpoint.save_counter.numpy())
    out["written"] = checkpoint.write(os.path.join(directory, "written", "state"))
    # CheckpointManager with max_to_keep.
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(directory, "managed"), max_to_keep=2)
    out["managed"] = [manager.save() for _ in range(4)]
    out["manager_checkpoints"] = list(manager.checkpoints)
    out["manager_latest"] = manager.latest_checkpoint
    out["at_save"] = weights(model)
    out["iterations_at_save"] = int(optimizer.iterations.numpy())
    # SavedModel and Keras export, from every worker.
    tf.saved_model.save(model, os.path.join(directory, "saved_model"))
    model.export(os.path.join(directory, "exported"), verbose=False)
    # A save that only rank 0 makes, inside strategy.scope(): its checkpoint's save_counter is
    # created there on rank 0 alone. Then a collective: the workers are still in step.
    with strategy.scope():
        if strategy.extended.should_checkpoint:
            out["guarded"] = tf.train.Checkpoint(model=model).save(os.path.join(directory, "guarded", "ckpt"))
    model.fit(x, x[:, :3], batch_size=8, epochs=1, verbose=0, shuffle=False)
    out["trained"] = weights(model)

    runtime.barrier()  # rank 0 has written everything: every rank may read
    out["tf_latest"] = tf.train.latest_checkpoint(os.path.join(directory, "managed"))
    for variable in model.weights:
        variable.assign(tf.zeros_like(variable))
    checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    out["restored"] = weights(model)
    out["restored_iterations"] = int(optimizer.iterations.numpy())
    loaded = tf.saved_model.load(os.path.join(directory, "exported"))
    out["exported_output"] = np.asarray(loaded.serve(tf.constant(x[:2], tf.float32))).tolist()
    write_report(results_dir, runtime.rank(), out)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
