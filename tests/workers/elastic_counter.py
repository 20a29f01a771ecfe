"""Worker of tests/elastic: a model whose update shows which records were used.

``counts[i]`` goes up by exactly one each time record ``i`` is trained on
(its gradient is -1 at ``i``, all-reduced with SUM, learning rate 1), so after
epoch ``e`` every count must equal ``e``: a record lost or used twice shows.

argv: OUT_DIR CONFIG_JSON with keys records, batch, epochs, commit_every and
optional: kill {worker_id: step} (SIGKILL itself before that step), stop
{worker_id: step} (SIGSTOP itself), term {worker_id: step} (SIGTERM itself), kill_in_sync {worker_id: n} (SIGKILL itself
at the start of its n-th sync), kill_all_at (every worker dies at that step),
checkpoint_dir, keras (train with model.fit instead of a custom loop), files (TFRecord files whose
records are their ids: read with ElasticFiles instead of ElasticRecords), hold
{at_step, size, version} (at that step, commit until the job has that many
workers, in a membership of at least that version), exit {worker: step} (exit 1).
"""

import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, data, elastic, runtime
from tests.workers.report import write_named_report

out_dir, config = sys.argv[1], json.loads(sys.argv[2])
worker_id = os.environ["EDL_WORKER_ID"]
num_records, epochs = config["records"], config["epochs"]

print(f"{worker_id}: starting", flush=True)
strategy = AllReduceStrategy(timeout=config.get("timeout", 20))
with strategy.scope():
    counts = tf.Variable(tf.zeros([num_records], tf.float32), name="counts")
    seen = tf.Variable(tf.zeros([4], tf.float64), name="seen")
if config.get("files"):  # TFRecord files whose records are their ids, as text
    records = data.ElasticFiles(config["files"], batch_size=config["batch"], shard_size=25, seed=3)
else:
    records = data.ElasticRecords(num_records, batch_size=config["batch"], seed=3)


def dataset():
    """Batches of record ids, one per step, from the position."""
    if config.get("files"):
        return records.dataset(lambda record: tf.strings.to_number(record, tf.int64))
    return records.dataset()


epoch_checks = {}
syncs = {"n": 0}


def targeted(plan, value):
    """Whether ``plan`` ({"rank:R" or worker id: value}) targets this worker now, once per job."""
    for key in (worker_id, f"rank:{runtime.rank()}"):
        if plan.get(key) == value and not os.path.exists(os.path.join(out_dir, f"done-{key}-{value}")):
            open(os.path.join(out_dir, f"done-{key}-{value}"), "w").close()
            return True
    return False


def die(sig, why):
    with open(os.path.join(out_dir, f"{worker_id}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if sig != signal.SIGTERM:
        open(os.path.join(out_dir, f"{worker_id}.dead"), "w").close()
    print(f"{worker_id}: {why}", flush=True)
    os.kill(os.getpid(), sig)


class CounterState(elastic.State):
    def _prepare_sync(self):
        syncs["n"] += 1
        if targeted(config.get("kill_in_sync", {}), syncs["n"]):
            die(signal.SIGKILL, f"killing myself at the start of sync #{syncs['n']}")


state = CounterState(
    variables=[counts, seen],
    records=records,
    checkpoint_dir=config.get("checkpoint_dir"),
    checkpoint_every=config.get("checkpoint_every", 2),
    steps=0,
)
resets = []  # the worker count seen by each reset callback
state.register_reset_callbacks([lambda: resets.append(runtime.size())])


def before_step():
    step = state.steps
    if targeted(config.get("kill", {}), step) or config.get("kill_all_at") == step:
        die(signal.SIGKILL, f"killing myself before step {step}")
    if targeted(config.get("stop", {}), step):
        die(signal.SIGSTOP, f"stopping myself before step {step}")
    hold = config.get("hold")
    if hold and step == hold["at_step"]:
        # Commit (nothing else) until the job has grown to hold["size"] workers: joins happen at commits.
        deadline = time.monotonic() + 60
        version = hold.get("version", 0)
        while (runtime.size() < hold["size"] or runtime.current_worker().membership.version < version) and (
            time.monotonic() < deadline
        ):
            state.commit()
            time.sleep(0.05)
    if targeted(config.get("exit", {}), step):
        print(f"{worker_id}: exiting with code 1 before step {step}", flush=True)
        os._exit(1)
    if targeted(config.get("term", {}), step):
        die(signal.SIGTERM, f"sending myself SIGTERM before step {step}")
    if runtime.rank() == 0:
        tmp = os.path.join(out_dir, "progress.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(out_dir, "progress"))


def after_epoch():
    # The epoch just finished: every record must have been counted exactly `epoch` times.
    epoch = records.epoch
    values = counts.numpy()
    epoch_checks[str(epoch)] = {
        "ok": bool(np.all(values == epoch)),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def replica_step(indices):
    with tf.GradientTape() as tape:
        loss = -tf.reduce_sum(tf.gather(counts, indices))
    gradient = tf.convert_to_tensor(tape.gradient(loss, counts))
    used = tf.cast(tf.size(indices), tf.float64)
    gradient, used = tf.distribute.get_replica_context().all_reduce("SUM", [gradient, used])
    counts.assign_sub(gradient)
    seen.assign_add(tf.stack([used, used * used, 1.0, tf.cast(runtime.size(), tf.float64)]))


@elastic.run
def train(state):
    step = tf.function(lambda indices: strategy.run(replica_step, (indices,)))
    while records.epoch < epochs:
        for indices in dataset():
            before_step()
            step(indices)
            state.steps += 1
            epoch_before = records.epoch
            records.advance()
            if records.epoch != epoch_before:
                after_epoch()
            if state.steps % config["commit_every"] == 0 or records.epoch != epoch_before:
                state.commit()


def train_keras():
    import keras

    class Counter(keras.Model):
        def call(self, indices):
            return tf.cast(indices, tf.float32)

        def train_step(self, indices):
            replica_step(indices)
            return {"records": tf.cast(tf.size(indices), tf.float32)}

    with strategy.scope():
        model = Counter()
        model.compile(optimizer="sgd", jit_compile=False)
        model.built = True
    keras_state = CounterState(
        variables=[counts, seen], records=records, checkpoint_dir=config.get("checkpoint_dir"), steps=0
    )

    class Hooks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            before_step()
            keras_state.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            after_epoch()

    @elastic.run
    def fit(s):
        model.fit(
            dataset(),
            epochs=epochs,
            initial_epoch=records.epoch,
            verbose=0,
            callbacks=[Hooks(), elastic.CommitStateCallback(s, batches_per_commit=config["commit_every"])],
        )

    global state
    state = keras_state
    fit(keras_state)


if config.get("keras"):
    train_keras()
else:
    train(state)

write_named_report(
    out_dir,
    worker_id,
    {
        "worker_id": worker_id,
        "rank": runtime.rank(),
        "size": runtime.size(),
        "membership_version": runtime.current_worker().membership.version,
        "counts": counts.numpy().tolist(),
        "seen": seen.numpy().tolist(),
        "steps": state.steps,
        "commit_id": state.commit_id,
        "epoch_checks": epoch_checks,
        "syncs": syncs["n"],
        "resets": resets,
    },
)
