"""Worker of tests/elastic/test_campaign.py: an elastic Keras job as a user writes it, with faults.

An Adam-trained head whose learning rate a reset callback sets to ``BASE_LR × workers``, and a
tally of the records trained on (``counts[i]`` rises by one each time record ``i`` is trained
on, all-reduced), in ``model.fit`` or in a custom loop, committing every ``commit_every`` steps.

argv: OUT_DIR CONFIG_JSON with keys records, batch, epochs, commit_every, mode ("fit" or "loop")
final_size (before the last epoch the workers commit until the job has that many again) and
faults: a list of {"kind", "target", "step"}; kind is one of kill_before (SIGKILL itself
before the step), kill_after (after the step, before its commit), term (SIGTERM itself before
the step) and stop (SIGSTOP itself before the step; the test sends SIGCONT); target is
"rank:R". Each fault fires once per job (a marker file), at the first worker that reaches it.

Writes ``{OUT_DIR}/{worker_id}.json`` at the end (weights, optimizer state, tally checks,
reset-callback runs), ``{worker_id}.resets`` (a line per reset-callback run: membership
version, workers), ``{worker_id}.fault`` when it injected a fault, and ``{worker_id}.exit``
(time of exit) when it leaves.
"""

import atexit
import json
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, data, elastic, runtime
from tests.workers.campaign_data import dataset_arrays, parse
from tests.workers.report import write_named_report

BASE_LR = 0.01


out_dir, config = sys.argv[1], json.loads(sys.argv[2])
worker_id = os.environ["EDL_WORKER_ID"]
num_records, epochs, commit_every = config["records"], config["epochs"], config["commit_every"]
features, labels = (tf.constant(a) for a in dataset_arrays(num_records))


class Tallied(keras.Model):
    """A linear head trained with its optimizer, plus a tally of every record trained on."""

    def __init__(self):
        super().__init__()
        self.head = keras.layers.Dense(3, name="head")
        self.counts = self.add_weight(shape=(num_records,), initializer="zeros", trainable=False, name="counts")

    def call(self, inputs):
        x = inputs[0] if isinstance(inputs, (tuple, list)) else inputs  # (features, record indices)
        return self.head(x)

    def train_step(self, batch):
        (x, indices), y = batch
        with tf.GradientTape() as tape:
            logits = self.head(x)
            # A sum, not a mean: a worker whose share of the last batch is empty adds nothing.
            loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        gradients = tape.gradient(loss, self.head.trainable_variables)
        self.optimizer.apply(gradients, self.head.trainable_variables)  # all-reduced by the strategy
        tally = tf.math.bincount(tf.cast(indices, tf.int32), minlength=num_records, maxlength=num_records)
        tally = tf.distribute.get_replica_context().all_reduce("SUM", tf.cast(tally, self.counts.dtype))
        self.counts.assign_add(tally)
        return {"loss": loss}


strategy = AllReduceStrategy(timeout=20)
keras.config.set_floatx("float64")
with strategy.scope():
    model = Tallied()
    model(tf.zeros((1, 4), tf.float64))  # builds the head (its variables)
    model.compile(optimizer=keras.optimizers.Adam(BASE_LR), jit_compile=False)
if config["source"] == "files":
    records = data.ElasticFiles(config["files"], batch_size=config["batch"], shard_size=10, seed=5)
else:
    records = data.ElasticRecords(num_records, batch_size=config["batch"], seed=5)
state = elastic.KerasState(model, records=records, steps=0)
resets = []  # (membership version, workers, learning rate set) per reset-callback run
epoch_checks = {}


def rescale_learning_rate():
    version, size = runtime.current_worker().membership.version, runtime.size()
    model.optimizer.learning_rate.assign(BASE_LR * size)
    resets.append([version, size])
    with open(os.path.join(out_dir, f"{worker_id}.resets"), "a") as f:
        f.write(f"{version} {size}\n")


