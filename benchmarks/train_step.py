"""Train-step benchmark: one synchronous data-parallel step, single process vs TF MWMS vs ours.

Usage::

    python benchmarks/train_step.py [--models mlp,cnn] [--frameworks single,share,tf,ours]
                                    [--batch 256] [--steps 30] [--repeats 3] [--warmup 5] [--json out.json]
                                    [--bucket-mib 64] [--overlap on]

Setups (global batch B in every one):
    single  one process, no strategy, batch B
    share   N processes started by our launcher, each training its own model on one worker's share (batch
            B/N, the launcher's threads: cores / N) with no strategy and nothing exchanged, side by side
            (they only line up their timed windows with ``runtime.barrier``): the most data parallelism can
            reach on this machine, the ceiling for ours and MWMS. Two processes computing at once can be
            slower than one alone (shared caches, memory bandwidth, a VM's cores): this counts that in
    tf      ``tf.distribute.MultiWorkerMirroredStrategy`` (RING, CPU), N local workers from TF_CONFIG, B/N each
    ours    ``elasticdl_strategy.AllReduceStrategy``, N workers started by ``python -m elasticdl_strategy run``
    ours-socket, ours-grpc  the same without shared memory (payloads on the data socket, the path
            between hosts), and with every byte over gRPC

Models (float32, synthetic data): ``mlp`` Dense 1024->2048->1024->10 (4.2 M parameters) and
``cnn`` two 3x3 convolutions (32, 64 filters, each followed by 2x2 max-pooling), Dense 128, Dense 10
on 32x32x3 inputs.

Method: for every setup this script starts its process(es) running itself in
``--worker SETUP`` mode (with CUDA_VISIBLE_DEVICES="" and TF_CPP_MIN_LOG_LEVEL=2 for all).
Per model, each worker builds the model and a Keras SGD optimizer (in ``strategy.scope()``),
takes ONE global batch from ``strategy.experimental_distribute_dataset`` (its 1/N share) and
re-feeds it every step, so the input pipeline costs nothing. A step is a custom loop step in
``tf.function(jit_compile=False)``: ``strategy.run(step_fn)`` where ``step_fn`` computes
``tf.nn.compute_average_loss(..., global_batch_size=B)``, the gradients and
``optimizer.apply_gradients`` (which all-reduces them); the local loss is fetched after every
step so that the step has finished. After ``--warmup`` untimed steps, ``--repeats`` windows of
``--steps`` steps are timed with ``time.perf_counter``; a window gives seconds per step, and the
median window is reported (samples/s = B / that). Rank 0 writes the results to a JSON file that
the parent reads back.

Breakdown of ours, measured beside the training: the gradients travel in buckets of at most
``--bucket-mib`` MiB (``AllReduceStrategy(bucket_bytes=...)``), and the bucket all-reduces per
step are counted (``bridge.counters()``). ``runtime.allreduce`` of one float32 buffer of the
parameter count is timed the same way as the steps; compute and the rest ~ step time - that.
The bytes this rank sent per training step (``runtime.stats()``) confirm the size. Inside
the timed steps, the bridge's counters give the time spent packing gradients into buckets and
in the buckets' all-reduces (waiting for the slower worker included); after the timed windows
every worker times the same traced step while the bridge hands the gradients back unreduced
(compute, optimizer and bridge without the all-reduce; the models drift apart, only the time
is kept), and then with a barrier where each bucket's all-reduce was: the workers still wait for
the slower one at every step, so that is what a synchronous step would cost with an all-reduce
that took no time. The bridge into Python is timed as a ``tf.function`` calling ``tf.numpy_function``
with an identity function, on a tensor of the parameter count and on a 1-element one, and
beside the same ``tf.function`` without it: the difference is what one crossing costs, the
rest is TensorFlow's cost of calling a function, which one process pays as well.

Variants of ours: ``--bucket-mib 4,16,64`` and ``--overlap on,off`` (off: one numpy_function
for all the buckets of a step instead of one per bucket, so no reduction starts before backprop
ends) give several variants; they run in the SAME worker processes, each with
its own model and traced step, and their timed windows are interleaved (window r of every
variant, then window r+1), so that the shared machine's drift hits them alike. The first
variant is the "ours" of the main table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)
from _common import RUN_TIMEOUT_S, describe, log_tail, run_benchmark, sigterm_interrupts, write_json_atomically  # noqa: E402
from setups import Command, make_strategy, run_processes, setup_commands  # noqa: E402  (the processes of one setup)

MIB = 1 << 20

MODELS = ("mlp", "cnn")
FRAMEWORKS = ("single", "share", "tf", "ours", "ours-socket", "ours-grpc")
OURS = ("ours", "ours-socket", "ours-grpc")
# ours: the defaults (shared memory on one host); ours-socket: the data socket, the path between hosts;
# ours-grpc: every byte over gRPC.
OUR_PATH_ENV = {
    "ours": {"EDL_SHARED_MEMORY": "1", "EDL_DATA_SOCKET": "1"},
    "ours-socket": {"EDL_SHARED_MEMORY": "0", "EDL_DATA_SOCKET": "1"},
    "ours-grpc": {"EDL_SHARED_MEMORY": "0", "EDL_DATA_SOCKET": "0"},
}
MODEL_TITLES = {
    "mlp": "MLP 1024-2048-1024-10 on 1024-dim inputs",
    "cnn": "CNN conv3x3(32)-pool-conv3x3(64)-pool-dense(128)-dense(10) on 32x32x3 inputs",
}
INPUT_SHAPES = {"mlp": (1024,), "cnn": (32, 32, 3)}
NUM_CLASSES = 10
LEARNING_RATE = 0.01


def _choice_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown name(s) {unknown} (choose from {', '.join(choices)})")
        return names

    return parse


def _number_list(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return values


def _switch_list(text: str) -> List[bool]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in ("on", "off") for n in names):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return [n == "on" for n in names]


def setup_title(framework: str, workers: int) -> str:
    return {
        "single": "single process",
        "share": f"{workers} shares side by side, no all-reduce",
        "tf": f"TF MultiWorkerMirroredStrategy, N={workers}",
        "ours": f"ours (AllReduceStrategy), N={workers}",
        "ours-socket": f"ours, data socket only, N={workers}",
        "ours-grpc": f"ours, gRPC only, N={workers}",
    }[framework]


def format_mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


def build_model(name: str):
    import keras

    layers = keras.layers
    if name == "mlp":
        hidden = [layers.Dense(2048, activation="relu"), layers.Dense(1024, activation="relu")]
    else:
        hidden = [
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
        ]
    return keras.Sequential([keras.Input(INPUT_SHAPES[name]), *hidden, layers.Dense(NUM_CLASSES)])


def synthetic_batch(name: str, batch: int) -> Tuple[np.ndarray, np.ndarray]:
    """The same global batch on every worker (fixed seed)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *INPUT_SHAPES[name]), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, batch).astype(np.int32)
    return x, y


