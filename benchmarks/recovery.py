"""Recovery benchmark: SIGKILL -> first step after recovery, join -> first step with the new worker, and
SIGTERM -> first step without the leaver.

Usage::

    python benchmarks/recovery.py [--repeats 5] [--workers 3] [--batch 32] [--commit-every 5]
                                  [--optimizer adam] [--kill-step 150] [--leave-rank 1] [--json out.json]
                                  [--log-dir DIR]

Targets (issue 16): medians over >= 5 repeats at N = 3 with a model of >= 4 M parameters: kill <= 0.3 s,
join <= 0.6 s, leave <= 0.3 s (torchrun restarts take ~30 s).

Method: one job per repeat, run through the real launcher::

    python -m elasticdl_strategy run --workers N --min-workers N-1 --max-restarts 1 --heartbeat-timeout 3 \\
        -- python benchmarks/recovery.py --worker ...

Each worker builds the MLP of ``benchmarks/train_step.py`` (Dense 1024-2048-1024-10, 4.2 M parameters,
float32) and a Keras optimizer under ``AllReduceStrategy().scope()``, keeps them in
``elastic.KerasState`` with ``data.ElasticRecords`` (1 M records, ``--batch`` per worker) and trains
with a custom loop under ``elastic.run``: an ``elastic.function`` made once (a ``tf.function`` per
number of workers and rank, each trace reused when the job comes back to it; ``--fresh-traces``: a new
``tf.function`` in every membership) calling ``strategy.run`` (forward, loss, gradients,
``optimizer.apply_gradients``, which all-reduces), the loss fetched after every step so the step has
finished, ``state.commit()`` every ``--commit-every`` steps and when a leave is pending. Features are rows of a fixed
seeded table gathered by record index (``index % 4096``), labels ``index % 10``.

* Kill: before step ``--kill-step`` the worker of rank ``--kill-rank`` writes ``time.time()`` to the
  output directory and SIGKILLs itself. After every completed step each worker checks whether the
  membership version changed since its previous completed step; the first completed step in a new
  membership is written as an event (version, size, wall time). Recovery time = the later of the two
  survivors' first completed step at size N-1 minus the kill time. It includes failure detection,
  re-formation with the coordinator, the rollback to the last commit, the state sync from rank 0,
  re-tracing the step function and one step.
* Join: the launcher starts a replacement (a new worker id). It records ``time.time()`` just before
  constructing ``AllReduceStrategy()``, i.e. when it is ready to register: its process start and its
  TensorFlow/Keras import are NOT measured (seconds on a loaded machine; the survivors train on meanwhile).
  Join latency = the joiner's first completed step (at size N) minus that ready time. It includes the
  registration, the wait for the survivors' next commit (joins are admitted at commits), the
  re-formation, building the model on the joiner (``AllReduceStrategy()`` returns once registered: the
  joiner builds while it waits to be admitted, and the others wait for it in the sync), the state sync,
  tracing the step function and one step.
* Leave: ``--leave-after`` steps after the job is back to N workers, the worker of rank ``--leave-rank``
  writes ``time.time()`` and sends itself SIGTERM. The loop asks ``state.leave_pending()`` after every
  step (one small all-reduce) and commits when it is true: the leaver leaves at that commit, the others
  re-form without it (no rollback). Leave time = the later survivor's first completed step at size N-1
  after it minus the SIGTERM time. It includes the rest of the step in flight, the vote and the
  commit, the re-formation, the sync, tracing the step function (unless traced ahead or reused)
  and one step.
* The job ends ``--steps-after-join`` steps after the leave (``--max-steps`` caps a job whose
  replacement never joins); the parent kills every process it started, by pid, afterwards.

The breakdown comes from more events of the same workers: ``step_failed`` = a survivor's step raised
(the failure reached the training loop), ``sync_start`` = a state sync began (``all_in_sync``: the
last member of the new membership began it), ``synced`` = ``elastic.run`` called the training
function again (re-formed, rolled back and synced), ``admitted`` = the joiner got a membership with it
(seen by a thread of its own), ``built`` = its model and optimizer existed (the breakdown gives both from
ready, then the rest from the later of the two),
``leave_commit`` = a survivor began the commit the leaver leaves at (re-forming follows),
``first_batch`` = the training function's input pipeline gave its first batch (from ``synced``:
building the pipeline of the new membership; from there to ``step``: the step function's first
call in that membership and one step).
Each worker's log lines get timestamps; the report repeats the library's recovery lines
("re-formed in", "training continues ... after the failure"). ``--log-dir`` keeps whole logs.
All times are ``time.time()`` on one machine. A measurement a repeat could not make is left out of
the medians; a job that failed after making them still counts (its failure is shown next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)
from _common import log_tail, run_benchmark, sigterm_interrupts  # noqa: E402
from train_step import INPUT_SHAPES, NUM_CLASSES, build_model  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "mlp"
NUM_RECORDS = 1_000_000  # an epoch far longer than a job
TABLE_ROWS = 4096  # distinct feature rows (16 MiB float32)
LEARNING_RATE = 1e-3
MARKER = "EDL_RECOVERY_BENCH"  # in the environment of every process of a job, to find them by pid
STOP_GRACE_S = 15.0
OPTIMIZERS = {"adam": lambda keras: keras.optimizers.Adam, "sgd": lambda keras: keras.optimizers.SGD}
LOG_PATTERNS = ("re-formed in", "training continues", "joined at commit", "in its place", "killing myself", "SIGTERM")
TARGETS_S = {"kill": 0.3, "join": 0.6, "leave": 0.3}  # issue 16


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


class Events:
    """Appends JSON events (one a line) to ``OUT/events-WORKER.jsonl``; one open/write/close per event."""

    def __init__(self, out_dir: Path, worker_id: str):
        self.path = out_dir / f"events-{worker_id}.jsonl"
        self.worker_id = worker_id

    def write(self, kind: str, when: Optional[float] = None, **data: Any) -> None:
        event = {"kind": kind, "worker": self.worker_id, "time": time.time() if when is None else when, **data}
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")


def feature_table():
    """The fixed feature rows (same on every worker) that records are mapped to."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    return tf.constant(rng.standard_normal((TABLE_ROWS, *INPUT_SHAPES[MODEL]), dtype=np.float32))


