"""Input-pipeline benchmark: Keras ``fit`` on TFRecord files of JPEGs, ours vs TF MWMS vs one process.

Usage::

    python benchmarks/input_pipeline.py [--setups ours,tf,single] [--workers 2] [--files 16]
                                        [--records-per-file 512] [--image-size 64] [--crop 56] [--batch 64]
                                        [--repeats 3] [--warmup-epochs 1] [--rounds 3]
                                        [--data-dir /tmp/elasticdl-input-bench] [--json out.json]

What it measures: how many records each worker parses, and the samples/s of ``fit``, when every
contender is given the SAME input pipeline (same files, same global batch), with the dataset's default
``tf.data.Options`` (``experimental_distribute.auto_shard_policy`` = AUTO):

    tf.data.Dataset.list_files(pattern, shuffle=False)                       # the files, sorted
      .interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
      .map(parse, num_parallel_calls=AUTOTUNE)     # parse_single_example, decode_jpeg, random crop,
                                                   # random flip, random brightness, normalize
      .batch(global_batch, drop_remainder=True)
      .prefetch(AUTOTUNE)

Setups (see ``setups.py`` for how their processes are started):
    ours    ``elasticdl_strategy.AllReduceStrategy``, N workers under ``elasticdl-strategy run``
    tf      ``tf.distribute.MultiWorkerMirroredStrategy`` (RING, CPU), N local workers from TF_CONFIG
    single  one process, no strategy, the same global batch

Keras 3.15's ``fit`` does not run under MWMS as released (tensorflow/tensorflow#72388): two MWMS-only
code paths of Keras reduce values MWMS cannot reduce; ``keras_fit_under_mwms`` fixes both in the MWMS
workers (nothing else changes for them; see its docstring).

Under a strategy, Keras ``fit`` hands the dataset to ``strategy.experimental_distribute_dataset``,
which decides what each worker reads. MWMS with AUTO shards by FILE when the source reads at least N
files (each worker reads its files, batches of global/N), else by DATA (every worker reads and parses
everything, keeps its share). Before input sharding lands in ours, ours maps a row-slicing function
over each global batch: every worker parses every record and keeps 1/N of each batch.

Data: ``--files`` TFRecord files of ``--records-per-file`` ``tf.train.Example`` records each (``image``:
a JPEG of ``--image-size`` squared RGB pixels made by ``tf.io.encode_jpeg`` at quality 90: smooth waves
in a colour of the label, a few rectangles and noise, so it compresses like a photo rather than like
noise; ``label``: an int64 in [0, 10)). Made once with a fixed seed and kept in a subdirectory of
``--data-dir`` named by the sizes (``DONE`` is written last: an incomplete directory is made again).

Records parsed: ``parse`` adds 1 to an int64 ``tf.Variable`` created outside the dataset (and outside
``strategy.scope()``: a plain local variable, never synchronized); why this counter, see ``make_dataset``.
Each epoch runs its (finite) dataset to the end, so the counter's increase over an epoch is exactly the
records this worker parsed in it; records parsed per worker = that / records in the dataset (the median
over the timed epochs, per rank). Rows dropped after parsing (ours' slicing, MWMS's DATA shard,
``drop_remainder``) count.

Timing: Keras ``compile`` (SGD with momentum, sparse categorical cross-entropy, accuracy) + ``fit``
with ``verbose=0`` for ``--warmup-epochs`` + ``--repeats`` epochs; a callback times each epoch with
``time.perf_counter`` from ``on_epoch_begin`` to ``on_epoch_end`` (it includes making the epoch's
iterator and filling the pipeline, as every epoch of a real job does). The warm-up epochs (tracing,
first file reads) are not timed. Samples/s of an epoch = global batch x steps / seconds, from rank 0.
Each setup's processes run ``--rounds`` times, the setups in turn, the order turned by one each round
(ours, tf, single; tf, single, ours; ...), and all timed epochs of a setup are pooled: median, min and
max are reported. The model: a CNN of three 3x3 convolutions with stride 2 (16, 32, 64 filters, ReLU),
global average pooling, Dense(10), on ``--crop`` squared inputs: light enough that the input pipeline
is a real share of a step.

Threads: the launcher gives each of our workers TF_NUM_INTRAOP_THREADS = OMP_NUM_THREADS = cores / N;
each MWMS worker gets the same; the single process keeps TensorFlow's defaults (every core). tf.data
sizes its own thread pool to the machine's cores in every process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)
from _common import RUN_TIMEOUT_S, describe, log_tail, run_benchmark, sigterm_interrupts, write_json_atomically  # noqa: E402
from setups import make_strategy, run_processes, setup_commands, thread_env  # noqa: E402  (the processes of one setup)

SETUPS = ("ours", "tf", "single")
NUM_CLASSES = 10
JPEG_QUALITY = 90
CYCLE_LENGTH = 4  # files read at once by the interleave
LEARNING_RATE = 0.01
SEED = 0
DEFAULT_DATA_DIR = os.path.join(tempfile.gettempdir(), "elasticdl-input-bench")
TARGET_PARSED = 0.55  # records parsed per worker, fraction of the dataset (the target)


# ---------------------------------------------------------------------------
# Data: TFRecord files of JPEGs, made once
# ---------------------------------------------------------------------------


def data_subdir(args: argparse.Namespace) -> Path:
    name = f"files{args.files}-records{args.records_per_file}-size{args.image_size}-seed{SEED}"
    return Path(args.data_dir) / name


def file_pattern(directory: Path) -> str:
    return str(directory / "train-*.tfrecord")


def synthetic_image(rng: np.random.Generator, size: int, label: int) -> np.ndarray:
    """A uint8 image: a smooth wave in a colour of the label, a few flat rectangles and mild noise."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle, frequency, phase = rng.uniform(0, 2 * np.pi), rng.uniform(1, 4), rng.uniform(0, 2 * np.pi)
    wave = np.sin(2 * np.pi * frequency * (x * np.cos(angle) + y * np.sin(angle)) + phase)
    hue = 2 * np.pi * label / NUM_CLASSES
    colour = 0.5 + 0.5 * np.cos(hue + np.array([0, 2 * np.pi / 3, 4 * np.pi / 3], np.float32))
    image = 128 + 100 * wave[..., None] * colour
    for _ in range(rng.integers(1, 4)):
        top, left = rng.integers(0, size - 8, 2)
        height, width = rng.integers(4, size // 2, 2)
        image[top : top + height, left : left + width] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def ensure_data(args: argparse.Namespace) -> Path:
    """The directory of the TFRecord files for these sizes; made (in a temporary directory renamed
    into place) when missing or incomplete."""
    directory = data_subdir(args)
    if (directory / "DONE").exists():
        return directory
    started = time.monotonic()
    import tensorflow as tf  # only here: the parent imports TensorFlow only to make the data

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    rng = np.random.default_rng(SEED)
    total_bytes = 0
    try:
        for index in range(args.files):
            path = tmp / f"train-{index:05d}-of-{args.files:05d}.tfrecord"
            with tf.io.TFRecordWriter(str(path)) as writer:
                for _ in range(args.records_per_file):
                    label = int(rng.integers(0, NUM_CLASSES))
                    image = synthetic_image(rng, args.image_size, label)
                    jpeg = tf.io.encode_jpeg(image, quality=JPEG_QUALITY).numpy()
                    total_bytes += len(jpeg)
                    feature = {
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                    }
                    writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        records = args.files * args.records_per_file
        info = {"files": args.files, "records": records, "mean_jpeg_bytes": total_bytes / records}
        (tmp / "DONE").write_text(json.dumps(info))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"made {directory} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return directory


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


def make_dataset(pattern: str, global_batch: int, crop: int, counter):
    """The input pipeline every setup trains on (global batches; see the module's docstring)."""
    import tensorflow as tf

    features = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    mean, std = tf.constant([0.5, 0.5, 0.5]), tf.constant([0.25, 0.25, 0.25])

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        image = tf.io.decode_jpeg(example["image"], channels=3)
        image = tf.image.random_crop(image, [crop, crop, 3])
        image = tf.image.random_flip_left_right(image)
        image = tf.image.convert_image_dtype(image, tf.float32)  # [0, 1]
        image = tf.clip_by_value(tf.image.random_brightness(image, 0.1), 0.0, 1.0)
        image = (image - mean) / std
        # Records parsed, counted here: every record this worker parses passes, also those that a shard by
        # DATA or ours' row slicing drop afterwards. ``counter`` is an int64 tf.Variable made outside the
        # dataset: AssignAddVariableOp is a cheap atomic add that runs in tf.data's parallel map threads
        # without a lock the other calls wait on (a tf.py_function counter would take the GIL for every
        # record and serialize the map). tf.data only keeps a stateful map function from optimizations
        # that reorder or drop elements; num_parallel_calls is explicit, so the map stays parallel. The
        # variable survives the rewrites of experimental_distribute_dataset (MWMS's auto-shard rewrite
        # counts into the same variable). The update runs before the record leaves the map:
        with tf.control_dependencies([counter.assign_add(1, read_value=False)]):
            return tf.identity(image), tf.identity(example["label"])

    autotune = tf.data.AUTOTUNE
    dataset = tf.data.Dataset.list_files(pattern, shuffle=False)
    dataset = dataset.interleave(
        tf.data.TFRecordDataset, cycle_length=CYCLE_LENGTH, num_parallel_calls=autotune, deterministic=True
    )
    dataset = dataset.map(parse, num_parallel_calls=autotune)
    return dataset.batch(global_batch, drop_remainder=True).prefetch(autotune)


def build_model(crop: int):
    import keras

    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((crop, crop, 3)),
            layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
            layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(NUM_CLASSES),
        ]
    )


