"""All-reduce benchmark: elasticdl_strategy.collective (shared memory, data socket, gRPC) vs torch.distributed
(gloo) vs TensorFlow vs Open MPI (mpi4py; shared memory and TCP).

Usage::

    python benchmarks/allreduce.py [--sizes 4KiB,256KiB,4MiB,64MiB,256MiB] [--workers 2,4] [--repeats 20]
                                   [--frameworks shm,lanes,socket,grpc,gloo,tf,mpi,mpi-tcp] [--json out.json]
                                   [--compute-ms 10]
                                   [--profile PREFIX [--profile-size 64MiB] [--profile-workers 2]]
                                   [--mpi-python /usr/bin/python3]

Frameworks:
    shm     ``runtime.allreduce(x, out=x)`` in workers started by ``python -m elasticdl_strategy run``
            with the defaults: all-reduces up to 256 KiB (4 MiB from N = 4) go through the host
            segment (every worker of the host maps it), payloads between same-host peers through the
            shared-memory arena, frames over the data socket. Checked: from the first size >= 256 KiB
            on, rank 0's ``communicator().p2p.shared_memory_peers`` must be non-empty ("shared memory
            not used" otherwise)
    lanes   the same with ``EDL_HOST_SEGMENT_BYTES=0``: small all-reduces as messages in the arenas' lanes
    socket  the same with ``EDL_SHARED_MEMORY=0``: payloads on the direct data socket, the path
            between hosts (``data_socket_peers`` must be non-empty, ``shared_memory_peers`` empty)
    grpc    ``EDL_SHARED_MEMORY=0 EDL_DATA_SOCKET=0``: every byte over gRPC (both lists empty)
    gloo  ``torch.distributed.all_reduce`` on the gloo backend (skipped when torch is not installed)
    tf    ``tf.distribute.MultiWorkerMirroredStrategy`` with the RING implementation, a replica-context
          ``all_reduce`` inside ``strategy.run`` of a ``tf.function`` (out-of-place: TF has no in-place form)
    mpi     mpi4py ``comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)`` under Open MPI's ``mpirun``, over its
            shared-memory transport: ``--mca pml ob1 --mca btl vader,self`` (``sm,self`` from Open MPI 5).
            That is what Open MPI 4.1 picks on one host without any ``--mca`` (``--mca btl_base_verbose 100``
            prints "bml: Using vader btl for send to ..."); naming it keeps UCX or another PML or BTL from
            taking over where one is installed. Checked: rank 0 must write less than a quarter of the tensor
            per all-reduce through system calls during a size (see mpi-tcp); it writes 0 bytes here
    mpi-tcp the same over TCP on the loopback interface only: ``--mca pml ob1 --mca btl tcp,self
            --mca btl_tcp_if_include lo`` (no shared-memory BTL; by default the tcp BTL leaves out
            127.0.0.0/8 and took eth0's address here, and finds nothing on a host with only ``lo``).
            Checked: rank 0 must write at least a quarter of the tensor per all-reduce through system calls
            during a size (``wchar`` of ``/proc/self/io``; the tcp BTL ``writev``s each fragment): 1 to 2.5
            tensors per call here at N = 2 to 4, by Open MPI's algorithm for the size and N. Without
            /proc/self/io nothing is checked

MPI: one ``mpirun --oversubscribe --bind-to none -np N`` (plus ``--allow-run-as-root`` as root; not bound
to cores, like the other frameworks' processes) starts the N workers, each running this file with
``--worker mpi`` or ``--worker mpi-tcp`` under an interpreter that has numpy and mpi4py built on Open MPI:
``--mpi-python``, by default ``/usr/bin/python3`` if it has them (Debian and Ubuntu:
``apt-get install openmpi-bin python3-mpi4py python3-numpy``), else this interpreter (mpi4py from PyPI
built against the installed Open MPI). The MPI frameworks are skipped with a note when neither imports
them, when ``mpirun`` is not on PATH or not Open MPI's, or when its version differs from the library's.
That interpreter needs nothing else: this module imports only the standard library and numpy at its top
and each backend imports its framework itself, so an MPI worker loads numpy, mpi4py and the standard
library only. Open MPI's ``tuned`` collective component runs the all-reduce with the algorithm it picks
for the size and N (``coll sm``, ``han`` and ``adapt`` have priority 0 in 4.1, so the all-reduce goes
through the PML and the BTL named above); as by default, the ranks busy-poll while they wait unless the
node is oversubscribed (N = 4 on 2 cores), where they yield.

How TCP-only was verified (Open MPI 4.1.4, Debian 12, mpi4py 3.1.4): with ``--mca btl_base_verbose 100``
every rank prints "btl: tcp: Using interface: lo" and "bml: Using tcp btl for send to" each other rank (the
self BTL only to itself); ``--mca coll_base_verbose 10`` shows ``sm``, ``han`` and ``adapt`` disabled; and
``wchar`` grew by 5.0 MiB over 5 all-reduces of 1 MiB at N = 2 where the same loop under vader wrote 0
bytes. The benchmark repeats the last check on every size (a swapped ``--mca btl`` fails both ways).

Stopping an MPI run: ``mpirun`` puts every rank in a process group of its own, so stopping a run signals
``mpirun``'s process group and each of its descendants by pid (SIGTERM, then SIGKILL); each rank also
has the kernel SIGKILL it when ``mpirun`` dies (``PR_SET_PDEATHSIG``).

Method: for every framework and worker count N, this script starts N local worker
processes running itself in ``--worker FRAMEWORK`` mode (for MPI through ``mpirun``). Each
worker goes through the sizes in order; per size it fills a float32 buffer with ones, runs ``--warmup`` untimed
all-reduces, then ``--repeats`` timed ones (fewer for 64 MiB and up, see
:func:`repeats_for`). Before each timed call the buffer is refilled, every rank computes
(spins) for ``--compute-ms`` if given, as a training step does between its all-reduces (the
links stay idle that long), and all ranks meet in a barrier; only the all-reduce itself is timed
with ``time.perf_counter`` (for TF this includes fetching the local result with ``.numpy()``, so the call has finished).
The last result is checked to equal N everywhere sampled. Rank 0 writes the per-size
lists of seconds to a JSON file that the parent reads back. A run (framework, N) is
stopped after ``--timeout`` seconds, and as soon as one size takes longer than
``--cell-timeout``; the cell then shows the error and the other runs go on.

Reported per cell: median, min and 90th-percentile time, algbw = bytes / median and
busbw = algbw * 2(N-1)/N (the bytes each rank moves in a ring all-reduce, as in
nccl-tests). The ratio lines are other_median / ours_median for each of our paths:
above 1 means ours is faster.

Memory (rank 0 only): before each size the previous buffer is released, the kernel's
resident-set high-water mark is reset (``"5"`` written to ``/proc/self/clear_refs``,
Linux >= 4.0) and VmRSS is read; after the size, VmHWM (from ``/proc/self/status``) is the
peak resident memory of the process during that size: interpreter, libraries, the tensor,
transport buffers and mapped shared memory that was touched (for MPI: the rank's own process, Open MPI's
shared-memory segments included). Where the reset fails the
peak is ``ru_maxrss``, the peak since the process started. Printed as "peak MiB" and
"peak/T" (peak over the tensor bytes).

Profile (``--profile PREFIX``): after the table, one extra run per path of ours (shm, socket, grpc) that was run
with only ``--profile-size``, ``--profile-repeats`` timed calls and ``--profile-workers``
workers, each worker under ``py-spy record --native --threads --rate 200 --format raw``;
the raw profiles are written to ``PREFIX.<framework>.rank<R>.txt`` and rank 0's 15 functions
with the most own time (leaf samples summed over all threads) are printed, leaving out
threads blocked in locks, condition variables, epoll or futexes (py-spy samples native
waits as active) and the main thread outside ``measure`` (start-up, imports, exit).
Timings under the profiler are not benchmark numbers.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

# Only the standard library and numpy at the top: the MPI workers run this file under the system python,
# which has mpi4py but neither elasticdl_strategy nor torch nor TensorFlow (each backend imports its own).
import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)
import numpy as np
from _common import (  # noqa: E402
    RUN_TIMEOUT_S,
    describe,
    format_size,
    free_ports,
    launch,
    log_tail,
    read_report,
    run_benchmark,
    sigterm_interrupts,
    stop,
    wait_all,
    write_json_atomically,
)

FRAMEWORKS = ("shm", "lanes", "socket", "grpc", "gloo", "tf", "mpi", "mpi-tcp")
OURS = ("shm", "lanes", "socket", "grpc")  # our data paths; the ratio lines compare these with the others
SHARED_MEMORY_PATHS = ("shm", "lanes")
# What each of our data paths sets in the workers' environment.
OUR_PATH_ENV = {
    "shm": {"EDL_SHARED_MEMORY": "1", "EDL_DATA_SOCKET": "1"},
    "lanes": {"EDL_SHARED_MEMORY": "1", "EDL_DATA_SOCKET": "1", "EDL_HOST_SEGMENT_BYTES": "0"},
    "socket": {"EDL_SHARED_MEMORY": "0", "EDL_DATA_SOCKET": "1"},
    "grpc": {"EDL_SHARED_MEMORY": "0", "EDL_DATA_SOCKET": "0"},
}
MPI_FRAMEWORKS = ("mpi", "mpi-tcp")
DEFAULT_MPI_PYTHON = "/usr/bin/python3"  # Debian's, where apt installs python3-mpi4py
MPI_INSTALL_HINT = (
    "apt-get install -y openmpi-bin python3-mpi4py python3-numpy (for /usr/bin/python3), "
    "or --mpi-python PY with mpi4py built on Open MPI"
)
MPI_PROBE_TIMEOUT_S = 60.0
DEFAULT_SIZES = "4KiB,256KiB,4MiB,64MiB,256MiB"
DEFAULT_WORKERS = "2,4"
LARGE_BYTES = 64 << 20  # sizes from here on get fewer repeats
SHM_CHECK_BYTES = 256 << 10  # from the first size this large on, the path must be in use
CELL_TIMEOUT_S = 240.0  # per size within a run
PROFILE_TOP = 15
PROFILE_RATE_HZ = 200

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

    def check_transport(self, nbytes: int) -> Optional[str]:
        """After a size: why the data path used is not the one the framework stands for, or None."""


class OursBackend:
    """``runtime.allreduce`` on the data ``path`` (a key of OUR_PATH_ENV) that the environment selected."""

    def __init__(self, path: str) -> None:
        from elasticdl_strategy import runtime

        for var, value in OUR_PATH_ENV[path].items():
            if os.environ.get(var) != value:
                raise RuntimeError(f"{var}={os.environ.get(var)!r} in a {path} worker")
        self._c = runtime
        self._path = path
        self._large_seen = False
        runtime.init()
        self.rank, self.size = runtime.rank(), runtime.size()
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

    def check_transport(self, nbytes: int) -> Optional[str]:
        if self.size < 2:
            return None  # nothing is sent
        p2p = self._c.communicator().p2p
        shm, sockets = p2p.shared_memory_peers, p2p.data_socket_peers
        if self._path not in SHARED_MEMORY_PATHS and shm:
            return f"shared memory used by the {self._path} path (to ranks {shm})"
        if self._path == "grpc" and sockets:
            return f"data sockets used with EDL_DATA_SOCKET=0 (to ranks {sockets})"
        self._large_seen = self._large_seen or nbytes >= SHM_CHECK_BYTES
        if self._large_seen and self._path in SHARED_MEMORY_PATHS and not shm:
            return "shared memory not used (shared_memory_peers is empty)"
        if self._large_seen and self._path == "socket" and not sockets:
            return "data sockets not used (data_socket_peers is empty)"
        return None


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

    def check_transport(self, nbytes: int) -> Optional[str]:
        return None


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
        self._out = np.zeros(0, np.float32)
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

    def check_transport(self, nbytes: int) -> Optional[str]:
        return None


def _bytes_written() -> Optional[int]:
    """Bytes this process has passed to write system calls (``wchar`` of /proc/self/io), None if unknown."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent (``mpirun``) dies: the ranks are not in
    ``mpirun``'s process group and would otherwise outlive a ``mpirun`` that is killed."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request
        os._exit(1)