def bucket_bytes(mib: float) -> int:
    return max(1, int(mib * MIB))


@dataclass(frozen=True)
class Variant:
    """One configuration of ours: bucket size, one numpy_function per bucket (overlap) or not."""

    bucket_mib: float
    overlap: bool

    @property
    def title(self) -> str:
        how = "per-bucket numpy_functions (overlap)" if self.overlap else "one numpy_function"
        return f"buckets <= {self.bucket_mib:g} MiB, {how}"


def ours_variants(args: argparse.Namespace) -> List[Variant]:
    """The variants to measure, the first (first of every flag) first."""
    variants: List[Variant] = []
    for mib in args.bucket_mib:
        for overlap in args.overlap:
            if Variant(mib, overlap) not in variants:
                variants.append(Variant(mib, overlap))
    return variants


def local_batch(strategy, x: np.ndarray, y: np.ndarray):
    """This worker's share of the global batch (x, y), from ``experimental_distribute_dataset``."""
    import tensorflow as tf

    if strategy is None:
        return tf.constant(x), tf.constant(y)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)
    features, labels = next(iter(strategy.experimental_distribute_dataset(dataset)))
    rows = strategy.experimental_local_results(features)[0].shape[0]
    if rows != len(x) // strategy.num_replicas_in_sync:
        raise RuntimeError(f"local batch has {rows} rows, expected {len(x)} / {strategy.num_replicas_in_sync}")
    return features, labels