def make_step(strategy, model, optimizer, table, batch: int, trace_ahead: bool) -> Callable[[Any], float]:
    """A function running one training step on a batch of record indices; returns the local loss.

    Made once: ``elastic.function`` traces it once per (number of workers, rank) and reuses that trace
    whenever the job comes back to the same shape (``--fresh-traces``: a new ``tf.function`` in every
    membership, as before it existed).
    """
    import keras
    import tensorflow as tf

    from elasticdl_strategy import elastic, runtime

    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(indices):
        features = tf.gather(table, indices % TABLE_ROWS)
        labels = tf.cast(indices % NUM_CLASSES, tf.int32)
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            # The global batch is read while tracing: one trace per number of workers.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch * runtime.size())
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    # A def, not a lambda: to convert a lambda, AutoGraph parses its whole source file (this one),
    # which cost a newcomer's first step 0.12-0.16 s more.
    def distributed_step(indices):
        return strategy.run(replica_step, args=(indices,))

    step = elastic.function(distributed_step, trace_ahead=trace_ahead, jit_compile=False)
    return lambda indices: float(strategy.experimental_local_results(step(indices))[0])


def step_maker(args: argparse.Namespace, strategy, model, optimizer, table) -> Callable[[], Callable[[Any], float]]:
    """What the training function calls on entry for its step: the one made here, or a new one each time."""
    if args.fresh_traces:
        return lambda: make_step(strategy, model, optimizer, table, args.batch, trace_ahead=False)
    step = make_step(strategy, model, optimizer, table, args.batch, trace_ahead=not args.no_trace_ahead)
    return lambda: step


class StepWatch:
    """Writes an event at the first completed step in each membership, and times steps per membership size."""

    def __init__(self, events: Events):
        self.events = events
        self.version: Optional[int] = None
        self.seconds: Dict[int, List[float]] = {}

    def completed(self, step: int, seconds: float) -> None:
        from elasticdl_strategy import runtime

        version = runtime.current_worker().membership.version
        size = runtime.size()
        self.seconds.setdefault(size, []).append(seconds)
        if version != self.version:
            self.events.write("first_step", version=version, size=size, rank=runtime.rank(), step=step, seconds=seconds)
            self.version = version

    def summary(self) -> Dict[str, float]:
        """Median step seconds per membership size (the first 3 steps of each size left out: tracing)."""
        return {str(size): statistics.median(s[3:] or s) for size, s in self.seconds.items()}


