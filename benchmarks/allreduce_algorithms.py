"""The all-reduce algorithms side by side, and the cost model that chooses between them.

Usage::

    python benchmarks/allreduce_algorithms.py [--workers 2,4] [--sizes 4KiB,64KiB,256KiB,1MiB,4MiB,16MiB]
                                              [--repeats 30] [--path shm|socket] [--json out.json]

For each N in ``--workers``, one job of N local workers (``python -m elasticdl_strategy run``) runs
every algorithm of :mod:`elasticdl_strategy.collective.cost_model` (direct, recursive doubling, ring)
at every size, forcing it by replacing the model's choice in the worker; ``--path socket`` sets
``EDL_SHARED_MEMORY=0`` (the path between hosts). Timing as in ``benchmarks/allreduce.py``: a barrier,
then one all-reduce timed with ``time.perf_counter``; the median of ``--repeats`` (a third of them from
4 MiB) after 3 untimed ones. The costs are fitted to the N = 2 medians (``cost_model.fit``); the table
prints each measured median, the model's prediction, and which algorithm the model picks; then what it
picks for N up to 1,024, where nothing here can measure it. Ranks share the machine's cores: at N
above the core count the numbers are the machine's queueing, not the algorithms'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)

from benchmarks._common import format_size, sigterm_interrupts, stop  # noqa: E402

RUN_TIMEOUT_S = 900


def _sizes(text: str) -> List[int]:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    out = []
    for item in text.split(","):
        number = item.rstrip("KMGiB")
        unit = item[len(number) :]
        if not number.isdigit() or (unit and unit not in units):
            raise argparse.ArgumentTypeError(f"bad size {item!r} (e.g. 4KiB, 1MiB)")
        out.append(int(number) * units.get(unit, 1))
    return out


def worker(sizes: List[int], repeats: int, results: Path) -> int:
    from elasticdl_strategy import runtime
    from elasticdl_strategy.collective import cost_model

    runtime.init()
    rank, n = runtime.rank(), runtime.size()
    seconds: Dict[str, Dict[str, float]] = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        count = repeats if nbytes < 4 << 20 else max(3, repeats // 3)
        times: Dict[str, List[float]] = {a: [] for a in cost_model.ALGORITHMS}
        # The algorithms take turns in three rounds: none is measured only while the job is cold.
        for turn in range(3 * len(cost_model.ALGORITHMS)):
            algorithm = cost_model.ALGORITHMS[turn % len(cost_model.ALGORITHMS)]
            cost_model.choose = lambda nbytes, size, path=None, a=algorithm: a  # type: ignore[assignment]
            for i in range(2 + -(-count // 3)):
                x.fill(1.0)
                runtime.barrier()
                start = time.perf_counter()
                runtime.allreduce(x, out=x)
                if i >= 2:
                    times[algorithm].append(time.perf_counter() - start)
                if not (x[0] == n and x[-1] == n):
                    raise RuntimeError(f"{algorithm} {nbytes}: wrong result {x[0]}, {x[-1]}")
        for algorithm, measured in times.items():
            seconds.setdefault(algorithm, {})[str(nbytes)] = statistics.median(measured)
    if rank == 0:
        results.write_text(json.dumps(seconds))
    runtime.shutdown()
    return 0


def run(n: int, sizes: List[int], repeats: int, path: str) -> Dict[str, Dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="edl-algorithms-") as directory:
        results = Path(directory) / "results.json"
        argv = [
            sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(n), "--",
            sys.executable, __file__, "--worker", str(results), "--sizes", ",".join(map(str, sizes)),
            "--repeats", str(repeats),
        ]  # fmt: skip
        env = dict(os.environ, EDL_SHARED_MEMORY="0" if path == "socket" else "1", EDL_LOG_LEVEL="WARNING")
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            stop([proc])
        if code != 0:
            raise RuntimeError(f"the N = {n} job exited with code {code}")
        return json.loads(results.read_text())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (the first must be 2)")
    parser.add_argument("--sizes", type=_sizes, default=_sizes("4KiB,64KiB,256KiB,1MiB,4MiB,16MiB"))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--path", choices=("shm", "socket"), default="shm")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.sizes, args.repeats, args.worker)
    sigterm_interrupts()
    from elasticdl_strategy.collective import cost_model

    counts = [int(x) for x in args.workers.split(",")]
    if counts[0] != 2:
        parser.error("--workers must start with 2: the costs are fitted at N = 2")
    print(f"all-reduce algorithms, {args.path} path: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    measured = {n: run(n, args.sizes, args.repeats, args.path) for n in counts}
    samples = [(a, int(s), 2, t) for a, by_size in measured[2].items() for s, t in by_size.items()]
    costs = cost_model.fit(samples)
    print(
        f"fitted at N = 2: overhead {costs.overhead_s * 1e6:.1f} us, latency {costs.latency_s * 1e6:.1f} us, "
        f"{1e-9 / costs.s_per_byte if costs.s_per_byte else float('inf'):.2f} GB/s on the wire, "
        f"{1e-9 / costs.reduce_s_per_byte if costs.reduce_s_per_byte else float('inf'):.2f} GB/s reducing"
    )
    print("N | size | " + " | ".join(f"{a} ms (predicted)" for a in cost_model.ALGORITHMS) + " | fastest | model picks")
    for n in counts:
        for nbytes in args.sizes:
            cells, times = [], {}
            for a in cost_model.ALGORITHMS:
                t = measured[n][a][str(nbytes)]
                times[a] = t
                cells.append(f"{t * 1e3:.3f} ({cost_model.predict(a, nbytes, n, costs) * 1e3:.3f})")
            print(
                f"{n} | {format_size(nbytes)} | " + " | ".join(cells)
                + f" | {min(times, key=times.get)} | {cost_model.choose(nbytes, n, costs)}"  # type: ignore[arg-type]
            )  # fmt: skip
    print("the model's picks beyond this machine:")
    for n in (8, 64, 256, 1024):
        picks = ", ".join(f"{format_size(s)} {cost_model.choose(s, n, costs)}" for s in args.sizes)
        print(f"  N = {n}: {picks}; ring 64 MiB {cost_model.predict('ring', 64 << 20, n, costs) * 1e3:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "fitted": costs.__dict__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