def make_train_step(name: str, strategy, global_batch: int):
    """(model, a function running one training step that returns when the step is done)."""
    import keras
    import tensorflow as tf

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(name)
        optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    if strategy is None:
        train_step = tf.function(step_fn, jit_compile=False)

        def run_step(features, labels) -> float:
            return float(train_step(features, labels))

    else:
        train_step = tf.function(
            lambda features, labels: strategy.run(step_fn, args=(features, labels)), jit_compile=False
        )

        def run_step(features, labels) -> float:
            return float(strategy.experimental_local_results(train_step(features, labels))[0])

    return model, run_step


def window_seconds(
    call: Callable[[], object], steps: int, repeats: int, line_up: Callable[[], object] = lambda: None
) -> List[float]:
    """Seconds per call in each of ``repeats`` windows of ``steps`` calls; ``line_up()`` before each window."""
    seconds = []
    for _ in range(repeats):
        line_up()
        start = time.perf_counter()
        for _ in range(steps):
            call()
        seconds.append((time.perf_counter() - start) / steps)
    return seconds


def measure_bridge(count: int, steps: int, repeats: int, warmup: int, crossings: int = 1) -> List[float]:
    """Seconds per call of a tf.function passing a float32 tensor of ``count`` through ``crossings``
    identity numpy_functions (0: the same function without one, the cost of calling a tf.function)."""
    import tensorflow as tf

    @tf.function(jit_compile=False)
    def round_trip(tensor):
        for _ in range(crossings):
            tensor = tf.numpy_function(lambda a: a, [tensor], tf.float32, stateful=True)
        return tensor[0]  # fetching a scalar: no copy of the whole tensor

    tensor = tf.zeros([count], tf.float32)

    def call() -> float:
        return float(round_trip(tensor))

    for _ in range(warmup):
        call()
    return window_seconds(call, steps, repeats)


def windows_without_the_ring(
    call: Callable[[], object], steps: int, repeats: int, lined_up: bool = False
) -> List[float]:
    """Seconds per step of ``call`` (a step traced with the bridge) while the bridge hands the
    gradients back unreduced: what the step costs without the all-reduce (the workers' models then
    drift apart; only the time is kept). ``lined_up``: each bucket's all-reduce is a barrier
    instead, so the workers still wait for each other where they would (what a synchronous step
    costs with an all-reduce that moves nothing). Every worker calls it at the same point."""
    from elasticdl_strategy import runtime
    from elasticdl_strategy.strategy import bridge

    def unreduced(arrays, *args, **kwargs):
        if lined_up:
            runtime.barrier()
        return [np.asarray(a) for a in arrays]

    reduce_buckets = bridge.reduce_buckets
    runtime.barrier()
    bridge.reduce_buckets = unreduced
    try:
        return window_seconds(call, steps, repeats)
    finally:
        bridge.reduce_buckets = reduce_buckets
        runtime.barrier()


def measure_ours_allreduce(count: int, steps: int, repeats: int, warmup: int) -> List[float]:
    """Seconds per ``runtime.allreduce`` of ``count`` float32, in place (zeros: the sums stay finite)."""
    from elasticdl_strategy import runtime

    buffer = np.zeros(count, np.float32)

    def call() -> None:
        runtime.allreduce(buffer, op="sum", out=buffer)

    for _ in range(warmup):
        call()
    runtime.barrier()
    return window_seconds(call, steps, repeats)


def measure_model(framework: str, name: str, strategy, args: argparse.Namespace) -> dict:
    if framework in OURS:
        return measure_ours(name, strategy, args)
    model, run_step = make_train_step(name, strategy, args.batch)
    rows = args.batch // args.workers if framework == "share" else args.batch
    features, labels = local_batch(strategy, *synthetic_batch(name, rows))
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    for _ in range(args.warmup):
        run_step(features, labels)
    result = {"params": params}
    line_up = lambda: None  # noqa: E731
    if framework == "share":
        from elasticdl_strategy import runtime

        line_up = runtime.barrier
    result["step_s"] = window_seconds(lambda: run_step(features, labels), args.steps, args.repeats, line_up)
    return result