def kill_if_targeted(args: argparse.Namespace, events: Events, step: int) -> None:
    """SIGKILLs this process before ``--kill-step`` if it is rank ``--kill-rank`` (once per job)."""
    from elasticdl_strategy import runtime

    done = args.out / "killed"
    if step != args.kill_step or runtime.rank() != args.kill_rank or done.exists():
        return
    done.touch()
    events.write("kill", step=step, rank=runtime.rank())
    os.kill(os.getpid(), signal.SIGKILL)


def leave_if_targeted(args: argparse.Namespace, events: Events, step: int, regrown_at: Optional[int]) -> None:
    """Sends this process SIGTERM ``--leave-after`` steps after the job regrew, if it is rank
    ``--leave-rank`` (once per job): ``elastic.run`` turns it into a graceful leave."""
    from elasticdl_strategy import runtime

    done = args.out / "left"
    due = regrown_at is not None and step == regrown_at + args.leave_after
    if not due or runtime.rank() != args.leave_rank or done.exists():
        return
    done.touch()
    events.write("leave", step=step, rank=runtime.rank())
    os.kill(os.getpid(), signal.SIGTERM)


def make_state(elastic, events: Events, model, optimizer, records):
    """An ``elastic.KerasState`` that also writes a ``sync_start`` event whenever a state sync begins."""
    from elasticdl_strategy import runtime

    class TimedState(elastic.KerasState):
        def _prepare_sync(self) -> None:
            version = runtime.current_worker().membership.version
            events.write("sync_start", version=version, size=runtime.size())
            super()._prepare_sync()

    return TimedState(model, optimizer, records=records, steps=0)


def write_when_admitted(events: Events) -> None:
    """Writes the ``admitted`` event, from a thread of its own, once this worker is in a membership:
    a joiner's ``AllReduceStrategy()`` returns when registered, and it builds its model meanwhile."""
    import threading

    from elasticdl_strategy import runtime

    def wait() -> None:
        worker = runtime.current_worker()  # waits for the admission
        events.write("admitted", version=worker.membership.version, size=runtime.size(), rank=runtime.rank())

    threading.Thread(target=wait, name="bench-admitted", daemon=True).start()


def worker_main(args: argparse.Namespace) -> int:
    import logging

    import keras
    import tensorflow as tf  # noqa: F401  (imported before the ready time: not part of the join latency)

    from elasticdl_strategy import AllReduceStrategy, data, elastic, runtime

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", force=True)  # timestamps
    logging.getLogger("elasticdl_strategy").setLevel(logging.INFO)  # the recovery lines (LOG_PATTERNS)
    events = Events(args.out, os.environ.get("EDL_WORKER_ID", "local"))
    ready = time.time()
    strategy = AllReduceStrategy()
    events.write("ready", when=ready, joined_running_job=runtime.joined_running_job())
    write_when_admitted(events)
    with strategy.scope():
        model = build_model(MODEL)
        optimizer = OPTIMIZERS[args.optimizer](keras)(learning_rate=LEARNING_RATE)
    table = feature_table()
    events.write("built", params=int(sum(v.numpy().size for v in model.trainable_variables)))
    records = data.ElasticRecords(NUM_RECORDS, batch_size=args.batch, seed=1)
    state = make_state(elastic, events, model, optimizer, records)
    watch = StepWatch(events)
    new_step = step_maker(args, strategy, model, optimizer, table)

    @elastic.run
    def train(state) -> None:
        # Every worker gets here together, with the state just synced from rank 0: they agree on the
        # phase. (Not a state value: a rollback to a commit from before the kill would lose it.)
        left = (args.out / "left").exists()
        regrown_at = state.steps if runtime.size() == args.workers and (args.out / "killed").exists() else None
        end_at = min(args.max_steps, state.steps + args.steps_after_join) if left else args.max_steps
        events.write("synced", version=runtime.current_worker().membership.version, size=runtime.size())
        step = new_step()
        first_batch = True
        while state.steps < end_at:
            for indices in records.dataset():
                if first_batch:  # the input pipeline of this membership is built and gave its first batch
                    events.write("first_batch", version=runtime.current_worker().membership.version)
                    first_batch = False
                kill_if_targeted(args, events, state.steps)
                leave_if_targeted(args, events, state.steps, None if left else regrown_at)
                started = time.perf_counter()
                try:
                    step(indices)
                except Exception as error:  # re-raised: elastic.run recovers; the event times the detection
                    events.write("step_failed", error=type(error).__name__)
                    raise
                state.steps += 1
                watch.completed(state.steps, time.perf_counter() - started)
                epoch = records.epoch
                records.advance()
                if state.leave_pending():
                    events.write("leave_commit", version=runtime.current_worker().membership.version)
                    state.commit()  # the leaver leaves here; the others re-form without it
                elif state.steps % args.commit_every == 0 or records.epoch != epoch:
                    state.commit()
                if state.steps >= end_at:
                    break
        state.commit()  # everyone is done with the last step before anyone leaves

    train(state)
    events.write("done", steps=state.steps, size=runtime.size(), step_seconds=watch.summary())
    return 0