class MpiBackend:
    """mpi4py ``Allreduce`` in place under ``mpirun``; ``framework`` (mpi or mpi-tcp) names the transport that
    the parent selected with ``--mca btl`` and that :meth:`check_transport` checks.

    Runs under the MPI python: imports only numpy, mpi4py and the standard library."""

    def __init__(self, framework: str) -> None:
        _die_with_parent()
        from mpi4py import MPI  # MPI_Init

        self._mpi, self._comm = MPI, MPI.COMM_WORLD
        self._tcp = framework == "mpi-tcp"
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._x: np.ndarray = np.zeros(0, np.float32)
        self._calls = 0
        self._written_before: Optional[int] = None

    def prepare(self, count: int) -> None:
        self._x = np.ones(count, np.float32)
        self._calls = 0
        self._written_before = _bytes_written()

    def refill(self) -> None:
        self._x.fill(1.0)

    def allreduce(self) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, self._x, op=self._mpi.SUM)
        self._calls += 1

    def result(self) -> np.ndarray:
        return self._x

    def barrier(self) -> None:
        self._comm.Barrier()

    def close(self) -> None:
        pass  # mpi4py calls MPI_Finalize at exit

    def check_transport(self, nbytes: int) -> Optional[str]:
        """The tcp BTL moves the payload with writev on its sockets, vader with memcpy (or process_vm_readv):
        the bytes written through system calls during the size tell them apart."""
        after = _bytes_written()
        if self.size < 2 or self._written_before is None or after is None or not self._calls:
            return None
        written = after - self._written_before
        through_syscalls = written >= self._calls * nbytes / 4
        if self._tcp and not through_syscalls:
            return f"TCP not used: rank {self.rank} wrote {written} bytes in {self._calls} all-reduces"
        if not self._tcp and through_syscalls:
            return f"shared memory not used: rank {self.rank} wrote {written} bytes in {self._calls} all-reduces"
        return None


