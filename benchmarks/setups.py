"""Process handling shared by the training benchmarks (``train_step.py``, ``input_pipeline.py``).

A *setup* is the set of processes one contender trains in, each running the benchmark script itself in
its worker mode:

    single  one process, no strategy, TensorFlow's own thread counts (every core)
    tf      ``tf.distribute.MultiWorkerMirroredStrategy``: N local processes, each with a TF_CONFIG naming
            N free localhost ports and its index, and TF_NUM_INTRAOP_THREADS = OMP_NUM_THREADS = cores / N
            (what our launcher gives its workers, so that the comparison is fair)
    ours    ``elasticdl-strategy run --workers N -- <the worker command>`` (``python -m elasticdl_strategy``):
            the launcher starts the N workers and sets their thread counts

Every process gets CUDA_VISIBLE_DEVICES="" (CPU only), TF_CPP_MIN_LOG_LEVEL=2 and PYTHONUNBUFFERED=1.
:func:`run_processes` starts the processes of a setup in their own sessions with one shared log, waits
for them (a non-zero exit or the timeout fails the setup) and stops every one of them, by pid, whatever
happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)
from _common import free_ports, launch, stop, wait_all  # noqa: E402

KINDS = ("single", "tf", "ours")
Command = Tuple[List[str], Dict[str, str]]


def thread_env(workers: int) -> Dict[str, str]:
    """The per-worker thread counts our launcher sets for N local workers: cores / N (at least 1)."""
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    return {"TF_NUM_INTRAOP_THREADS": threads, "OMP_NUM_THREADS": threads}


def setup_commands(
    kind: str, workers: int, worker_argv: Sequence[str], extra_env: Optional[Mapping[str, str]] = None
) -> List[Command]:
    """(argv, env) of each process to start for one setup of ``kind`` (see the module's docstring);
    ``worker_argv`` is the command of one worker, ``extra_env`` goes into every process's environment."""
    if kind not in KINDS:
        raise ValueError(f"unknown setup kind {kind!r} (choose from {', '.join(KINDS)})")
    base = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    base.update(extra_env or {})
    if kind == "single":
        return [(list(worker_argv), base)]
    if kind == "ours":
        launcher = [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(workers), "--"]
        return [([*launcher, *worker_argv], base)]
    for name, value in thread_env(workers).items():
        base.setdefault(name, value)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    return [
        (
            list(worker_argv),
            dict(base, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})),
        )
        for i in range(workers)
    ]


def run_processes(commands: Sequence[Command], log: Path, results: Path, timeout: float) -> Optional[str]:
    """Starts ``commands`` (stdout and stderr of all into ``log``), waits for them and stops them all;
    returns why the setup failed (a non-zero exit, the timeout), or None. ``results`` is the file the
    workers write (read for a ``current`` step that runs longer than ``timeout``: see ``wait_all``)."""
    procs: List[subprocess.Popen] = []
    try:
        launch(commands, log, procs)
        return wait_all(procs, timeout, results, timeout)
    finally:
        stop(procs)


def make_strategy(setup: str, **ours):
    """(strategy or None, rank, number of workers) in a worker of ``setup``; ``ours``: the arguments
    of ``AllReduceStrategy`` (e.g. ``bucket_bytes``)."""
    import tensorflow as tf

    if setup == "single":
        return None, 0, 1
    if setup == "tf":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        return strategy, int(strategy.cluster_resolver.task_id), strategy.num_replicas_in_sync
    from elasticdl_strategy import AllReduceStrategy, runtime

    strategy = AllReduceStrategy(**ours)
    return strategy, runtime.rank(), strategy.num_replicas_in_sync