def worker_main(args: argparse.Namespace) -> int:
    """Trains with ``fit`` and writes this worker's epochs to ``<results>/rank<R>.json``."""
    import keras
    import tensorflow as tf

    strategy, rank, workers = make_strategy(args.worker)
    report: dict = {
        "rank": rank,
        "workers": workers,
        "threads": {name: os.environ.get(name) for name in ("TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS")},
    }
    try:
        keras.utils.set_random_seed(SEED)
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="records_parsed")
        dataset = make_dataset(args.pattern, args.batch, args.crop, counter)
        report["auto_shard_policy"] = dataset.options().experimental_distribute.auto_shard_policy.name
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = build_model(args.crop)
            model.compile(
                optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        if args.worker == "tf":
            keras_fit_under_mwms(model, strategy)
        timer = epoch_timer(counter)
        model.fit(dataset, epochs=args.warmup_epochs + args.repeats, verbose=0, callbacks=[timer])
        report.update(timer.report(args.warmup_epochs))
    except Exception as e:
        traceback.print_exc()
        report["error"] = describe(e)
    write_json_atomically(args.results / f"rank{rank}.json", report)
    if args.worker == "ours":
        from elasticdl_strategy import runtime

        runtime.barrier()  # nobody leaves while others still communicate
        runtime.shutdown()
    return 1 if "error" in report else 0


def keras_fit_under_mwms(model, strategy) -> None:
    """Lets Keras 3.15's ``fit`` run under MultiWorkerMirroredStrategy at all (tensorflow/tensorflow#72388:
    without these, ``fit`` fails before its first step). Two places, both MWMS-only code paths of Keras:

    - ``_maybe_symbolic_build`` builds the metrics and optimizer from a first batch that it averages over
      the replicas with ``strategy.reduce("MEAN", (x, y))``; MWMS's reduce takes one value, not a tuple
      ("Attempt to convert a value (PerReplica...)"). Only shapes matter there, so this model builds
      from its local first batch (what ``elasticdl_strategy.strategy.keras_compat`` does for ours).
    - ``reduce_per_replica`` reduces every per-step log with ``strategy.reduce("MEAN", v, axis=0)``,
      which fails for the scalar loss and metrics ("Invalid reduction dimension 0 for input with 0
      dimensions"); a scalar gets ``axis=None`` (the mean over the replicas, one all-reduce as before).
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    def maybe_symbolic_build(iterator=None, data_batch=None):
        for _, _, it in iterator if iterator is not None else ():
            data_batch = tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], next(it))
            break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = maybe_symbolic_build
    reduce_per_replica = trainer.reduce_per_replica

    def reduce_scalars_per_replica(values, strategy_, reduction):
        if reduction not in ("auto", "mean") or not isinstance(strategy_, tf.distribute.MultiWorkerMirroredStrategy):
            return reduce_per_replica(values, strategy_, reduction)

        def mean(v):
            rank = strategy_.experimental_local_results(v)[0].shape.rank
            return strategy_.reduce("MEAN", v, axis=None if rank == 0 else 0)

        return tf.nest.map_structure(mean, values)

    trainer.reduce_per_replica = reduce_scalars_per_replica


def epoch_timer(counter):
    """A Keras callback (its class is made here: the parent process never imports Keras)."""
    import keras

    class _EpochTimer(keras.callbacks.Callback):
        """Per epoch: seconds from on_epoch_begin to on_epoch_end and to the end of its first step, seconds
        from the end of its first step to the end of its last, steps, records parsed by the epoch's end."""

        def __init__(self):
            super().__init__()
            self.seconds: List[float] = []
            self.first_step_s: List[float] = []
            self.steady_s: List[float] = []
            self.steps: List[int] = []
            self.parsed: List[int] = []
            self._start = self._first = self._last = 0.0
            self._before = 0

        def on_train_begin(self, logs=None):
            # What Keras' build batch made the pipeline parse before training (MWMS and ours).
            self._before = int(counter.numpy())

        def on_epoch_begin(self, epoch, logs=None):
            self.steps.append(0)
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self._last = time.perf_counter()
            if self.steps[-1] == 0:
                self._first = self._last
            self.steps[-1] += 1

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)
            self.first_step_s.append(self._first - self._start)
            self.steady_s.append(self._last - self._first)
            self.parsed.append(int(counter.numpy()))

        def report(self, warmup: int) -> dict:
            per_epoch = np.diff([self._before, *self.parsed]).tolist()
            return {
                "epoch_s": self.seconds[warmup:],
                "first_step_s": self.first_step_s[warmup:],
                "steady_s": self.steady_s[warmup:],
                "steps": self.steps[warmup:],
                "parsed": per_epoch[warmup:],
                "warmup_epoch_s": self.seconds[:warmup],
                "warmup_parsed": per_epoch[:warmup],
                "parsed_before_training": self._before,
            }

    return _EpochTimer()