def measure_ours(name: str, strategy, args: argparse.Namespace) -> dict:
    """Every variant of ours in these processes, timed in interleaved windows; then the breakdown."""
    from elasticdl_strategy import AllReduceStrategy, runtime
    from elasticdl_strategy.strategy import bridge

    variants = ours_variants(args)
    strategies = {variants[0].bucket_mib: strategy}
    features, labels = local_batch(strategy, *synthetic_batch(name, args.batch))
    steps, params = [], 0
    default_overlap = bridge._OVERLAP
    try:
        for variant in variants:
            if variant.bucket_mib not in strategies:
                strategies[variant.bucket_mib] = AllReduceStrategy(bucket_bytes=bucket_bytes(variant.bucket_mib))
            model, run_step = make_train_step(name, strategies[variant.bucket_mib], args.batch)
            params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
            bridge._OVERLAP = variant.overlap  # read when the step is traced
            for _ in range(args.warmup):
                run_step(features, labels)
            steps.append(run_step)
        seconds: List[List[float]] = [[] for _ in variants]
        counted = [collections.Counter() for _ in variants]  # bridge.counters() summed over the windows
        allocations_before = bridge.counters()["staging_allocations"]
        sent_before = runtime.stats()["bytes_sent"]
        for _ in range(args.repeats):
            for i, run_step in enumerate(steps):
                before = bridge.counters()
                seconds[i] += window_seconds(lambda: run_step(features, labels), args.steps, 1)  # noqa: B023
                counted[i].update({k: v - before[k] for k, v in bridge.counters().items()})
        sent = runtime.stats()["bytes_sent"] - sent_before
        allocations = bridge.counters()["staging_allocations"] - allocations_before
        no_ring = windows_without_the_ring(lambda: steps[0](features, labels), args.steps, args.repeats)
        lined_up = windows_without_the_ring(lambda: steps[0](features, labels), args.steps, args.repeats, True)
    finally:
        bridge._OVERLAP = default_overlap
    timed_steps = args.steps * args.repeats
    result = {
        "params": params,
        "step_s": seconds[0],
        "no_ring_step_s": no_ring,
        "lined_up_step_s": lined_up,
        "pack_s_per_step": counted[0]["pack_s"] / timed_steps,
        "ring_s_per_step": counted[0]["ring_s"] / timed_steps,
        "buckets_per_step": counted[0]["buckets"] / timed_steps,
        "sent_bytes_per_step": sent / (timed_steps * len(variants)),
        "staging_allocations_per_step": allocations / (timed_steps * len(variants)),
        "variants": [
            {
                "bucket_mib": v.bucket_mib,
                "overlap": v.overlap,
                "step_s": seconds[i],
                "buckets_per_step": counted[i]["buckets"] / timed_steps,
            }
            for i, v in enumerate(variants)
        ],
    }
    result["allreduce_s"] = measure_ours_allreduce(params, args.steps, args.repeats, args.warmup)
    result["bridge_s"] = measure_bridge(params, args.steps, args.repeats, args.warmup)
    result["bridge_tiny_s"] = measure_bridge(1, args.steps, args.repeats, args.warmup)
    result["function_call_s"] = measure_bridge(1, args.steps, args.repeats, args.warmup, crossings=0)
    return result


def worker_main(args: argparse.Namespace) -> int:
    """Measures every model; rank 0 rewrites ``args.results`` after each one."""
    if args.worker == "share":
        from elasticdl_strategy import runtime

        runtime.init()
        strategy, rank = None, runtime.rank()
    else:
        strategy, rank, _ = make_strategy(args.worker, bucket_bytes=bucket_bytes(args.bucket_mib[0]))
    report: Dict[str, dict] = {"models": {}, "errors": {}}
    for name in args.models:
        try:
            report["models"][name] = measure_model(args.worker, name, strategy, args)
        except Exception as e:  # record the model and go on with the next one
            traceback.print_exc()
            report["errors"][name] = describe(e)
        if rank == 0:
            write_json_atomically(args.results, report)
    if args.worker in (*OURS, "share"):
        from elasticdl_strategy import runtime

        runtime.barrier()  # nobody leaves while others still communicate
        runtime.shutdown()
    return 0


# ---------------------------------------------------------------------------
# Parent side: start the process(es) of one setup, collect its results
# ---------------------------------------------------------------------------


@dataclass
class Result:
    framework: str
    model: str
    data: dict = field(default_factory=dict)
    error: Optional[str] = None

    def median_ms(self, key: str = "step_s") -> float:
        return statistics.median(self.data[key]) * 1e3


def worker_commands(framework: str, workers: int, worker_args: List[str]) -> List[Command]:
    """(argv, env) of each process to start for one setup (MWMS with the thread counts our launcher sets)."""
    me = [sys.executable, os.path.abspath(__file__), "--worker", framework, *worker_args]
    if framework == "share":
        return setup_commands("ours", workers, me)
    return setup_commands("ours" if framework in OURS else framework, workers, me, OUR_PATH_ENV.get(framework))


