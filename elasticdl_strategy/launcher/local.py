"""``elasticdl-strategy run``: the coordinator and N workers as processes on this machine.

The launcher makes the job token, starts the coordinator, then N copies of the
command with the environment ``collective.init()`` reads. Every output line
is prefixed with ``[worker i]``; SIGINT and SIGTERM are forwarded to all
workers. It exits 0 when every worker does; otherwise it says which worker
failed first, with its exit code and the last lines of its stderr, stops the
others and exits 1.
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
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.options import TLSConfig

logger = logging.getLogger(__name__)

_STDERR_TAIL_LINES = 20
_COORDINATOR_START_TIMEOUT_S = 30.0
_STOP_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """A validated ``run`` request; construction raises ConfigError with a one-line message."""

    command: Sequence[str]
    workers: int
    min_workers: int
    max_workers: int
    port: int = 0
    host: str = "127.0.0.1"
    timeout_s: Optional[float] = None
    rendezvous_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0
    failure_grace_s: float = 5.0
    tls: Optional[TLSConfig] = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("missing command: use `elasticdl-strategy run --workers N -- CMD ARGS...`")
        if shutil.which(self.command[0]) is None:
            raise ConfigError(f"command not found: {self.command[0]!r}")
        if self.workers < 1:
            raise ConfigError(f"--workers={self.workers} must be at least 1")
        if not 1 <= self.min_workers <= self.workers:
            raise ConfigError(f"--min-workers={self.min_workers} must be between 1 and --workers={self.workers}")
        if self.max_workers < self.workers:
            raise ConfigError(f"--max-workers={self.max_workers} must be at least --workers={self.workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port} is not a port number")
        for name in ("rendezvous_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"--timeout={self.timeout_s} must be positive")
        if self.port:
            check_port_free(self.host, self.port)


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
        self, name: str, argv: Sequence[str], env: Dict[str, str], out: TextIO, err: TextIO, lock: threading.Lock
    ):
        self.name = name
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
        self.exited_at: Optional[float] = None
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

        config = LaunchConfig(["python", "train.py"], workers=2, min_workers=2, max_workers=2)
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

    def _start_coordinator(self) -> str:
        c = self.config
        with tempfile.TemporaryDirectory(prefix="edl-launcher-") as tmp:
            port_file = os.path.join(tmp, "port")
            argv = [
                sys.executable, "-m", "elasticdl_strategy", "coordinator",
                "--bind", c.host, "--port", str(c.port), "--port-file", port_file,
                "--workers", str(c.workers), "--min-workers", str(c.min_workers),
                "--max-workers", str(c.max_workers), "--heartbeat-timeout", str(c.heartbeat_timeout_s),
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
                port = int(f.read())
        return f"{c.host}:{port}"

    def _worker_env(self, index: int, coordinator: str) -> Dict[str, str]:
        env = self._base_env()
        env.update(
            {
                environment.COORDINATOR_ADDR: coordinator,
                environment.WORKER_ID: f"worker-{index}",
                environment.BIND_HOST: self.config.host,
                environment.RENDEZVOUS_TIMEOUT: str(self.config.rendezvous_timeout_s),
                "EDL_LOCAL_INDEX": str(index),
            }
        )
        if self.config.timeout_s is not None:
            env["EDL_TIMEOUT"] = str(self.config.timeout_s)
        return env

    def _forward(self, sig: int, _frame=None) -> None:
        self._stop_signal = sig
        for worker in self._workers:
            worker.signal(sig)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            coordinator = self._start_coordinator()
            for i in range(self.config.workers):
                self._workers.append(
                    _Process(
                        f"worker {i}",
                        self.config.command,
                        self._worker_env(i, coordinator),
                        self._out,
                        self._err,
                        self._lock,
                    )
                )
            return self._supervise()
        except ConfigError as e:
            self._say(f"error: {e}")
            return 1
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _failures(self) -> List[_Process]:
        failed = [w for w in self._workers if w.exited.is_set() and w.popen.returncode != 0]
        return sorted(failed, key=lambda w: w.exited_at)

    def _supervise(self) -> int:
        while True:
            running = [w for w in self._workers if not w.exited.is_set()]
            failures = self._failures()
            if not running:
                break
            if failures and time.monotonic() - failures[0].exited_at > self.config.failure_grace_s:
                break
            if self._coordinator is not None and self._coordinator.popen.poll() is not None:
                self._say(f"the coordinator exited with code {self._coordinator.popen.returncode}")
                return 1
            time.sleep(0.05)
        failures = self._failures()
        if not failures:
            if self._stop_signal is not None:
                return 128 + self._stop_signal
            return 0
        first_failure = failures[0]
        first_failure.flush_output()
        code = first_failure.popen.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = "\n".join("    " + line for line in first_failure.stderr_tail) or "    (no stderr output)"
        self._say(f"{first_failure.name} {how}; last lines of its stderr:\n{tail}")
        if len(failures) > 1:
            self._say(f"after it, also failed: {', '.join(w.name for w in failures[1:])}")
        return 1

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