# ---------------------------------------------------------------------------
# Parent side: run the setups, pool their epochs, report
# ---------------------------------------------------------------------------


@dataclass
class SetupResult:
    setup: str
    epoch_s: List[float] = field(default_factory=list)  # rank 0's timed epochs, every round
    first_step_s: List[float] = field(default_factory=list)  # epoch begin -> end of its first step
    steady_s: List[float] = field(default_factory=list)  # end of the first step -> end of the last
    steps: List[int] = field(default_factory=list)
    parsed: Dict[int, List[int]] = field(default_factory=dict)  # rank -> records parsed per timed epoch
    threads: Dict[int, dict] = field(default_factory=dict)
    policy: Optional[str] = None
    errors: List[str] = field(default_factory=list)
    loads: List[float] = field(default_factory=list)  # 1-minute load average when each run started

    def samples_per_s(self, batch: int) -> List[float]:
        return [batch * steps / seconds for steps, seconds in zip(self.steps, self.epoch_s, strict=True)]

    def steady_samples_per_s(self, batch: int) -> List[float]:
        """Without each epoch's start (its iterator, the pipeline's fill, the first step)."""
        return [batch * (steps - 1) / s for steps, s in zip(self.steps, self.steady_s, strict=True) if s > 0]

    def fractions(self, records: int) -> Dict[int, float]:
        """Per rank: the median over timed epochs of records parsed / records in the dataset."""
        return {rank: statistics.median(p) / records for rank, p in sorted(self.parsed.items()) if p}


