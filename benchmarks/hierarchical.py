"""Hierarchical against flat all-reduce between two hosts whose link is rate-limited.

Usage (root, ``ip`` and ``tc``)::

    python benchmarks/hierarchical.py [--rate 1gbit] [--size 64MiB] [--repeats 10]

Two network namespaces joined by a veth pair limited to ``--rate`` each way (``tc`` tbf) stand
for two hosts; two workers run in each (each namespace its own shared-memory directory: shared
memory within a host, data sockets between hosts), with a coordinator on the first. The same
job runs three times: hierarchical (the default), and the flat ring (``EDL_HIERARCHICAL=0``) with
the ranks in host order (two ring hops cross the link, the flat ring's best case) and
interleaved (all four do). Each worker all-reduces a float32 array of ``--size`` bytes after a
barrier, ``--repeats`` times after 2 warm-ups; the table gives rank 0's median and each flat
layout's time over the hierarchical one (> 1: the hierarchy is faster).
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
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)

from benchmarks._common import format_size, sigterm_interrupts, stop  # noqa: E402
from tests import netns  # noqa: E402

START_TIMEOUT_S = 120.0


def worker(out: Path, size: int, repeats: int) -> None:
    """One worker: all-reduces, times, and (rank 0) writes the times and the rank of each host."""
    import numpy as np

    from elasticdl_strategy import runtime

    runtime.init()
    array = np.ones(size // 4, np.float32)
    times = []
    for i in range(repeats + 2):
        runtime.barrier()
        started = time.perf_counter()
        runtime.allreduce(array, out=array)
        if i >= 2:
            times.append(time.perf_counter() - started)
    hosts = runtime.allgather(np.frombuffer(os.environ["EDL_BIND_HOST"].encode().ljust(16), np.uint8)[None])
    if runtime.rank() == 0:
        report = {"times": times, "hosts": [bytes(h).decode().strip() for h in hosts]}
        (out / "rank0.json").write_text(json.dumps(report))
    runtime.shutdown()


def run_job(hosts: netns.TwoHosts, out: Path, hierarchical: bool, interleaved: bool, args) -> dict:
    """Starts the coordinator and four workers, in the order that gives the ranks' layout; waits."""
    from elasticdl_strategy.transport.auth import new_token

    env = dict(os.environ, EDL_JOB_TOKEN=new_token(), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    env.update(EDL_HIERARCHICAL="1" if hierarchical else "0", EDL_TIMEOUT="300")
    port_file = out / "port"
    procs: List[subprocess.Popen] = []
    log = open(out / "job.log", "wb")
    try:
        coordinator = [
            sys.executable, "-m", "elasticdl_strategy", "coordinator", "--bind", hosts.address_a,
            "--port-file", str(port_file), "--workers", "4",
        ]  # fmt: skip
        procs.append(_start(["ip", "netns", "exec", hosts.namespace_a, *coordinator], env, log))
        _wait(port_file.exists, "the coordinator", procs)
        address = f"{hosts.address_a}:{port_file.read_text()}"
        a, b = (hosts.namespace_a, hosts.address_a), (hosts.namespace_b, hosts.address_b)
        for i, (ns, host) in enumerate((a, b, a, b) if interleaved else (a, a, b, b)):
            shm = out / f"shm-{ns}"
            shm.mkdir(exist_ok=True)
            worker_env = dict(env, EDL_COORDINATOR_ADDR=address, EDL_WORKER_ID=f"w{i}", EDL_BIND_HOST=host,
                              EDL_SHM_DIR=str(shm))  # fmt: skip
            argv = [sys.executable, os.path.abspath(__file__), "--worker", str(out), "--size", str(args.size),
                    "--repeats", str(args.repeats)]  # fmt: skip
            procs.append(_start(["ip", "netns", "exec", ns, *argv], worker_env, log))
            # Ranks follow registration order: the next worker starts once this one registered.
            _wait(lambda n=i: _registered(out / "job.log") > n, "the worker's registration", procs)
        for p in procs[1:]:
            p.wait(timeout=args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"a worker exited {p.returncode}:\n{(out / 'job.log').read_text()[-3000:]}")
        return json.loads((out / "rank0.json").read_text())
    finally:
        stop(procs)
        log.close()


def _start(argv: List[str], env: dict, log) -> subprocess.Popen:
    """A process in a session of its own: ``stop`` ends it by its process group."""
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _registered(log: Path) -> int:
    return log.read_text(errors="replace").count(" registered from ")


def _wait(predicate, what: str, procs: Sequence[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"no {what} within {START_TIMEOUT_S:g}s, or a process ended")
        time.sleep(0.05)  # polling files the processes write


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * scale
    return int(text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way, as tc takes it (default 1gbit)")
    parser.add_argument("--size", type=_size, default=64 << 20, help="bytes per all-reduce (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.size, args.repeats)
        return 0
    sigterm_interrupts()
    print(f"hierarchical vs flat: N = 4 on 2 hosts (network namespaces), link {args.rate} each way, "
          f"{format_size(args.size)} float32, median of {args.repeats}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    cases = (("hierarchical", True, False), ("flat, host order", False, False), ("flat, interleaved", False, True))
    medians = {}
    try:
        with netns.two_hosts(rate=args.rate) as hosts:
            for name, hierarchical, interleaved in cases:
                with tempfile.TemporaryDirectory(prefix="edl-hierarchical-") as directory:
                    report = run_job(hosts, Path(directory), hierarchical, interleaved, args)
                medians[name] = statistics.median(report["times"])
                layout = "".join("a" if h == hosts.address_a else "b" for h in report["hosts"])
                print(f"{name:18} ranks by host {layout}: {1000 * medians[name]:8.1f} ms", flush=True)
    except netns.Unavailable as e:
        print(f"skipped: {e}")
        return 0
    for name in cases[1:]:
        print(f"{name[0]} / hierarchical: {medians[name[0]] / medians['hierarchical']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