def run_setup(framework: str, args: argparse.Namespace) -> List[Result]:
    """Starts the process(es) of ``framework``, waits for them, and returns one result per model."""
    with tempfile.TemporaryDirectory(prefix="train-step-bench-") as tmp:
        results, log = Path(tmp) / "results.json", Path(tmp) / "output.log"
        options = {
            "--models": ",".join(args.models),
            "--batch": args.batch,
            "--steps": args.steps,
            "--repeats": args.repeats,
            "--warmup": args.warmup,
            "--bucket-mib": ",".join(f"{m:g}" for m in args.bucket_mib),
            "--overlap": ",".join("on" if o else "off" for o in args.overlap),
            "--results": results,
        }
        worker_args = [str(item) for option in options.items() for item in option]
        started = time.monotonic()
        failure = run_processes(worker_commands(framework, args.workers, worker_args), log, results, args.timeout)
        report = json.loads(results.read_text()) if results.exists() else {"models": {}, "errors": {}}
        status = "ok" if failure is None else f"FAILED: {failure}"
        print(f"  {framework:<6}: {time.monotonic() - started:.1f} s, {status}", file=sys.stderr, flush=True)
        if failure is not None or report["errors"]:
            print(f"  last lines of its output:\n{log_tail(log)}", file=sys.stderr, flush=True)
    return [
        Result(
            framework,
            name,
            report["models"].get(name, {}),
            report["errors"].get(name) or (None if name in report["models"] else failure or "no result"),
        )
        for name in args.models
    ]


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def method_line(args: argparse.Namespace) -> str:
    return (
        f"Method: median of {args.repeats} windows of {args.steps} steps after {args.warmup} warmup steps; "
        f"global batch {args.batch} ({args.batch // args.workers} per worker), N = {args.workers} local worker "
        f"processes, float32, one synthetic batch re-fed every step, custom loop in tf.function(jit_compile=False), "
        f"Keras SGD; TF MWMS and ours with TF_NUM_INTRAOP_THREADS = OMP_NUM_THREADS = cores / N per worker "
        f"(what our launcher sets); machine: {os.cpu_count()} CPU cores (os.cpu_count())."
    )