def setup_title(setup: str, workers: int) -> str:
    return {
        "ours": f"ours (AllReduceStrategy), N={workers}",
        "tf": f"TF MultiWorkerMirroredStrategy, N={workers}",
        "single": "single process (no strategy)",
    }[setup]


def run_round(setup: str, args: argparse.Namespace, result: SetupResult) -> None:
    """Runs the processes of ``setup`` once and adds their epochs to ``result``."""
    workers = 1 if setup == "single" else args.workers
    with tempfile.TemporaryDirectory(prefix="input-pipeline-bench-") as tmp:
        out, log = Path(tmp), Path(tmp) / "output.log"
        me = [sys.executable, os.path.abspath(__file__), "--worker", setup, "--results", str(out)]
        me += ["--pattern", args.pattern, "--batch", str(args.batch), "--crop", str(args.crop)]
        me += ["--repeats", str(args.repeats), "--warmup-epochs", str(args.warmup_epochs)]
        started = time.monotonic()
        result.loads.append(os.getloadavg()[0])
        failure = run_processes(setup_commands(setup, workers, me), log, out / "rank0.json", args.timeout)
        reports = []
        for rank in range(workers):
            path = out / f"rank{rank}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else {"error": "no result"})
        status = "ok" if failure is None else f"FAILED: {failure}"
        took = f"{time.monotonic() - started:.1f} s (load average {result.loads[-1]:.2f} at its start)"
        print(f"  {setup:<6}: {took}, {status}", file=sys.stderr, flush=True)
        errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
        if failure is not None or errors:
            print(f"  last lines of its output:\n{log_tail(log)}", file=sys.stderr, flush=True)
            result.errors.append(failure or "; ".join(errors))
            return
    result.epoch_s += reports[0]["epoch_s"]
    result.first_step_s += reports[0]["first_step_s"]
    result.steady_s += reports[0]["steady_s"]
    result.steps += reports[0]["steps"]
    result.policy = reports[0]["auto_shard_policy"]
    for rank, rep in enumerate(reports):
        result.parsed.setdefault(rank, []).extend(rep["parsed"])
        result.threads[rank] = rep["threads"]