# ---------------------------------------------------------------------------
# Parent side: one job per repeat through the real launcher
# ---------------------------------------------------------------------------


@dataclass
class Repeat:
    index: int
    kill_s: Optional[float] = None  # SIGKILL -> first completed step at size N-1
    join_s: Optional[float] = None  # joiner ready -> its first completed step at size N
    leave_s: Optional[float] = None  # SIGTERM -> first completed step at size N-1 without the leaver
    breakdown: Dict[str, float] = field(default_factory=dict)
    step_ms: Dict[str, float] = field(default_factory=dict)
    params: Optional[int] = None
    log_lines: List[str] = field(default_factory=list)
    error: Optional[str] = None


def marked_pids(marker: str) -> List[int]:
    """Pids of the processes whose environment holds ``MARKER=marker`` (the job's, even re-parented)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def stop_job(launcher: subprocess.Popen, marker: str) -> None:
    """SIGTERM to the launcher (it stops its workers), then SIGKILL to every process of the job that is left."""
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=STOP_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait(timeout=STOP_GRACE_S)


def job_argv(args: argparse.Namespace, out: Path) -> List[str]:
    worker = [
        sys.executable, os.path.abspath(__file__), "--worker", "--out", str(out),
        "--workers", str(args.workers), "--batch", str(args.batch), "--commit-every", str(args.commit_every),
        "--optimizer", args.optimizer, "--kill-step", str(args.kill_step), "--kill-rank", str(args.kill_rank),
        "--steps-after-join", str(args.steps_after_join), "--max-steps", str(args.max_steps),
        "--leave-rank", str(args.leave_rank), "--leave-after", str(args.leave_after),
        *(["--fresh-traces"] if args.fresh_traces else []),
        *(["--no-trace-ahead"] if args.no_trace_ahead else []),
    ]  # fmt: skip
    return [
        sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(args.workers),
        "--min-workers", str(args.workers - 1), "--max-restarts", "1",
        "--heartbeat-timeout", str(args.heartbeat_timeout), "--rendezvous-timeout", "60", "--", *worker,
    ]  # fmt: skip


def run_job(args: argparse.Namespace, out: Path, log: Path) -> Optional[str]:
    """Runs one job to its end; returns why it failed (exit code or timeout), or None."""
    marker = uuid.uuid4().hex
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(
        os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2"
    )
    env[MARKER] = marker
    with open(log, "wb") as sink:
        launcher = subprocess.Popen(
            job_argv(args, out), env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = launcher.wait(timeout=args.timeout)
            return None if code == 0 else f"the launcher exited with code {code}"
        except subprocess.TimeoutExpired:
            return f"timed out after {args.timeout:g} s"
        finally:
            stop_job(launcher, marker)


def read_events(out: Path) -> List[dict]:
    events = []
    for path in sorted(out.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


def first(events: Sequence[dict], **match: Any) -> Optional[dict]:
    """The earliest event with all the given fields."""
    found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
    return min(found, key=lambda e: e["time"]) if found else None


def measure_kill(events: Sequence[dict], workers: int, repeat: Repeat) -> None:
    kill = first(events, kind="kill")
    if kill is None:
        raise RuntimeError("no kill event")
    survivors = {e["worker"] for e in events if e["kind"] == "first_step" and e["size"] == workers - 1}
    steps = [first([e for e in events if e["time"] > kill["time"]], kind="first_step", worker=w) for w in survivors]
    steps = [s for s in steps if s is not None and s["size"] == workers - 1]
    if not steps:
        raise RuntimeError("no completed step at the reduced size after the kill")
    last = max(steps, key=lambda e: e["time"])
    after = [e for e in events if e["time"] > kill["time"]]
    repeat.kill_s = last["time"] - kill["time"]
    failed = [first(after, kind="step_failed", worker=w) for w in survivors]
    marks = [("kill", kill), ("both_failed", latest([f for f in failed if f is not None]))]
    marks.append(
        ("all_in_sync", latest([e for e in after if e["kind"] == "sync_start" and e["version"] == last["version"]]))
    )
    marks += [
        ("synced", first(after, kind="synced", worker=last["worker"])),
        ("first_batch", first(after, kind="first_batch", worker=last["worker"])),
        ("step", last),
    ]
    add_breakdown(repeat, "kill: ", marks)


def latest(events: Sequence[dict]) -> Optional[dict]:
    return max(events, key=lambda e: e["time"]) if events else None


def measure_join(events: Sequence[dict], workers: int, repeat: Repeat) -> None:
    joiner = first(events, kind="ready", joined_running_job=True)
    if joiner is None:
        raise RuntimeError("no replacement worker got ready")
    mine = [e for e in events if e["worker"] == joiner["worker"]]
    step = first(mine, kind="first_step", size=workers)
    if step is None:
        raise RuntimeError(f"{joiner['worker']} never completed a step at size {workers}")
    repeat.join_s = step["time"] - joiner["time"]
    # The sync starts for real when the last member of the new membership enters it.
    all_in = latest([e for e in events if e["kind"] == "sync_start" and e["version"] == step["version"]])
    # Admission and model building overlap (both from ready); the sync needs both.
    admitted, built = first(mine, kind="admitted"), first(mine, kind="built")
    add_breakdown(repeat, "join: ", [("ready", joiner), ("admitted", admitted)])
    add_breakdown(repeat, "join: ", [("ready", joiner), ("built", built)])
    both = latest([e for e in (admitted, built) if e is not None])
    marks = [
        ("admitted+built", both),
        ("all_in_sync", all_in),
        ("synced", first(mine, kind="synced")),
        ("first_batch", first(mine, kind="first_batch")),
        ("step", step),
    ]
    add_breakdown(repeat, "join: ", marks)


def measure_leave(events: Sequence[dict], workers: int, repeat: Repeat) -> None:
    leave = first(events, kind="leave")
    if leave is None:
        raise RuntimeError("no leave event")
    after = [e for e in events if e["time"] > leave["time"]]
    steps = [e for e in after if e["kind"] == "first_step" and e["size"] == workers - 1]
    survivors = {e["worker"] for e in steps}
    firsts = [first(steps, worker=w) for w in survivors]
    if not firsts:
        raise RuntimeError("no completed step at the reduced size after the leave")
    last = max(firsts, key=lambda e: e["time"])
    repeat.leave_s = last["time"] - leave["time"]
    committing = latest([e for w in survivors if (e := first(after, kind="leave_commit", worker=w)) is not None])
    all_in = latest([e for e in after if e["kind"] == "sync_start" and e["version"] == last["version"]])
    marks = [("leave", leave), ("commit_started", committing), ("all_in_sync", all_in)]
    marks += [
        ("synced", first(after, kind="synced", worker=last["worker"])),
        ("first_batch", first(after, kind="first_batch", worker=last["worker"])),
        ("step", last),
    ]
    add_breakdown(repeat, "leave: ", marks)


def add_breakdown(repeat: Repeat, prefix: str, marks: Sequence[tuple]) -> None:
    """Adds the time between each two consecutive (name, event) marks that both happened."""
    present = [(name, event) for name, event in marks if event is not None]
    for (a, ea), (b, eb) in zip(present[:-1], present[1:], strict=True):
        repeat.breakdown[f"{prefix}{a}->{b}"] = eb["time"] - ea["time"]


def analyse(index: int, out: Path, log: Path, workers: int, failure: Optional[str]) -> Repeat:
    repeat = Repeat(index)
    events = read_events(out)
    repeat.log_lines = [
        line.strip() for line in log.read_text(errors="replace").splitlines() if any(p in line for p in LOG_PATTERNS)
    ]
    built = first(events, kind="built")
    repeat.params = built["params"] if built else None
    done = [e for e in events if e["kind"] == "done" and e["step_seconds"]]
    if done:
        longest = max(done, key=lambda e: len(e["step_seconds"]))
        repeat.step_ms = {size: s * 1e3 for size, s in longest["step_seconds"].items()}
    errors = [failure] if failure else []
    for measure in (measure_kill, measure_join, measure_leave):
        try:
            measure(events, workers, repeat)
        except RuntimeError as e:
            errors.append(str(e))
    repeat.error = "; ".join(errors) or None
    return repeat


def run_repeat(index: int, args: argparse.Namespace) -> Repeat:
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        out = Path(tmp)
        log = (args.log_dir / f"repeat-{index}.log") if args.log_dir else out / "output.log"
        started = time.monotonic()
        failure = run_job(args, out, log)
        repeat = analyse(index, out, log, args.workers, failure)
        if args.log_dir:  # the workers' events beside the log, one JSON line each, in time order
            lines = [json.dumps(e) for e in sorted(read_events(out), key=lambda e: e["time"])]
            (args.log_dir / f"repeat-{index}-events.jsonl").write_text("\n".join(lines) + "\n")
        status = "ok" if repeat.error is None else f"FAILED: {repeat.error}"
        print(f"  repeat {index}: {time.monotonic() - started:.1f} s, {status}", file=sys.stderr, flush=True)
        if repeat.error:
            print(f"  last lines of its output:\n{log_tail(log)}", file=sys.stderr, flush=True)
    return repeat


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def method_line(args: argparse.Namespace, params: Optional[int]) -> str:
    model = f"MLP 1024-2048-1024-10 ({params:,} parameters)" if params else "MLP 1024-2048-1024-10"
    return (
        f"Method: {args.repeats} jobs through `elasticdl_strategy run --workers {args.workers} "
        f"--min-workers {args.workers - 1} --max-restarts 1 --heartbeat-timeout {args.heartbeat_timeout:g}`; "
        f"{model}, Keras {args.optimizer}, batch {args.batch} per worker, commit every {args.commit_every} steps; "
        f"rank {args.kill_rank} SIGKILLs itself before step {args.kill_step}; kill = the survivors' first completed "
        f"step after it (the later one) - kill time; join = the replacement's first completed step - its ready time "
        f"(just before AllReduceStrategy(); process start and TensorFlow import not counted); rank {args.leave_rank} "
        f"SIGTERMs itself {args.leave_after} steps after the join; leave = the survivors' first completed step "
        f"without it (the later one) - SIGTERM time; step: "
        f"{step_kind(args)}; "
        f"machine: {os.cpu_count()} CPU cores (os.cpu_count())."
    )


def fmt(seconds: Optional[float]) -> str:
    return f"{seconds:7.2f}" if seconds is not None else "      -"


def median_of(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def verdict(value: Optional[float], target: float) -> str:
    return "n/a" if value is None else ("PASS" if value <= target else "MISS")


def step_kind(args: argparse.Namespace) -> str:
    if args.fresh_traces:
        return "a new tf.function per membership"
    return "one elastic.function, traces reused" + (", not traced ahead" if args.no_trace_ahead else ", traced ahead")


def medians(repeats: Sequence[Repeat]) -> Dict[str, Optional[float]]:
    return {kind: median_of([getattr(r, f"{kind}_s") for r in repeats]) for kind in TARGETS_S}


def print_report(repeats: Sequence[Repeat], args: argparse.Namespace) -> None:
    print(f"\n{'repeat':>6} | {'kill->step s':>12} | {'join->step s':>12} | {'leave->step s':>13} | step ms by size")
    print("-" * 88)
    for r in repeats:
        steps = ", ".join(f"N={n}: {ms:.0f}" for n, ms in sorted(r.step_ms.items()))
        error = f"  [{r.error}]" if r.error else ""
        print(f"{r.index:>6} | {fmt(r.kill_s):>12} | {fmt(r.join_s):>12} | {fmt(r.leave_s):>13} | {steps}{error}")
    median = medians(repeats)
    print("-" * 88)
    print(f"{'median':>6} | {fmt(median['kill']):>12} | {fmt(median['join']):>12} | {fmt(median['leave']):>13} |")
    for kind, target in TARGETS_S.items():
        print(f"{kind}: median {fmt(median[kind]).strip()} s, target <= {target:g} s: {verdict(median[kind], target)}")
    print(
        "\nBreakdown (s): kill: both_failed = the later survivor's step raised, all_in_sync = the last member "
        "entered the state sync, synced/step = the later survivor's; join: the joiner's events, all_in_sync as "
        "above; leave: commit_started = the later survivor began the commit the leaver leaves at"
    )
    for r in repeats:
        for prefix in ("kill: ", "join: ", "leave: "):
            parts = [f"{k[len(prefix) :]} {v:.2f}" for k, v in r.breakdown.items() if k.startswith(prefix)]
            if parts:
                print(f"  repeat {r.index} {prefix}{', '.join(parts)}")
    for r in repeats:
        if r.log_lines:
            print(f"\nrepeat {r.index}, recovery lines of the log:")
            print("\n".join("  " + line[:240] for line in r.log_lines))


def write_json(path: str, args: argparse.Namespace, repeats: Sequence[Repeat]) -> None:
    params = next((r.params for r in repeats if r.params), None)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {
        "method": method_line(args, params),
        "cpu_count": os.cpu_count(),
        "options": options,
        "params": params,
        **{f"median_{kind}_s": value for kind, value in medians(repeats).items()},
        "repeats": [asdict(r) for r in repeats],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="jobs, one measurement of each kind per job (default 5)")
    p.add_argument("--workers", type=int, default=3, help="N, workers at the start (default 3)")
    p.add_argument("--batch", type=int, default=32, help="batch per worker (default 32)")
    p.add_argument("--commit-every", type=int, default=5, help="steps between commits (default 5)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="Keras optimizer (default adam)")
    p.add_argument("--kill-step", type=int, default=150, help="the victim dies before this step (default 150)")
    p.add_argument("--kill-rank", type=int, default=2, help="rank of the victim (default 2)")
    p.add_argument("--leave-rank", type=int, default=1, help="rank that leaves by SIGTERM after the join (default 1)")
    p.add_argument("--leave-after", type=int, default=150, help="steps after the join before it leaves (default 150)")
    p.add_argument("--steps-after-join", type=int, default=20, help="steps after the leave (default 20)")
    p.add_argument("--fresh-traces", action="store_true", help="a new tf.function per membership (retraces)")
    p.add_argument("--no-trace-ahead", action="store_true", help="elastic.function(trace_ahead=False)")
    p.add_argument("--max-steps", type=int, default=1000, help="end a job by then, joined or not (default 1000)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="launcher --heartbeat-timeout (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job (default 300)")
    p.add_argument("--json", metavar="PATH", help="write all numbers to PATH")
    p.add_argument("--log-dir", type=Path, help="keep each job's output and events as DIR/repeat-I.log, -events.jsonl")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: worker mode
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # internal: where workers write events
    args = p.parse_args(argv)
    if args.workers < 2 or not 0 <= args.kill_rank < args.workers or not 0 <= args.leave_rank < args.workers:
        p.error("--workers must be >= 2, --kill-rank and --leave-rank in 0..workers-1")
    if min(args.repeats, args.batch, args.commit_every, args.steps_after_join, args.leave_after) < 1:
        p.error("--repeats, --batch, --commit-every, --steps-after-join and --leave-after must be >= 1")
    if args.kill_step < 1 or args.max_steps <= args.kill_step:
        p.error("--kill-step must be >= 1 and below --max-steps")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    sigterm_interrupts()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    print(method_line(args, None), flush=True)
    repeats: List[Repeat] = []

    def body() -> None:
        for index in range(args.repeats):
            repeats.append(run_repeat(index, args))
        params = next((r.params for r in repeats if r.params), None)
        if params:
            print(f"model: {params:,} parameters ({4 * params / (1 << 20):.1f} MiB float32)")
        print_report(repeats, args)

    def save() -> None:
        if args.json and repeats:
            write_json(args.json, args, repeats)

    return run_benchmark(body, save)


if __name__ == "__main__":
    sys.exit(main())