def print_model(name: str, results: Sequence[Result], args: argparse.Namespace) -> None:
    by_framework = {r.framework: r for r in results}
    params = next((r.data["params"] for r in results if not r.error), None)
    size = f": {params:,} parameters ({format_mib(4 * params)} float32)" if params else ""
    print(f"\n{MODEL_TITLES[name]}{size}")
    print(f"{'setup':<38} | {'samples/s':>9} | {'ms/step':>8}")
    print("-" * 62)
    for r in results:
        head = f"{setup_title(r.framework, args.workers):<38} | "
        if r.error:
            print(head + f"error: {r.error[:100]}")
        else:
            print(head + f"{args.batch / r.median_ms() * 1e3:9.1f} | {r.median_ms():8.2f}")
    ours = by_framework.get("ours")
    if ours is None or ours.error:
        return
    print("Ratios (samples/s of ours / of the other; > 1 means ours is faster):")
    share, single = by_framework.get("share"), by_framework.get("single")
    if share is not None and single is not None and not share.error and not single.error:
        print(
            f"ceiling of data parallelism here ({args.workers} shares side by side, no all-reduce, vs single process): "
            f"{single.median_ms() / share.median_ms():.2f}×; ours reaches {share.median_ms() / ours.median_ms():.2f}× "
            "of that ceiling"
        )
    for mine in OURS:
        me = by_framework.get(mine)
        if me is None or me.error:
            continue
        for framework, title in (("tf", "MultiWorkerMirroredStrategy"), ("single", "single process")):
            other = by_framework.get(framework)
            if other is not None:
                ratio = "n/a" if other.error else f"{other.median_ms() / me.median_ms():.2f}×"
                print(f"{mine} vs {title}: {ratio}")
    step, comm = ours.median_ms(), ours.median_ms("allreduce_s")
    print(
        f"Breakdown of ours (ms/step): step {step:.2f} = gradient all-reduce {comm:.2f} "
        f"(runtime.allreduce of {format_mib(4 * ours.data['params'])} in one call, timed separately) "
        f"+ compute and the rest {step - comm:.2f}; "
        f"this rank sent {format_mib(ours.data['sent_bytes_per_step'])}/step; "
        f"{ours.data['buckets_per_step']:g} bucket all-reduce(s)/step (buckets <= {args.bucket_mib[0]:g} MiB); "
        f"staging buffers allocated per timed step (all variants): {ours.data['staging_allocations_per_step']:g}"
    )
    if "no_ring_step_s" in ours.data:
        alone, pack, ring, lined = (
            ours.median_ms("no_ring_step_s"),
            ours.data["pack_s_per_step"] * 1e3,
            ours.data["ring_s_per_step"] * 1e3,
            ours.median_ms("lined_up_step_s"),
        )
        reach = ""
        if single is not None and not single.error:
            ratio = single.median_ms() / lined
            reach = f": a synchronous step with a free all-reduce reaches {ratio:.2f}× of one process"
        print(
            f"  in the step (ms/step): packing the gradients into buckets {pack:.2f}, the buckets' all-reduces "
            f"{ring:.2f} (waiting for the slower worker included); the same step without the all-reduce "
            f"(gradients handed back unreduced, timed after the others) {alone:.2f}, and with a barrier in its "
            f"place (the workers wait for each other, nothing moves) {lined:.2f}{reach}"
        )
    call = ours.median_ms("function_call_s") if "function_call_s" in ours.data else 0.0
    print(
        f"  bridge (tf.function + identity tf.numpy_function, ms/call): {ours.median_ms('bridge_s'):.3f} "
        f"for {format_mib(4 * ours.data['params'])}, {ours.median_ms('bridge_tiny_s'):.3f} for 1 element; "
        f"the same tf.function without the numpy_function {call:.3f}, so one crossing costs "
        f"{ours.median_ms('bridge_tiny_s') - call:.3f}"
    )
    variants = ours.data.get("variants", [])
    if len(variants) > 1:
        print("Variants of ours (same processes, interleaved windows; ratio = samples/s over the first's):")
        first = statistics.median(variants[0]["step_s"])
        for v in variants:
            title = Variant(v["bucket_mib"], v["overlap"]).title
            median = statistics.median(v["step_s"])
            print(
                f"  {title:<58} | {args.batch / median:7.1f} samples/s | {median * 1e3:7.2f} ms/step | "
                f"{v['buckets_per_step']:g} buckets/step | {first / median:.2f}x"
            )


def write_json(path: str, args: argparse.Namespace, results: Sequence[Result]) -> None:
    data = {
        "method": method_line(args),
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "results": [
            {
                "framework": r.framework,
                "model": r.model,
                "error": r.error,
                **r.data,
                "median_ms_per_step": None if r.error else r.median_ms(),
                "samples_per_s": None if r.error else args.batch / r.median_ms() * 1e3,
            }
            for r in results
        ],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", type=_choice_list(MODELS), default=list(MODELS), help="default mlp,cnn")
    p.add_argument("--frameworks", type=_choice_list(FRAMEWORKS), default=list(FRAMEWORKS), help="default: all of them")
    p.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per window (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="timed windows; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--workers", type=int, default=2, help="worker processes for tf and ours (default 2)")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per setup (default 600)")
    p.add_argument(
        "--bucket-mib",
        type=_number_list,
        default=[64.0],
        help="ours: AllReduceStrategy(bucket_bytes=...) in MiB; a list (4,16,64) measures each (default 64)",
    )
    p.add_argument(
        "--overlap",
        type=_switch_list,
        default=[True],
        help="ours: on = one numpy_function per bucket, off = one for all; on,off measures both (default on)",
    )
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: worker mode
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)  # internal: where rank 0 writes
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.workers) < 1 or args.warmup < 0:
        p.error("--steps, --repeats and --workers must be >= 1, --warmup >= 0")
    if args.batch < args.workers or args.batch % args.workers:
        p.error(f"--batch must be a positive multiple of --workers ({args.workers})")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    sigterm_interrupts()
    print(method_line(args), flush=True)
    results: List[Result] = []

    def body() -> None:
        results.extend(r for fw in args.frameworks for r in run_setup(fw, args))
        for name in args.models:
            print_model(name, [r for r in results if r.model == name], args)

    def save() -> None:
        if args.json and results:
            write_json(args.json, args, results)

    return run_benchmark(body, save)


if __name__ == "__main__":
    sys.exit(main())