BACKENDS: Dict[str, Callable[[], Backend]] = {
    "shm": lambda: OursBackend("shm"),
    "lanes": lambda: OursBackend("lanes"),
    "socket": lambda: OursBackend("socket"),
    "grpc": lambda: OursBackend("grpc"),
    "gloo": GlooBackend,
    "tf": TFBackend,
    "mpi": lambda: MpiBackend("mpi"),
    "mpi-tcp": lambda: MpiBackend("mpi-tcp"),
}


class MemoryProbe:
    """Resident memory of this process per size: VmRSS before, peak (VmHWM reset per size) after."""

    def __init__(self) -> None:
        self.source = "VmHWM"

    @staticmethod
    def _status_mib(field_name: str) -> Optional[float]:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field_name + ":"):
                        return int(line.split()[1]) / 1024  # kB
        except OSError:
            pass
        return None

    def start(self) -> Optional[float]:
        """Resets the high-water mark if the kernel lets us; returns VmRSS in MiB (None if unknown)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.source = "ru_maxrss"  # peak since the process started
        return self._status_mib("VmRSS")

    def peak(self) -> float:
        """Peak resident MiB since :meth:`start` (or since the process started, see ``source``)."""
        hwm = self._status_mib("VmHWM") if self.source == "VmHWM" else None
        if hwm is not None:
            return hwm
        self.source = "ru_maxrss"
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss / (1 << 20) if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB elsewhere


def measure(backend: Backend, count: int, repeats: int, warmup: int, compute_s: float = 0.0) -> List[float]:
    """Seconds of ``repeats`` all-reduces of ``count`` float32 after ``warmup`` untimed ones, each
    after ``compute_s`` seconds of spinning (a step's computation) and a barrier."""
    backend.prepare(count)
    for _ in range(warmup):
        backend.refill()
        backend.allreduce()
    seconds = []
    for _ in range(repeats):
        backend.refill()
        computed = time.perf_counter() + compute_s
        while time.perf_counter() < computed:
            pass
        backend.barrier()
        start = time.perf_counter()
        backend.allreduce()
        seconds.append(time.perf_counter() - start)
    result = backend.result()
    sample = result[[0, count // 2, count - 1]]
    if not np.all(sample == backend.size):
        raise RuntimeError(f"wrong all-reduce result: sampled {sample.tolist()}, expected {backend.size}")
    return seconds


def worker_main(
    framework: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    results: Path,
    fixed_repeats: bool = False,
    compute_s: float = 0.0,
) -> int:
    """Runs every size; rank 0 rewrites ``results`` before and after each one (a crash keeps earlier sizes;
    ``current`` tells the parent which size is running)."""
    backend: Backend = BACKENDS[framework]()
    # which worker has which rank: the parent names the profiles of a --profile run by rank
    (results.parent / f"rank{backend.rank}.id").write_text(os.environ.get("EDL_WORKER_ID", str(backend.rank)))
    probe = MemoryProbe()
    report: Dict[str, object] = {"seconds": {}, "errors": {}, "memory": {}, "current": None}
    for nbytes in sizes:
        key = str(nbytes)
        if backend.rank == 0:
            report["current"] = key
            write_json_atomically(results, report)
        backend.prepare(0)  # release the previous buffer before the memory baseline
        rss_before = probe.start()
        try:
            count = repeats if fixed_repeats else repeats_for(nbytes, repeats)
            report["seconds"][key] = measure(backend, nbytes // 4, count, warmup, compute_s)
            problem = backend.check_transport(nbytes)
            if problem:
                report["errors"][key] = problem
        except Exception as e:  # record the cell and go on with the next size
            traceback.print_exc()
            report["errors"][key] = describe(e)
        report["memory"][key] = {"rss_before_MiB": rss_before, "peak_MiB": probe.peak(), "source": probe.source}
        report["current"] = None
        if backend.rank == 0:
            write_json_atomically(results, report)
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
    rss_before_mib: Optional[float] = None  # rank 0's resident MiB before the size
    peak_mib: Optional[float] = None  # rank 0's peak resident MiB during the size
    memory_source: Optional[str] = None  # VmHWM (reset per size) or ru_maxrss (since process start)

    @property
    def peak_per_tensor(self) -> Optional[float]:
        return None if self.peak_mib is None else self.peak_mib * (1 << 20) / self.nbytes

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90(self) -> float:
        return float(np.percentile(self.seconds, 90))

    @property
    def algbw(self) -> float:
        return self.nbytes / self.median / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.workers - 1) / self.workers


def profiled(argv: List[str], prefix: str) -> List[str]:
    """``argv`` under ``py-spy record``, writing ``<prefix>.<EDL_WORKER_ID>.txt`` (the id is read at start)."""
    script = (
        f"exec py-spy record --native --threads --rate {PROFILE_RATE_HZ} --format raw "
        '-o "$0.${EDL_WORKER_ID:-worker}.txt" -- "$@"'
    )
    return ["sh", "-c", script, prefix, *argv]


@dataclass(frozen=True)
class MpiSetup:
    """What runs the MPI frameworks: an interpreter with mpi4py and numpy, and Open MPI's mpirun."""

    python: str
    mpirun: str
    version: str  # Open MPI's, e.g. "4.1.4"
    mpi4py: str

    def describe(self) -> str:
        return f"Open MPI {self.version} ({self.mpirun}), mpi4py {self.mpi4py} under {self.python}"


_OPEN_MPI_VERSION = re.compile(r"Open MPI\)? v?(\d+\.\d+\.\d+)")
# Prints mpi4py's version and the MPI library's first line without initializing MPI.
_MPI_PROBE = (
    "import mpi4py, numpy; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    "print(mpi4py.__version__); print(MPI.Get_library_version().splitlines()[0])"
)


def _probe_mpi_python(python: str) -> Tuple[Optional[Tuple[str, str]], str]:
    """((mpi4py version, Open MPI version), "") if ``python`` runs mpi4py on Open MPI, else (None, why not)."""
    try:
        done = subprocess.run(
            [python, "-c", _MPI_PROBE], stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=MPI_PROBE_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, describe(e, 120)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        return None, lines[-1][:120]
    lines = done.stdout.strip().splitlines()
    match = _OPEN_MPI_VERSION.search(lines[-1]) if len(lines) == 2 else None
    if not match:
        return None, f"mpi4py is not built on Open MPI ({' '.join(lines)[:80]})"
    return (lines[0], match.group(1)), ""


def find_mpi(requested_python: Optional[str]) -> Tuple[Optional[MpiSetup], str]:
    """The MPI setup, or (None, why not): ``requested_python`` (``--mpi-python``) if given, else the first of
    /usr/bin/python3 and this interpreter that imports numpy and an mpi4py on Open MPI; ``mpirun`` from PATH,
    which must be Open MPI of the same version as the library mpi4py loads."""
    candidates = [requested_python] if requested_python else [DEFAULT_MPI_PYTHON, sys.executable]
    found, problems = None, []
    for python in dict.fromkeys(candidates):  # in order, without repeats
        versions, why = _probe_mpi_python(python)
        if versions:
            found = (python, *versions)
            break
        problems.append(f"{python}: {why}")
    if found is None:
        return None, "; ".join(problems)
    python, mpi4py_version, library_version = found
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "mpirun is not on PATH"
    try:
        done = subprocess.run(
            [mpirun, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=MPI_PROBE_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{mpirun} --version: {describe(e, 120)}"
    match = _OPEN_MPI_VERSION.search(done.stdout + done.stderr)
    if not match:
        return None, f"{mpirun} is not Open MPI's"
    if match.group(1) != library_version:
        return None, f"{mpirun} is Open MPI {match.group(1)}, mpi4py under {python} loads {library_version}"
    return MpiSetup(python, mpirun, library_version, mpi4py_version), ""


def mpirun_argv(setup: MpiSetup, framework: str, workers: int, command: Sequence[str]) -> List[str]:
    """``mpirun`` starting ``workers`` ranks of ``setup.python command...`` on the transport of ``framework``:
    shared memory (mpi) or TCP over the loopback interface only (mpi-tcp), both through the ob1 PML."""
    shared_memory_btl = "sm" if int(setup.version.split(".")[0]) >= 5 else "vader"  # renamed in Open MPI 5
    transport = {
        "mpi": ["--mca", "btl", f"{shared_memory_btl},self"],
        "mpi-tcp": ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"],
    }[framework]
    argv = [setup.mpirun, "-np", str(workers), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return [*argv, "--mca", "pml", "ob1", *transport, setup.python, *command]


def worker_commands(
    framework: str,
    workers: int,
    worker_args: List[str],
    profile_prefix: Optional[str] = None,
    tls_dir: Optional[str] = None,
    mpi: Optional[MpiSetup] = None,
) -> List[Tuple[List[str], Dict[str, str]]]:
    """(argv, env) of each process to start for one run; with ``profile_prefix`` (our paths only)
    every worker runs under py-spy; with ``tls_dir`` ours use TLS with its cert.pem, key.pem and ca.pem;
    the MPI frameworks need ``mpi`` and are one ``mpirun``."""
    me = [sys.executable, os.path.abspath(__file__), "--worker", framework, *worker_args]
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    if framework in MPI_FRAMEWORKS:
        if mpi is None:
            raise ValueError(f"{framework} needs an MPI setup (find_mpi)")
        return [(mpirun_argv(mpi, framework, workers, me[1:]), base)]
    if framework in OURS:
        env = dict(base, **OUR_PATH_ENV[framework])
        command = profiled(me, profile_prefix) if profile_prefix else me
        tls = []
        if tls_dir:
            tls = [f"--tls-{part}={os.path.join(tls_dir, f'{part}.pem')}" for part in ("cert", "key", "ca")]
        launcher = [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(workers), *tls]
        return [([*launcher, "--", *command], env)]
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


def run_one(
    framework: str,
    workers: int,
    args: argparse.Namespace,
    sizes: Optional[Sequence[int]] = None,
    profile_prefix: Optional[str] = None,
) -> List[Cell]:
    """Starts the N workers of ``framework``, waits for them, and returns one cell per size.

    With ``profile_prefix`` the workers run under py-spy with ``args.profile_repeats`` timed calls per
    size, and each raw profile is renamed to ``<profile_prefix>.rank<R>.txt``."""
    sizes = list(args.sizes if sizes is None else sizes)
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmp:
        results, log = Path(tmp) / "results.json", Path(tmp) / "output.log"
        worker_args = [
            "--sizes", ",".join(map(str, sizes)), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--results", str(results), "--compute-ms", str(args.compute_ms),
        ]  # fmt: skip
        if profile_prefix:
            worker_args[3] = str(args.profile_repeats)
            worker_args.append("--fixed-repeats")
        procs: List[subprocess.Popen] = []
        started = time.monotonic()
        try:
            launch(worker_commands(framework, workers, worker_args, profile_prefix, args.tls, args.mpi), log, procs)
            failure = wait_all(procs, args.timeout, results, args.cell_timeout)
        finally:
            stop(procs)
        report = read_report(results) or {}
        elapsed = time.monotonic() - started
        status = "ok" if failure is None else f"FAILED: {failure}"
        label = f"{framework} (under py-spy)" if profile_prefix else framework
        print(f"  {label:<7} N={workers}: {elapsed:.1f} s, {status}", file=sys.stderr, flush=True)
        if failure is not None or report.get("errors"):
            print(f"  last lines of its output:\n{log_tail(log)}", file=sys.stderr, flush=True)
        if profile_prefix:
            _name_profiles_by_rank(Path(tmp), profile_prefix)
    cells = []
    for nbytes in sizes:
        key = str(nbytes)
        seconds = report.get("seconds", {}).get(key, [])
        error = report.get("errors", {}).get(key) or (None if seconds else failure or "no result")
        memory = report.get("memory", {}).get(key, {})
        cells.append(
            Cell(
                framework, workers, nbytes, seconds, error,
                memory.get("rss_before_MiB"), memory.get("peak_MiB"), memory.get("source"),
            )
        )  # fmt: skip
    return cells


def _name_profiles_by_rank(tmp: Path, prefix: str) -> None:
    """Renames ``<prefix>.<worker id>.txt`` to ``<prefix>.rank<R>.txt`` from the ids the workers wrote."""
    for id_file in sorted(tmp.glob("rank*.id")):
        rank = id_file.stem[len("rank") :]
        source = Path(f"{prefix}.{id_file.read_text().strip()}.txt")
        if source.exists():
            os.replace(source, f"{prefix}.rank{rank}.txt")


# ---------------------------------------------------------------------------
# Profile summary: own time per function from py-spy's raw format
# ---------------------------------------------------------------------------


_LINE_NUMBER = re.compile(r":\d+\)$")
_UNTIMED = re.compile(r"(\w+\.)?(refill|prepare) \(")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+ ")
# Frames near the leaf that mean the thread is blocked in the kernel, not using a core: py-spy --native
# samples such native waits as active. ``syscall`` as a leaf is gRPC's futex wait; ``accept`` is the data
# socket listener's idle thread. A blocking ``recv`` cannot be told apart: it stays in the on-CPU counts.
_WAIT_MARKERS = (
    "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock", "pthread_cond_wait", "pthread_cond_timedwait",
    "pthread_cond_clockwait", "epoll_wait", "epoll_pwait", "sem_wait", "sem_timedwait", "sem_clockwait",
    "nanosleep", "poll (", "select (", "accept (", "accept4 (",
)  # fmt: skip


def _function_of(frame: str) -> str:
    """``"f (mod.py:12)"`` -> ``"f (mod.py)"``; an unresolved native ``"0x7f.. (libc.so.6)"`` -> ``"? (libc.so.6)"``."""
    return _ADDRESS.sub("? ", _LINE_NUMBER.sub(")", frame.strip()))


def _leaf_name(frames: Sequence[str]) -> str:
    """The leaf function; an unresolved one (no symbols, e.g. libc's memmove) with its nearest resolved caller."""
    leaf = _function_of(frames[-1])
    if not leaf.startswith("? "):
        return leaf
    for frame in reversed(frames[:-1]):
        caller = _function_of(frame)
        if not caller.startswith(("? ", "thread (")):
            return f"{leaf} in {caller}"
    return leaf


def own_time(raw: Path) -> Tuple[collections.Counter, Dict[str, int]]:
    """Samples per leaf function of the on-CPU stacks of a py-spy raw file (lines ``frame;...;leaf COUNT``,
    outermost frame first, the thread first with ``--threads``), and the totals: ``cpu`` (in the counter),
    ``waiting`` (blocked in locks, condition variables, epoll, futexes) and ``outside`` (the main thread
    outside :func:`measure`, i.e. start-up, imports, rendezvous, exit; any import stack; the untimed
    refill of the buffer)."""
    leaves: collections.Counter = collections.Counter()
    totals = {"cpu": 0, "waiting": 0, "outside": 0}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), stack.split(";")
        main_thread = frames[0].startswith("thread (") and frames[0].endswith(": MainThread")
        untimed = any(_UNTIMED.match(f) for f in frames)  # the buffer's allocation and refills
        if "_find_and_load" in stack or untimed or (main_thread and not any(f.startswith("measure (") for f in frames)):
            totals["outside"] += count
        elif frames[-1].startswith("syscall ") or any(m in f for f in frames[-4:] for m in _WAIT_MARKERS):
            totals["waiting"] += count
        else:
            leaves[_leaf_name(frames)] += count
            totals["cpu"] += count
    return leaves, totals


def print_profile(framework: str, workers: int, raw: Path, cell: Cell) -> None:
    timing = cell.error or f"median {cell.median * 1e3:.1f} ms under the profiler"
    print(f"\nProfile {framework}, N = {workers}, {format_size(cell.nbytes)} ({timing}), rank 0: {raw}")
    if not raw.exists():
        print("  (no profile written: see the output above)")
        return
    leaves, totals = own_time(raw)
    cpu = max(totals["cpu"], 1)
    print(
        f"  samples at {PROFILE_RATE_HZ} Hz summed over threads: {totals['cpu']} on CPU; left out: "
        f"{totals['waiting']} blocked (locks, condition variables, epoll, futex, accept), {totals['outside']} of the "
        f"main thread outside the timed all-reduces (start-up, imports, buffer refills, exit)"
    )
    print(f"  top {PROFILE_TOP} functions by own time (% of the on-CPU samples):")
    print(f"  {'own %':>6} {'samples':>8}  function")
    for name, count in leaves.most_common(PROFILE_TOP):
        print(f"  {100 * count / cpu:5.1f}% {count:8d}  {name}")


def run_profiles(args: argparse.Namespace, frameworks: Sequence[str]) -> None:
    if shutil.which("py-spy") is None:
        print("note: --profile needs py-spy on PATH (pip install py-spy); no profile taken", file=sys.stderr)
        return
    for framework in (fw for fw in OURS if fw in frameworks):
        prefix = f"{args.profile}.{framework}"
        for stale in Path(prefix).parent.glob(Path(prefix).name + ".*.txt"):
            stale.unlink()
        (cell,) = run_one(framework, args.profile_workers, args, [args.profile_size], prefix)
        print_profile(framework, args.profile_workers, Path(f"{prefix}.rank0.txt"), cell)
        sys.stdout.flush()


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def method_line(args: argparse.Namespace) -> str:
    large = max(5, args.repeats // 4)
    return (
        f"Method: median over {args.repeats} repeats ({large} for sizes >= {format_size(LARGE_BYTES)}) "
        f"after {args.warmup} warmups, "
        + (f"{args.compute_ms:g} ms of computation (spinning) and " if args.compute_ms else "")
        + "a barrier before each timed call, float32 sum, in-place "
        f"(TF: out-of-place), local processes; machine: {os.cpu_count()} CPU cores (os.cpu_count()). "
        "Memory: rank 0's peak resident set during each size (VmHWM reset per size)."
        + (f" MPI: {args.mpi.describe()}." if args.mpi else "")
    )


def _ratio(value: float) -> str:
    """Two decimals; two significant digits below 0.1 (MPI's small sizes are far below ours)."""
    return f"{value:.2f}×" if value >= 0.1 else f"{value:.2g}×"


def print_table(workers: int, cells: Sequence[Cell], frameworks: Sequence[str], sizes: Sequence[int]) -> None:
    print(f"\nN = {workers} workers")
    columns = ("median ms", "min ms", "p90 ms", "algbw GB/s", "busbw GB/s", "peak MiB", "peak/T")
    print(f"{'size':>8} | {'framework':<9} | " + " | ".join(f"{c:>9}" for c in columns))
    print("-" * 113)
    by_key = {(c.framework, c.nbytes): c for c in cells}
    for nbytes in sizes:
        for fw in frameworks:
            c = by_key[(fw, nbytes)]
            head = f"{format_size(nbytes):>8} | {fw:<9} | "
            if c.error:
                print(head + f"error: {c.error[:100]}")
                continue
            memory = f"{'n/a':>9} | {'n/a':>9}"
            if c.peak_mib is not None:
                ratio = c.peak_per_tensor
                memory = f"{c.peak_mib:9.0f} | " + (f"{ratio:8.2f}×" if ratio < 1000 else f"{'>1000':>8}×")
            print(
                head
                + f"{c.median * 1e3:9.3f} | {min(c.seconds) * 1e3:9.3f} | {c.p90 * 1e3:9.3f} | "
                + f"{c.algbw:10.3f} | {c.busbw:10.3f} | "
                + memory
            )
    if any(c.memory_source == "ru_maxrss" for c in cells):
        print("(peak MiB marked from ru_maxrss: the high-water mark could not be reset; it is the peak since start)")
    pairs = [(ours, other) for ours in OURS if ours in frameworks for other in frameworks if other not in OURS]
    if not pairs:
        return
    print(
        "Ratios (other median / ours median; > 1 means ours is faster; "
        "vs gloo = ours busbw / gloo busbw, the same number):"
    )
    for nbytes in sizes:
        for i, ours_fw in enumerate(fw for fw in OURS if any(p[0] == fw for p in pairs)):
            ours = by_key[(ours_fw, nbytes)]
            parts = []
            for other_fw in (o for f, o in pairs if f == ours_fw):
                other = by_key[(other_fw, nbytes)]
                ratio = "n/a" if ours.error or other.error else _ratio(other.median / ours.median)
                parts.append(f"vs {other_fw} {ratio}")
            size = format_size(nbytes) if i == 0 else ""
            print(f"{size:>8}  {ours_fw:<6}: " + "   ".join(parts))


def write_json(path: str, args: argparse.Namespace, cells: Sequence[Cell]) -> None:
    data = {
        "method": method_line(args),
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "compute_ms": args.compute_ms,
        "results": [
            {
                "framework": c.framework,
                "workers": c.workers,
                "bytes": c.nbytes,
                "seconds": c.seconds,
                "error": c.error,
                "median_s": None if c.error else c.median,
                "p90_s": None if c.error else c.p90,
                "algbw_GBps": None if c.error else c.algbw,
                "busbw_GBps": None if c.error else c.busbw,
                "rss_before_MiB": c.rss_before_mib,
                "peak_MiB": c.peak_mib,
                "peak_per_tensor": c.peak_per_tensor,
                "memory_source": c.memory_source,
            }  # fmt: skip
            for c in cells
        ],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def available_frameworks(requested: Sequence[str], args: argparse.Namespace) -> List[str]:
    """Drops frameworks whose package is not installed, with a note; sets ``args.mpi`` (an
    :class:`MpiSetup`) when an MPI framework is requested and can run."""
    modules = {"gloo": "torch", "tf": "tensorflow", **{fw: "elasticdl_strategy" for fw in OURS}}
    mpi_requested = [fw for fw in requested if fw in MPI_FRAMEWORKS]
    if mpi_requested:
        args.mpi, why_no_mpi = find_mpi(args.mpi_python)
        if args.mpi is None:
            print(
                f"note: skipping {', '.join(mpi_requested)}: {why_no_mpi}; install: {MPI_INSTALL_HINT}",
                file=sys.stderr,
            )  # fmt: skip
    chosen = []
    for fw in requested:
        if fw in MPI_FRAMEWORKS:
            if args.mpi is not None:
                chosen.append(fw)
        elif importlib.util.find_spec(modules[fw]) is None:
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
    p.add_argument(
        "--compute-ms", type=float, default=0.0, help="spin this long before each timed call's barrier (default 0)"
    )
    p.add_argument(
        "--frameworks", type=_framework_list, default=list(FRAMEWORKS), help=f"default {','.join(FRAMEWORKS)}"
    )
    p.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    p.add_argument(
        "--timeout", type=float, default=RUN_TIMEOUT_S, help=f"seconds per framework and N (default {RUN_TIMEOUT_S:g})"
    )
    p.add_argument(
        "--cell-timeout", type=float, default=CELL_TIMEOUT_S,
        help=f"seconds one size may run before its run is stopped (default {CELL_TIMEOUT_S:g})",
    )  # fmt: skip
    p.add_argument(
        "--profile", metavar="PREFIX",
        help="after the table, profile our paths under py-spy: PREFIX.<framework>.rank<R>.txt (raw format)",
    )  # fmt: skip
    p.add_argument(
        "--tls", metavar="DIR",
        help="run our paths over (mutual) TLS with DIR/cert.pem, DIR/key.pem and DIR/ca.pem (valid for 127.0.0.1)",
    )  # fmt: skip
    p.add_argument("--profile-size", type=parse_size, default=parse_size("64MiB"), help="default 64MiB")
    p.add_argument("--profile-workers", type=int, default=2, help="default 2")
    p.add_argument("--profile-repeats", type=int, default=20, help="timed calls in the profiled run (default 20)")
    p.add_argument(
        "--mpi-python", metavar="PY",
        help=f"interpreter with mpi4py (on Open MPI) and numpy for the MPI workers (default {DEFAULT_MPI_PYTHON} "
        "if it has them, else this one)",
    )  # fmt: skip
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: worker mode
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)  # internal: where rank 0 writes
    p.add_argument("--fixed-repeats", action="store_true", help=argparse.SUPPRESS)  # internal: no repeats_for
    args = p.parse_args(argv)
    args.mpi = None  # the MpiSetup, found by available_frameworks
    if args.repeats < 1 or args.warmup < 0 or args.profile_repeats < 1 or args.profile_workers < 1:
        p.error("--repeats, --profile-repeats and --profile-workers must be >= 1 and --warmup >= 0")
    if not 0 <= args.compute_ms <= 60_000:
        p.error(f"--compute-ms must be between 0 and 60000, not {args.compute_ms:g}")
    if args.timeout <= 0 or args.cell_timeout <= 0:
        p.error("--timeout and --cell-timeout must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(
            args.worker, args.sizes, args.repeats, args.warmup, args.results, args.fixed_repeats, args.compute_ms / 1e3
        )
    sigterm_interrupts()
    frameworks = available_frameworks(args.frameworks, args)
    print(method_line(args))
    cells: List[Cell] = []

    def body() -> None:
        for workers in args.workers:
            run_cells = [c for fw in frameworks for c in run_one(fw, workers, args)]
            cells.extend(run_cells)
            print_table(workers, run_cells, frameworks, args.sizes)
            sys.stdout.flush()
        if args.profile:
            run_profiles(args, frameworks)

    def save() -> None:
        if args.json and cells:
            write_json(args.json, args, cells)

    return run_benchmark(body, save)


if __name__ == "__main__":
    sys.exit(main())
