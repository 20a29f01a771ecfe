"""``elasticdl-strategy run``: the coordinator and N workers as processes on this machine.

The launcher makes the job token, starts the coordinator, then N copies of the
command with the environment ``runtime.init()`` reads. Every output line
is prefixed with ``[worker i]``; SIGINT and SIGTERM are forwarded to all
workers. It exits 0 when every worker does; otherwise it says which worker
failed first, with its exit code and the last lines of its stderr, stops the
others and exits 1.

An elastic job (``--min-workers`` below ``--workers``, ``--max-restarts``, or
more workers than ``--max-workers``, the extra ones waiting as standbys) is
not stopped by a failed worker: the others carry on, a failed worker is
started again under a new worker id while restarts remain, and the job
succeeds when the workers still in it finish. A coordinator that dies is
started again on the same port; the workers re-register and it recovers the
job's state from them.

Every worker has a slot, 0 .. N-1 (``EDL_LOCAL_RANK``, of ``EDL_LOCAL_SIZE`` = N); a
replacement takes the slot of the worker it replaces. ``--gpus-per-worker G`` gives
each slot its own G GPUs (``launcher/gpus.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence, TextIO

from elasticdl_strategy import environment
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher.gpus import GpuPool
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.options import TLSConfig

logger = logging.getLogger(__name__)

_STDERR_TAIL_LINES = 20
_COORDINATOR_START_TIMEOUT_S = 30.0
_STOP_GRACE_S = 5.0
# After forwarding SIGINT/SIGTERM, how long workers get to finish their step, commit and leave.
_SIGNAL_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """A validated ``run`` request; construction raises ConfigError with a one-line message."""

    command: Sequence[str]
    workers: int
    min_workers: Optional[int] = None  # default: the workers started, up to max_workers
    max_workers: Optional[int] = None  # default: workers
    port: int = 0
    host: str = "127.0.0.1"
    timeout_s: Optional[float] = None
    rendezvous_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0
    failure_grace_s: float = 5.0
    max_restarts: int = 0
    tls: Optional[TLSConfig] = None
    # GPUs per worker through CUDA_VISIBLE_DEVICES (0: left alone), from ``gpu_pool``:
    # by default the launcher's own (its CUDA_VISIBLE_DEVICES, else nvidia-smi -L).
    gpus_per_worker: int = 0
    gpu_pool: Optional[GpuPool] = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("missing command: use `elasticdl-strategy run --workers N -- CMD ARGS...`")
        if shutil.which(self.command[0]) is None:
            raise ConfigError(f"command not found: {self.command[0]!r}")
        self.counts  # validates the worker counts
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port} is not a port number")
        for name in ("rendezvous_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"--timeout={self.timeout_s} must be positive")
        self._check_gpus()
        if self.port:
            check_port_free(self.host, self.port)

    def _check_gpus(self) -> None:
        if self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker={self.gpus_per_worker} must not be negative")
        if self.gpus_per_worker == 0:
            return
        if self.gpu_pool is None:
            object.__setattr__(self, "gpu_pool", GpuPool.discover(os.environ))
        assert self.gpu_pool is not None
        self.gpu_pool.check(self.workers, self.gpus_per_worker)

    @property
    def counts(self) -> WorkerCounts:
        return WorkerCounts.of(self.workers, self.min_workers, self.max_workers, self.max_restarts)

    @property
    def elastic(self) -> bool:
        """Whether the job survives the loss of a worker."""
        return self.counts.elastic


def check_port_free(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--port={port}: cannot listen on {host}:{port} ({e.strerror})") from None


class _Process:
    """A child process whose output is copied line by line with a prefix."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Dict[str, str],
        out: TextIO,
        err: TextIO,
        lock: threading.Lock,
        slot: int = -1,
    ):
        self.name = name
        self.slot = slot  # a worker's EDL_LOCAL_RANK
        self.stderr_tail: Deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.popen = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # our own signal forwarding, not the terminal's
        )
        self._pumps = [
            threading.Thread(target=self._pump, args=(self.popen.stdout, out, lock, None), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr, err, lock, self.stderr_tail), daemon=True),
        ]
        for pump in self._pumps:
            pump.start()
        # Reaped in its own thread so the exit times give the order in which workers failed.
        self.exited_at = float("inf")  # when it exited (monotonic clock)
        self.exited = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.popen.wait()
        self.exited_at = time.monotonic()
        self.exited.set()

    def _pump(self, stream, sink: TextIO, lock: threading.Lock, tail: Optional[Deque[str]]) -> None:
        prefix = f"[{self.name}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            with lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        stream.close()

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def flush_output(self, timeout: float = 2.0) -> None:
        for pump in self._pumps:
            pump.join(timeout)