def records_in_dataset(args: argparse.Namespace) -> int:
    return args.files * args.records_per_file


def method_lines(args: argparse.Namespace, info: dict) -> List[str]:
    records = records_in_dataset(args)
    threads = thread_env(args.workers)["TF_NUM_INTRAOP_THREADS"]
    return [
        f"Data: {args.files} TFRecord files x {args.records_per_file} records = {records} JPEGs of "
        f"{args.image_size}x{args.image_size}x3 (mean {info['mean_jpeg_bytes'] / 1024:.1f} KiB), random crop to "
        f"{args.crop}x{args.crop}, flip, brightness, normalize; list_files(shuffle=False) -> "
        f"interleave(TFRecordDataset, cycle_length={CYCLE_LENGTH}) -> map(parse) -> "
        f"batch({args.batch}, drop_remainder=True) -> prefetch; default tf.data.Options (auto_shard_policy AUTO).",
        f"Method: Keras compile + fit, CNN conv16/32/64 stride 2 + global average pool + dense; global batch "
        f"{args.batch}, N = {args.workers} workers for ours and TF MWMS ({args.batch // args.workers} per worker); "
        f"{args.warmup_epochs} warm-up epoch(s) untimed, then {args.repeats} timed epochs of "
        f"{records // args.batch} steps per run, {args.rounds} run(s) per setup; median, min, max over the "
        f"{args.repeats * args.rounds} timed epochs; samples/s = global batch x steps / epoch seconds (rank 0).",
        f"Threads: each worker of ours (set by the launcher) and of TF MWMS (set by this script, the same): "
        f"TF_NUM_INTRAOP_THREADS = OMP_NUM_THREADS = {threads} (cores {os.cpu_count()} / N {args.workers}); "
        f"single process: TensorFlow's defaults (all {os.cpu_count()} cores). Load average before: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}.",
    ]