state.register_reset_callbacks([rescale_learning_rate])


def fault(when: str):
    """Fires the fault planned for this rank at this step and moment, once per job."""
    for planned in config["faults"]:
        hit = planned["target"] == f"rank:{runtime.rank()}" and planned["step"] == state.steps
        if not hit or (planned["kind"] == "kill_after") != (when == "after"):
            continue
        marker = os.path.join(out_dir, f"fired-{planned['kind']}-{planned['step']}")
        if os.path.exists(marker):
            continue
        open(marker, "w").close()
        record = {"kind": planned["kind"], "step": state.steps, "pid": os.getpid(), "time": time.time()}
        record["version"] = runtime.current_worker().membership.version
        with open(os.path.join(out_dir, f"{worker_id}.fault"), "w") as f:
            json.dump(record, f)
        print(f"{worker_id}: {planned['kind']} at step {state.steps}", flush=True)
        sig = {"term": signal.SIGTERM, "stop": signal.SIGSTOP}.get(planned["kind"], signal.SIGKILL)
        os.kill(os.getpid(), sig)


def first_steps():
    """The wall time of the first step in each membership (how long a change took)."""
    version = runtime.current_worker().membership.version
    path = os.path.join(out_dir, f"{worker_id}.steps")
    if version not in first_steps.seen:
        first_steps.seen.add(version)
        with open(path, "a") as f:
            f.write(f"{version} {runtime.size()} {time.time()}\n")


first_steps.seen = set()


def gate():
    """Before the last epoch, commits until the job is back to ``final_size`` workers, so that
    replacements and the stopped worker (once continued) join while the job trains."""
    if records.epoch != epochs - 1:
        return
    deadline = time.monotonic() + 90
    while runtime.size() < config["final_size"] and time.monotonic() < deadline:
        state.commit()  # a joiner enters at a commit: MembershipChangedInterrupt re-forms
        time.sleep(0.05)


def check_epoch():
    counts = model.counts.numpy()
    epoch_checks[str(records.epoch)] = bool(np.all(counts == records.epoch))


def dataset():
    if config["source"] == "files":
        return records.dataset(parse)
    return records.dataset().map(lambda i: ((tf.gather(features, i), i), tf.gather(labels, i)))


class Faults(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        gate()
        first_steps()
        fault("before")

    def on_train_batch_end(self, batch, logs=None):
        fault("after")
        state.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        check_epoch()


@elastic.run
def fit(state):
    model.fit(
        dataset(),
        epochs=epochs,
        initial_epoch=records.epoch,
        verbose=0,
        callbacks=[Faults(), *state.callbacks(batches_per_commit=commit_every)],
    )


@elastic.run
def loop(state):
    step = tf.function(lambda batch: strategy.run(model.train_step, (batch,)))
    while records.epoch < epochs:
        for batch in dataset():
            gate()
            first_steps()
            fault("before")
            step(batch)
            fault("after")
            state.steps += 1
            epoch = records.epoch
            records.advance()
            if records.epoch != epoch:
                check_epoch()
            if state.steps % commit_every == 0 or records.epoch != epoch or state.leave_pending():
                state.commit()


@atexit.register
def record_exit():
    with open(os.path.join(out_dir, f"{worker_id}.exit"), "w") as f:
        f.write(str(time.time()))


(fit if config["mode"] == "fit" else loop)(state)
write_named_report(
    out_dir,
    worker_id,
    {
        "size": runtime.size(),
        "version": runtime.current_worker().membership.version,
        "weights": [w.numpy().tolist() for w in model.weights],
        "counts": model.counts.numpy().tolist(),
        "optimizer": [v.numpy().tolist() for v in model.optimizer.variables],
        "learning_rate": float(model.optimizer.learning_rate.numpy()),
        "epoch_checks": epoch_checks,
        "resets": resets,
        "steps": state.steps,
    },
)
