"""All-reduce benchmark: elasticdl_strategy.collective vs torch.distributed (gloo) vs TensorFlow.

Usage::

    python benchmarks/allreduce.py [--sizes 4KiB,256KiB,4MiB,64MiB] [--workers 2,4]
                                   [--repeats 20] [--frameworks ours,gloo,tf] [--json out.json]

Frameworks:
    ours  ``collective.allreduce(x, out=x)``, workers started by ``python -m elasticdl_strategy run``
    gloo  ``torch.distributed.all_reduce`` on the gloo backend (skipped when torch is not installed)
    tf    ``tf.distribute.MultiWorkerMirroredStrategy`` with the RING implementation, a replica-context
          ``all_reduce`` inside ``strategy.run`` of a ``tf.function`` (out-of-place: TF has no in-place form)

Method: for every framework and worker count N, this script starts N local worker
processes running itself in ``--worker FRAMEWORK`` mode. Each worker goes through the
sizes in order; per size it fills a float32 buffer with ones, runs ``--warmup`` untimed
all-reduces, then ``--repeats`` timed ones (fewer for 64 MiB and up, see
:func:`repeats_for`). Before each timed call the buffer is refilled and all ranks meet
in a barrier; only the all-reduce itself is timed with ``time.perf_counter`` (for TF
this includes fetching the local result with ``.numpy()``, so the call has finished).
The last result is checked to equal N everywhere sampled. Rank 0 writes the per-size
lists of seconds to a JSON file that the parent reads back.

Reported per cell: median and min time, algbw = bytes / median and
busbw = algbw * 2(N-1)/N (the bytes each rank moves in a ring all-reduce, as in
nccl-tests). The ratio lines are other_median / ours_median: above 1 means ours is faster.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

FRAMEWORKS = ("ours", "gloo", "tf")
DEFAULT_SIZES = "4KiB,256KiB,4MiB,64MiB"
DEFAULT_WORKERS = "2,4"
LARGE_BYTES = 64 << 20  # sizes from here on get fewer repeats
RUN_TIMEOUT_S = 600.0  # per framework and worker count
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping a process
LOG_TAIL_LINES = 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


# ---------------------------------------------------------------------------
# Sizes and repeats
# ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096; accepts B, K/KiB, M/MiB, G/GiB (binary units); a multiple of 4 bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4KiB, 256KiB, 4MiB, 64MiB)")
    nbytes = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return nbytes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def repeats_for(nbytes: int, repeats: int) -> int:
    """Timed calls for one size: ``repeats``, or max(5, repeats // 4) from 64 MiB on."""
    return max(5, repeats // 4) if nbytes >= LARGE_BYTES else repeats


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size_list(text: str) -> List[int]:
    return [parse_size(v) for v in text.split(",") if v.strip()]


def _framework_list(text: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown framework(s) {unknown} (choose from {', '.join(FRAMEWORKS)})")
    return names


# ---------------------------------------------------------------------------
# Worker side: one backend per framework, the same timing loop for all
# ---------------------------------------------------------------------------


class Backend(Protocol):
    rank: int
    size: int

    def prepare(self, count: int) -> None:
        """Allocates the float32 buffer of ``count`` elements."""

    def refill(self) -> None:
        """Resets the input to ones (outside the timed region)."""

    def allreduce(self) -> None:
        """One sum all-reduce of the buffer; returns when the local result is available."""

    def result(self) -> np.ndarray:
        """The result of the last all-reduce."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class OursBackend:
    def __init__(self) -> None:
        from elasticdl_strategy import collective

        self._c = collective
        collective.init()
        self.rank, self.size = collective.rank(), collective.size()
        self._x = np.zeros(0, np.float32)

    def prepare(self, count: int) -> None:
        self._x = np.ones(count, np.float32)

    def refill(self) -> None:
        self._x.fill(1.0)

    def allreduce(self) -> None:
        self._c.allreduce(self._x, op="sum", out=self._x)

    def result(self) -> np.ndarray:
        return self._x

    def barrier(self) -> None:
        self._c.barrier()

    def close(self) -> None:
        self._c.shutdown()


class GlooBackend:
    """torch.distributed with the gloo backend; rendezvous from MASTER_ADDR/PORT, RANK, WORLD_SIZE."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self._torch, self._dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._x = np.zeros(0, np.float32)
        self._t = torch.from_numpy(self._x)

    def prepare(self, count: int) -> None:
        self._x = np.ones(count, np.float32)
        self._t = self._torch.from_numpy(self._x)  # shares memory with self._x

    def refill(self) -> None:
        self._x.fill(1.0)

    def allreduce(self) -> None:
        self._dist.all_reduce(self._t)

    def result(self) -> np.ndarray:
        return self._x

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        self._dist.destroy_process_group()


class TFBackend:
    """MultiWorkerMirroredStrategy (RING) from TF_CONFIG; one CPU replica per worker."""

    def __init__(self) -> None:
        import tensorflow as tf

        self._tf = tf
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
        self._strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        self.rank = int(self._strategy.cluster_resolver.task_id)
        self.size = int(self._strategy.num_replicas_in_sync)
        self._step = tf.function(self._replicated_sum)
        self._token = tf.ones([1], tf.float32)
        self._x = self._token
        self._out = np.zeros(0, np.float32)

    def _replicated_sum(self, x):
        tf = self._tf

        def replica_fn(value):
            # identity places the input on this replica's device: all_reduce needs a device to reduce to
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(value))

        return self._strategy.run(replica_fn, args=(x,))

    def _run(self, x) -> np.ndarray:
        return self._strategy.experimental_local_results(self._step(x))[0].numpy()

    def prepare(self, count: int) -> None:
        self._x = self._tf.ones([count], self._tf.float32)

    def refill(self) -> None:
        pass  # the input tensor is never modified: TF's all-reduce is out-of-place

    def allreduce(self) -> None:
        self._out = self._run(self._x)

    def result(self) -> np.ndarray:
        return self._out

    def barrier(self) -> None:
        self._run(self._token)  # a tiny all-reduce

    def close(self) -> None:
        pass


BACKENDS = {"ours": OursBackend, "gloo": GlooBackend, "tf": TFBackend}


def measure(backend: Backend, count: int, repeats: int, warmup: int) -> List[float]:
    """Seconds of ``repeats`` all-reduces of ``count`` float32 after ``warmup`` untimed ones."""
    backend.prepare(count)
    for _ in range(warmup):
        backend.refill()
        backend.allreduce()
    seconds = []
    for _ in range(repeats):
        backend.refill()
        backend.barrier()
        start = time.perf_counter()
        backend.allreduce()
        seconds.append(time.perf_counter() - start)
    result = backend.result()
    sample = result[[0, count // 2, count - 1]]
    if not np.all(sample == backend.size):
        raise RuntimeError(f"wrong all-reduce result: sampled {sample.tolist()}, expected {backend.size}")
    return seconds


def _describe(error: Exception, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def worker_main(framework: str, sizes: Sequence[int], repeats: int, warmup: int, results: Path) -> int:
    """Runs every size; rank 0 rewrites ``results`` after each one (so a crash keeps earlier sizes)."""
    backend: Backend = BACKENDS[framework]()
    report: Dict[str, dict] = {"seconds": {}, "errors": {}}
    for nbytes in sizes:
        try:
            report["seconds"][str(nbytes)] = measure(backend, nbytes // 4, repeats_for(nbytes, repeats), warmup)
        except Exception as e:  # record the cell and go on with the next size
            traceback.print_exc()
            report["errors"][str(nbytes)] = _describe(e)
        if backend.rank == 0:
            _write_json(results, report)
    backend.barrier()  # nobody leaves while others still communicate
    backend.close()
    return 0


# ---------------------------------------------------------------------------
# Parent side: start the workers of one (framework, N) run and collect results
# ---------------------------------------------------------------------------


@dataclass
class Cell:
    framework: str
    workers: int
    nbytes: int
    seconds: List[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def algbw(self) -> float:
        return self.nbytes / self.median / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.workers - 1) / self.workers


def free_ports(count: int) -> List[int]:
    """``count`` distinct ports that were free a moment ago (bound to port 0 together)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_commands(framework: str, workers: int, worker_args: List[str]) -> List[Tuple[List[str], Dict[str, str]]]:
    """(argv, env) of each process to start for one run."""
    me = [sys.executable, os.path.abspath(__file__), "--worker", framework, *worker_args]
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    if framework == "ours":
        return [([sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(workers), "--", *me], base)]
    if framework == "gloo":
        port = free_ports(1)[0]
        common = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(workers))
        return [(me, dict(common, RANK=str(i))) for i in range(workers)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    common = dict(base, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    return [
        (me, dict(common, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
        for i in range(workers)
    ]


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each process group by pid, then SIGKILL what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # each child leads its own session, so pgid == pid
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> Optional[str]:
    """Waits for all processes; returns why the run failed (a non-zero exit or the timeout), or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return f"process {failed[0][0]} exited with code {failed[0][1]}"
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.1)
    return f"timed out after {timeout:g} s"


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in text[-lines:])


def run_one(framework: str, workers: int, args: argparse.Namespace) -> List[Cell]:
    """Starts the N workers of ``framework``, waits for them, and returns one cell per size."""
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmp:
        results, log = Path(tmp) / "results.json", Path(tmp) / "output.log"
        worker_args = [
            "--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--results", str(results),
        ]  # fmt: skip
        procs: List[subprocess.Popen] = []
        started = time.monotonic()
        try:
            with open(log, "wb") as out:
                for argv, env in worker_commands(framework, workers, worker_args):
                    procs.append(
                        subprocess.Popen(
                            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )  # fmt: skip
                failure = wait_all(procs, args.timeout)
        finally:
            stop(procs)
        report = json.loads(results.read_text()) if results.exists() else {"seconds": {}, "errors": {}}
        elapsed = time.monotonic() - started
        status = "ok" if failure is None else f"FAILED: {failure}"
        print(f"  {framework:<4} N={workers}: {elapsed:.1f} s, {status}", file=sys.stderr, flush=True)
        if failure is not None or report["errors"]:
            print(f"  last lines of its output:\n{_log_tail(log)}", file=sys.stderr, flush=True)
    cells = []
    for nbytes in args.sizes:
        key = str(nbytes)
        seconds = report["seconds"].get(key, [])
        error = report["errors"].get(key) or (None if seconds else failure or "no result")
        cells.append(Cell(framework, workers, nbytes, seconds, error))
    return cells


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def method_line(args: argparse.Namespace) -> str:
    large = max(5, args.repeats // 4)
    return (
        f"Method: median over {args.repeats} repeats ({large} for sizes >= {format_size(LARGE_BYTES)}) "
        f"after {args.warmup} warmups, barrier before each timed call, float32 sum, in-place "
        f"(TF: out-of-place), local processes; machine: {os.cpu_count()} CPU cores (os.cpu_count())."
    )


def print_table(workers: int, cells: Sequence[Cell], frameworks: Sequence[str], sizes: Sequence[int]) -> None:
    print(f"\nN = {workers} workers")
    columns = ("median ms", "min ms", "algbw GB/s", "busbw GB/s")
    print(f"{'size':>8} | {'framework':<9} | " + " | ".join(f"{c:>9}" for c in columns))
    print("-" * 70)
    by_key = {(c.framework, c.nbytes): c for c in cells}
    for nbytes in sizes:
        for fw in frameworks:
            c = by_key[(fw, nbytes)]
            head = f"{format_size(nbytes):>8} | {fw:<9} | "
            if c.error:
                print(head + f"error: {c.error[:100]}")
            else:
                print(
                    head + f"{c.median * 1e3:9.3f} | {min(c.seconds) * 1e3:9.3f} | {c.algbw:10.3f} | {c.busbw:10.3f}"
                )
    if "ours" not in frameworks or len(frameworks) < 2:
        return
    print("Ratios (other median / ours median = ours busbw / other busbw; > 1 means ours is faster):")
    for nbytes in sizes:
        ours = by_key[("ours", nbytes)]
        parts = []
        for fw in frameworks:
            if fw == "ours":
                continue
            other = by_key[(fw, nbytes)]
            ratio = "n/a" if ours.error or other.error else f"{other.median / ours.median:.2f}×"
            parts.append(f"ours vs {fw}: {ratio}" + (" (busbw ratio)" if fw == "gloo" else ""))
        print(f"{format_size(nbytes):>8}: " + "   ".join(parts))


def write_json(path: str, args: argparse.Namespace, cells: Sequence[Cell]) -> None:
    data = {
        "method": method_line(args),
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "results": [
            {
                "framework": c.framework, "workers": c.workers, "bytes": c.nbytes, "seconds": c.seconds,
                "error": c.error,
                "median_s": None if c.error else c.median,
                "algbw_GBps": None if c.error else c.algbw,
                "busbw_GBps": None if c.error else c.busbw,
            }  # fmt: skip
            for c in cells
        ],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def available_frameworks(requested: Sequence[str]) -> List[str]:
    """Drops frameworks whose package is not installed, with a note."""
    modules = {"ours": "elasticdl_strategy", "gloo": "torch", "tf": "tensorflow"}
    chosen = []
    for fw in requested:
        if importlib.util.find_spec(modules[fw]) is None:
            print(f"note: skipping {fw}: {modules[fw]} is not installed", file=sys.stderr)
        else:
            chosen.append(fw)
    return chosen


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=_size_list, default=_size_list(DEFAULT_SIZES), help=f"default {DEFAULT_SIZES}")
    p.add_argument("--workers", type=_int_list, default=_int_list(DEFAULT_WORKERS), help=f"default {DEFAULT_WORKERS}")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per size (default 20; fewer from 64 MiB)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size (default 3)")
    p.add_argument("--frameworks", type=_framework_list, default=list(FRAMEWORKS), help="default ours,gloo,tf")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per framework and N (default 600)")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: worker mode
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)  # internal: where rank 0 writes
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def _raise_interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.sizes, args.repeats, args.warmup, args.results)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so that `finally` stops the workers
    frameworks = available_frameworks(args.frameworks)
    print(method_line(args))
    cells: List[Cell] = []
    try:
        for workers in args.workers:
            run_cells = [c for fw in frameworks for c in run_one(fw, workers, args)]
            cells += run_cells
            print_table(workers, run_cells, frameworks, args.sizes)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.json and cells:
            write_json(args.json, args, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
