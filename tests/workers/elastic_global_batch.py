"""Worker of tests/elastic/test_global_batch.py: float64 linear regression with a fixed global batch.

argv: OUT_DIR CONFIG_JSON with keys records, global_batch, epochs, mode ("fit" or "loop"), and
optional kill (SIGKILL itself before that step, once per job, at rank 1) and hold (at that step,
commit until the job has ``workers`` workers again: the replacement joins while training).
Alone (no launcher) it is one process on the global batch. Writes ``{OUT_DIR}/{worker_id}.json``:
the weights, the sizes of the memberships it trained in, the steps taken.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, data, elastic, runtime
from tests.workers.report import write_named_report

out_dir, config = sys.argv[1], json.loads(sys.argv[2])
worker_id = os.environ.get("EDL_WORKER_ID", "alone")
keras.config.set_floatx("float64")
rng = np.random.default_rng(11)
x = rng.standard_normal((config["records"], 5))
y = x @ rng.standard_normal((5, 1)) + 0.1 * rng.standard_normal((config["records"], 1))
features, targets = tf.constant(x), tf.constant(y)

strategy = AllReduceStrategy(timeout=20)
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
records = data.ElasticRecords(config["records"], global_batch_size=config["global_batch"], shard_size=20, seed=4)
state = elastic.KerasState(model, records=records, steps=0)
sizes = set()


def before_step():
    sizes.add(runtime.size())
    if config.get("kill") == state.steps and runtime.rank() == 1:
        marker = os.path.join(out_dir, "killed")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    if config.get("hold") == state.steps:
        deadline = time.monotonic() + 90
        while runtime.size() < config["workers"] and time.monotonic() < deadline:
            state.commit()  # a joiner enters at a commit
            time.sleep(0.05)


def batches():
    return records.dataset().map(lambda i: (tf.gather(features, i), tf.gather(targets, i)))


class Hooks(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        before_step()

    def on_train_batch_end(self, batch, logs=None):
        state.steps += 1


@elastic.run
def fit(state):
    model.fit(batches(), epochs=config["epochs"], initial_epoch=records.epoch, verbose=0,
              callbacks=[Hooks(), *state.callbacks()])  # fmt: skip


def replica_step(batch_x, batch_y):
    with tf.GradientTape() as tape:
        errors = tf.reduce_sum(tf.square(model(batch_x) - batch_y), axis=1)
        # The mean over the global batch, whatever this worker's share of it (shares differ by one).
        loss = tf.nn.compute_average_loss(errors, global_batch_size=config["global_batch"])
    variables = model.trainable_variables
    model.optimizer.apply(tape.gradient(loss, variables), variables)


# Made once: traced per (number of workers, rank), each trace reused when the job returns to it.
step = elastic.function(lambda bx, by: strategy.run(replica_step, (bx, by)))


@elastic.run
def loop(state):
    while records.epoch < config["epochs"]:
        for batch_x, batch_y in batches():
            before_step()
            step(batch_x, batch_y)
            state.steps += 1
            records.advance()
            state.commit()


(fit if config["mode"] == "fit" else loop)(state)
write_named_report(
    out_dir,
    worker_id,
    {
        "weights": [w.numpy().ravel().tolist() for w in model.weights],
        "sizes": sorted(sizes),
        "steps": state.steps,
    },
)
runtime.shutdown()