class LocalLauncher:
    """Runs one job on this machine; :meth:`run` returns the launcher's exit code.

    Example::

        config = LaunchConfig(["python", "train.py"], workers=2)
        sys.exit(LocalLauncher(config).run())
    """

    def __init__(self, config: LaunchConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.config = config
        self._out, self._err = out, err
        self._lock = threading.Lock()
        self._token = new_token()
        self._coordinator: Optional[_Process] = None
        self._workers: List[_Process] = []
        self._stop_signal: Optional[int] = None
        self._stop_signal_at = 0.0
        self._coordinator_port = 0
        self._coordinator_address = ""
        self._next_index = 0
        self._restarts = 0
        self._handled: set = set()  # failed workers already relaunched or accepted

    def _say(self, message: str) -> None:
        with self._lock:
            self._err.write(f"[launcher] {message}\n")
            self._err.flush()

    def _base_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env[environment.JOB_TOKEN] = self._token
        env["PYTHONUNBUFFERED"] = "1"
        if self.config.tls is not None:
            env.update(self.config.tls.to_env())
        return env

    def _start_coordinator(self, port: Optional[int] = None) -> str:
        c = self.config
        with tempfile.TemporaryDirectory(prefix="edl-launcher-") as tmp:
            port_file = os.path.join(tmp, "port")
            argv = [
                sys.executable, "-m", "elasticdl_strategy", "coordinator",
                "--bind", c.host, "--port", str(c.port if port is None else port), "--port-file", port_file,
                "--workers", str(c.counts.target), "--min-workers", str(c.counts.min_workers),
                "--max-workers", str(c.counts.max_workers), "--heartbeat-timeout", str(c.heartbeat_timeout_s),
                "--heartbeat-interval", str(min(1.0, c.heartbeat_timeout_s / 4)),
            ]  # fmt: skip
            self._coordinator = _Process("coordinator", argv, self._base_env(), self._out, self._err, self._lock)
            deadline = time.monotonic() + _COORDINATOR_START_TIMEOUT_S
            while not os.path.exists(port_file):
                code = self._coordinator.popen.poll()
                if code is not None:
                    self._coordinator.flush_output()
                    raise ConfigError(
                        f"the coordinator exited with code {code} before serving: "
                        + " | ".join(self._coordinator.stderr_tail)
                    )
                if time.monotonic() > deadline:
                    raise ConfigError(f"the coordinator did not start within {_COORDINATOR_START_TIMEOUT_S:g}s")
                time.sleep(0.05)
            with open(port_file) as f:
                self._coordinator_port = int(f.read())
        return f"{c.host}:{self._coordinator_port}"

    def _worker_env(self, index: int, slot: int, coordinator: str) -> Dict[str, str]:
        env = self._base_env()
        env.update(
            {
                environment.COORDINATOR_ADDR: coordinator,
                environment.WORKER_ID: f"worker-{index}",
                environment.BIND_HOST: self.config.host,
                environment.RENDEZVOUS_TIMEOUT: str(self.config.rendezvous_timeout_s),
                environment.LOCAL_INDEX: str(index),
                environment.LOCAL_RANK: str(slot),
                environment.LOCAL_SIZE: str(self.config.workers),
            }
        )
        if self.config.gpu_pool is not None and self.config.gpus_per_worker:
            env[environment.CUDA_VISIBLE_DEVICES] = self.config.gpu_pool.for_slot(slot, self.config.gpus_per_worker)
        if self.config.timeout_s is not None:
            env["EDL_TIMEOUT"] = str(self.config.timeout_s)
        # Like torchrun's OMP_NUM_THREADS: N workers each sizing their thread pools to every core
        # oversubscribe the machine (measured: MLP step 44.5 -> 40 ms at N = 2 on 2 cores).
        for name, value in self._thread_env().items():
            env.setdefault(name, value)
        return env

    def _thread_env(self) -> Dict[str, str]:
        """Per-worker thread counts (cores / training workers), unless the user set them."""
        threads = str(max(1, (os.cpu_count() or 1) // self.config.counts.target))
        return {"TF_NUM_INTRAOP_THREADS": threads, "OMP_NUM_THREADS": threads}

    def _forward(self, sig: int, _frame=None) -> None:
        self._stop_signal = sig
        self._stop_signal_at = time.monotonic()
        for worker in self._workers:
            worker.signal(sig)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._coordinator_address = self._start_coordinator()
            self._say_gpus()
            for slot in range(self.config.workers):
                self._start_worker(slot)
            return self._supervise()
        except ConfigError as e:
            self._say(f"error: {e}")
            return 1
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _say_gpus(self) -> None:
        pool, per_worker = self.config.gpu_pool, self.config.gpus_per_worker
        if pool is None or not per_worker:
            return
        slots = "; ".join(f"slot {slot}: {pool.for_slot(slot, per_worker)}" for slot in range(self.config.workers))
        unchecked = f" (unchecked: {pool.source})" if pool.gpus is None else ""
        self._say(f"CUDA_VISIBLE_DEVICES per worker slot{unchecked}: {slots}")

    def _start_worker(self, slot: int) -> _Process:
        """Starts the next worker in ``slot`` (a replacement: the slot of the worker it replaces)."""
        index = self._next_index
        self._next_index += 1
        worker = _Process(
            f"worker {index}",
            self.config.command,
            self._worker_env(index, slot, self._coordinator_address),
            self._out,
            self._err,
            self._lock,
            slot=slot,
        )
        self._workers.append(worker)
        return worker

    def _describe_exit(self, process: _Process) -> str:
        code = process.popen.returncode
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def _handle_elastic_failures(self) -> None:
        """Relaunches failed workers while restarts remain; the job carries on either way."""
        for failed in self._failures():
            if id(failed) in self._handled:
                continue
            self._handled.add(id(failed))
            if self._stop_signal is not None:
                continue
            if self._restarts < self.config.counts.max_restarts:
                self._restarts += 1
                replacement = self._start_worker(failed.slot)
                self._say(
                    f"{failed.name} {self._describe_exit(failed)}; started {replacement.name} in its place "
                    f"(restart {self._restarts} of {self.config.counts.max_restarts})"
                )
            else:
                self._say(f"{failed.name} {self._describe_exit(failed)}; the other workers carry on without it")

    def _restart_coordinator(self) -> bool:
        assert self._coordinator is not None
        code = self._coordinator.popen.returncode
        if not self.config.elastic or self._stop_signal is not None:
            self._say(f"the coordinator exited with code {code}")
            return False
        self._say(f"the coordinator exited with code {code}; starting it again on port {self._coordinator_port}")
        try:
            self._start_coordinator(port=self._coordinator_port)
        except ConfigError as e:
            self._say(f"the coordinator could not be started again: {e}")
            return False
        return True

    def _failures(self) -> List[_Process]:
        failed = [w for w in self._workers if w.exited.is_set() and w.popen.returncode != 0]
        return sorted(failed, key=lambda w: w.exited_at)

    def _supervise(self) -> int:
        while True:
            if self.config.elastic:
                self._handle_elastic_failures()
            running = [w for w in self._workers if not w.exited.is_set()]
            failures = self._failures()
            if not running:
                break
            if self._stop_signal is not None and time.monotonic() - self._stop_signal_at > _SIGNAL_GRACE_S:
                self._say(f"{len(running)} worker(s) still running {_SIGNAL_GRACE_S:g}s after the signal: killing them")
                break
            if (
                not self.config.elastic
                and failures
                and time.monotonic() - failures[0].exited_at > self.config.failure_grace_s
            ):
                break
            if self._coordinator is not None and self._coordinator.popen.poll() is not None:
                if not self._restart_coordinator():
                    return 1
            time.sleep(0.05)
        failures = self._failures()
        if self.config.elastic and any(w.popen.returncode == 0 for w in self._workers):
            # The job finished: workers it lost on the way were reported when they failed.
            failures = [w for w in failures if w.exited_at > self._last_success_at()]
        if not failures:
            if self._stop_signal is not None:
                return 128 + self._stop_signal
            return 0
        first_failure = failures[0]
        first_failure.flush_output()
        how = self._describe_exit(first_failure)
        tail = "\n".join("    " + line for line in first_failure.stderr_tail) or "    (no stderr output)"
        self._say(f"{first_failure.name} {how}; last lines of its stderr:\n{tail}")
        if len(failures) > 1:
            others = ", ".join(f"{w.name} ({self._describe_exit(w)})" for w in failures[1:])
            self._say(f"after it, also failed: {others}")
        return 1

    def _last_success_at(self) -> float:
        return max(w.exited_at for w in self._workers if w.popen.returncode == 0)

    def _stop_all(self) -> None:
        processes = self._workers + ([self._coordinator] if self._coordinator else [])
        for p in processes:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in processes:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGKILL)
                p.popen.wait(timeout=_STOP_GRACE_S)
        for p in processes:
            p.flush_output()
