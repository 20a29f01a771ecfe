"""Worker of tests/strategy/test_callbacks.py: Keras callbacks that write files, on every worker.

Usage: strategy_callbacks.py RESULTS_DIR FILES_DIR

TensorBoard and CSVLogger (append=True, over two fits) in one shared directory; then
BackupAndRestore interrupted at epoch 2 and resumed, once with a directory shared by the
workers and once with a directory of each worker's own. Writes ``{results_dir}/rank{r}.json``.
"""

import os
import sys

import keras
import numpy as np

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report

EPOCHS = 4


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def build(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def interrupted_and_resumed(strategy, data, backup_dir):
    model = build(strategy)
    try:
        model.fit(
            *data,
            batch_size=16,
            epochs=EPOCHS,
            verbose=0,
            shuffle=False,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), Interrupt()],
        )
    except RuntimeError:
        pass
    resumed = build(strategy)  # a fresh model, as a restarted job would build
    history = resumed.fit(
        *data,
        batch_size=16,
        epochs=EPOCHS,
        verbose=0,
        shuffle=False,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir)],
    )
    runtime.barrier()  # rank 0 deletes the backup at the end of its fit: wait for it
    return {
        "epochs_after_resume": len(history.history["loss"]),
        "weights": [w.numpy().ravel().tolist() for w in resumed.weights],
        "iterations": int(resumed.optimizer.iterations.numpy()),
        "backup_left": os.path.exists(backup_dir),
    }


def main(results_dir: str, files: str) -> None:
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy()
    keras.utils.set_random_seed(3 + runtime.rank())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 4))
    data = (x, np.tanh(x.sum(axis=1, keepdims=True)))
    out = {"rank": runtime.rank()}

    model = build(strategy)
    logs = os.path.join(files, "logs")
    csv = os.path.join(files, "log.csv")
    for _ in range(2):
        model.fit(
            *data,
            batch_size=16,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[keras.callbacks.TensorBoard(logs), keras.callbacks.CSVLogger(csv, append=True)],
        )

    keras.utils.set_random_seed(3 + runtime.rank())
    out["shared"] = interrupted_and_resumed(strategy, data, os.path.join(files, "backup"))
    keras.utils.set_random_seed(3 + runtime.rank())
    out["own"] = interrupted_and_resumed(strategy, data, os.path.join(files, f"backup-of-rank{runtime.rank()}"))
    write_report(results_dir, runtime.rank(), out)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
