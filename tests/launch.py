"""Test helper: run a job through the real launcher (``python -m elasticdl_strategy run``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from typing import Dict, List, Optional, Sequence

WORKERS_DIR = os.path.join(os.path.dirname(__file__), "workers")
# Worker scripts import tests.* helpers: make the checkout importable whatever the cwd.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The payload paths between workers on one host: what each selects in the workers' environment
# ("host-segment": shared memory with small all-reduces in a host segment, the default).
TRANSPORTS = ("host-segment", "shared-memory", "data-socket", "grpc")


def transport_env(transport: str) -> Dict[str, str]:
    """Worker environment selecting ``transport`` (one of :data:`TRANSPORTS`)."""
    assert transport in TRANSPORTS, transport
    return {
        "EDL_SHARED_MEMORY": "1" if transport in ("host-segment", "shared-memory") else "0",
        "EDL_DATA_SOCKET": "0" if transport == "grpc" else "1",
        "EDL_HOST_SEGMENT_BYTES": str(256 << 10) if transport == "host-segment" else "0",
    }


def worker_script(name: str) -> str:
    return os.path.join(WORKERS_DIR, name)


def launcher_argv(workers: int, command: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(workers), *extra, "--", *command]


def run_alone(command: Sequence[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Runs ``command`` without the launcher's environment: a single worker, rank 0 of 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(list(command), capture_output=True, text=True, env=env, timeout=timeout)


def read_reports(results_dir, ranks) -> List[dict]:
    """The JSON reports that worker scripts wrote with ``tests.workers.report.write_report``."""
    return [json.loads(open(os.path.join(results_dir, f"rank{r}.json")).read()) for r in ranks]


def run_job(
    workers: int,
    command: Sequence[str],
    extra: Sequence[str] = (),
    timeout: float = 120.0,
    env: Optional[Dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Runs the launcher to completion; afterwards kills every process the job started."""
    job = Job(launcher_argv(workers, command, extra), env)
    try:
        out, err = job.proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(job.proc.args, job.proc.returncode, out, err)
    finally:
        job.kill()


class Job:
    """A launcher process; every process it starts carries a marker in its environment,
    so :meth:`kill` finds and kills them by pid even after they are re-parented."""

    def __init__(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None, output=None):
        """``output``: a file that takes stdout and stderr (for a test that waits on the job
        without reading its pipes); by default both are pipes."""
        self.marker = f"{_MARKER}={uuid.uuid4().hex}"
        key, value = self.marker.split("=")
        full_env = {**os.environ, **(env or {}), key: value}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, full_env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            list(argv),
            stdout=output or subprocess.PIPE,
            stderr=subprocess.STDOUT if output else subprocess.PIPE,
            text=True,
            env=full_env,
            start_new_session=True,
        )

    def pids(self) -> List[int]:
        found = []
        needle = self.marker.encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    pass
        return found

    def kill(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


_MARKER = "EDL_TEST_JOB"