def _spread(values: Sequence[float], digits: int = 0) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def print_report(results: Sequence[SetupResult], args: argparse.Namespace) -> None:
    """The table (markdown), the ratios of ours to the others and the issue's targets."""
    records = records_in_dataset(args)
    epochs = args.repeats * args.rounds
    print(
        f"\nsamples/s: median (min-max) of {epochs} timed epochs; steady: without each epoch's start; "
        f"epoch start: epoch begin -> end of its first step (the iterator, the pipeline's fill, one step)"
    )
    print(
        "| setup | samples/s | steady samples/s | epoch start s | s/epoch "
        "| records parsed per worker (fraction of the dataset) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        head = f"| {setup_title(r.setup, args.workers)} | "
        if not r.epoch_s:
            print(head + f"error: {'; '.join(r.errors)[:200]} | | | | |")
            continue
        fractions = ", ".join(f"{f:.3f}" for f in r.fractions(records).values())
        print(
            head + f"{_spread(r.samples_per_s(args.batch))} | {_spread(r.steady_samples_per_s(args.batch))} | "
            f"{statistics.median(r.first_step_s):.2f} | {statistics.median(r.epoch_s):.2f} | {fractions} |"
        )
        if r.errors:
            print(f"  ({r.setup}: {len(r.errors)} failed run(s): {'; '.join(r.errors)[:160]})")
    steps = {n for r in results for n in r.steps}
    if len(steps) > 1:
        print(f"WARNING: epochs of different lengths (steps {sorted(steps)}): the setups did not see the same data")
    seen = "; ".join(
        f"{r.setup} " + ", ".join(f"rank {k}: {t['TF_NUM_INTRAOP_THREADS']}/{t['OMP_NUM_THREADS']}" for k, t in ranks)
        for r in results
        if (ranks := sorted(r.threads.items()))
    )
    print(f"TF_NUM_INTRAOP_THREADS/OMP_NUM_THREADS seen by the workers (None: not set): {seen}")
    loads = [v for r in results for v in r.loads]
    if loads:
        print(f"Load average (1 min) when the runs started: {min(loads):.2f}-{max(loads):.2f}")
    by_setup = {r.setup: r for r in results if r.epoch_s}
    ours = by_setup.get("ours")
    if ours is None:
        return
    mine = statistics.median(ours.samples_per_s(args.batch))
    mine_steady = statistics.median(ours.steady_samples_per_s(args.batch))
    print("Ratios (median samples/s of ours / of the other; > 1 means ours is faster):")
    for setup, title in (("tf", "TF MultiWorkerMirroredStrategy"), ("single", "single process")):
        other = by_setup.get(setup)
        if other is not None:
            ratio = mine / statistics.median(other.samples_per_s(args.batch))
            steady = mine_steady / statistics.median(other.steady_samples_per_s(args.batch))
            print(f"  ours / {title}: {ratio:.2f}x (steady: {steady:.2f}x)")
    worst = max(ours.fractions(records).values())
    verdict = "met" if worst <= TARGET_PARSED else "NOT met"
    print(f"Target: records parsed per worker <= {TARGET_PARSED} of the dataset: {verdict} (ours: {worst:.3f})")
    other = by_setup.get("tf")
    if other is not None:
        theirs = statistics.median(other.samples_per_s(args.batch))
        verdict = "met" if mine >= theirs else "NOT met"
        print(f"Target: samples/s >= TF MWMS's: {verdict} ({mine:.1f} vs {theirs:.1f})")


def git_commit() -> Optional[str]:
    """The repository's commit (``+dirty`` with uncommitted changes), or None outside a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def write_json(path: str, args: argparse.Namespace, lines: Sequence[str], results: Sequence[SetupResult]) -> None:
    records = records_in_dataset(args)
    data = {
        "method": list(lines),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "config": {
            k: getattr(args, k)
            for k in ("workers", "files", "records_per_file", "image_size", "crop", "batch", "repeats", "rounds")
        }
        | {"warmup_epochs": args.warmup_epochs, "records": records},
        "results": [
            {
                "setup": r.setup,
                "auto_shard_policy": r.policy,
                "epoch_s": r.epoch_s,
                "first_step_s": r.first_step_s,
                "steady_s": r.steady_s,
                "steps": r.steps,
                "steady_samples_per_s": r.steady_samples_per_s(args.batch),
                "samples_per_s": r.samples_per_s(args.batch),
                "samples_per_s_median": statistics.median(r.samples_per_s(args.batch)) if r.epoch_s else None,
                "records_parsed_per_epoch": {str(k): v for k, v in r.parsed.items()},
                "parsed_fraction_per_worker": {str(k): v for k, v in r.fractions(records).items()},
                "threads": {str(k): v for k, v in r.threads.items()},
                "load_average_at_start": r.loads,
                "errors": r.errors,
            }
            for r in results
        ],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def _setup_list(text: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in SETUPS for n in names):
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(SETUPS)}, got {text!r}")
    return names


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setups", type=_setup_list, default=list(SETUPS), help="default ours,tf,single")
    p.add_argument("--workers", type=int, default=2, help="worker processes of ours and TF MWMS (default 2)")
    p.add_argument("--files", type=int, default=16, help="TFRecord files (default 16)")
    p.add_argument("--records-per-file", type=int, default=512, help="records per file (default 512)")
    p.add_argument("--image-size", type=int, default=64, help="JPEG width and height in pixels (default 64)")
    p.add_argument("--crop", type=int, default=56, help="random crop, the model's input size (default 56)")
    p.add_argument("--batch", type=int, default=64, help="global batch size (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per run (default 3)")
    p.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs first (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every setup, in turn; epochs pooled (default 3)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"the files' cache (default {DEFAULT_DATA_DIR})")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run of a setup (default 600)")
    p.add_argument("--worker", choices=SETUPS, help=argparse.SUPPRESS)  # internal: worker mode
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)  # internal: where the workers write
    p.add_argument("--pattern", help=argparse.SUPPRESS)  # internal: the files' glob
    args = p.parse_args(argv)
    if args.worker:
        return args
    if min(args.workers, args.files, args.records_per_file, args.repeats, args.rounds, args.batch) < 1:
        p.error("--workers, --files, --records-per-file, --repeats, --rounds and --batch must be >= 1")
    if args.warmup_epochs < 0 or not 8 <= args.crop <= args.image_size:
        p.error("--warmup-epochs must be >= 0 and 8 <= --crop <= --image-size")
    # Every worker must run the same number of steps whichever way the dataset is sharded: by file
    # (files / N each, batches of batch / N) or by data (every global batch split N ways).
    per_worker_records = args.files // args.workers * args.records_per_file
    if args.files % args.workers or args.batch % args.workers or per_worker_records % args.batch:
        p.error("--files and --batch must divide by --workers, and files / workers x records-per-file by --batch")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    sigterm_interrupts()
    directory = ensure_data(args)
    info = json.loads((directory / "DONE").read_text())
    args.pattern = file_pattern(directory)
    lines = method_lines(args, info)
    print("\n".join(lines), flush=True)
    results = [SetupResult(setup) for setup in args.setups]

    def body() -> None:
        for index in range(args.rounds):  # the order turns each round: load that drifts hits every setup
            for result in results[index % len(results) :] + results[: index % len(results)]:
                run_round(result.setup, args, result)
        print_report(results, args)

    def save() -> None:
        if args.json:
            write_json(args.json, args, lines, results)

    return run_benchmark(body, save)


if __name__ == "__main__":
    sys.exit(main())
