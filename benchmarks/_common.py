"""What the benchmarks share: starting, watching and stopping worker processes, and small helpers.

Each benchmark starts its contenders as processes in their own sessions, waits for them with a
timeout, and stops every one of them by pid (process group and every descendant) whatever
happened; SIGTERM to the benchmark raises KeyboardInterrupt (:func:`raise_interrupt`), so that
its ``finally`` blocks stop the workers too.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

RUN_TIMEOUT_S = 600.0  # per contender and worker count
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping a process
LOG_TAIL_LINES = 20


def launch(commands, log: Path, procs: List[subprocess.Popen]) -> None:
    """Starts each ``(argv, env)`` in a session of its own, stdout and stderr of all into ``log``;
    appends each to ``procs`` as it starts (so that the caller's ``finally: stop(procs)`` stops
    those started before a failure too)."""
    with open(log, "wb") as out:
        for argv, env in commands:
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )  # fmt: skip


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def describe(error: Exception, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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


@dataclass(frozen=True)
class Descendant:
    pid: int
    pgid: int
    start: str  # start time in clock ticks since boot: tells a reused pid apart

    def alive(self) -> bool:
        fields = _proc_stat(self.pid)
        return fields is not None and fields[19] == self.start and fields[0] not in ("Z", "X")


def _proc_stat(pid: int) -> Optional[List[str]]:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, ..., field 22 start time at index 19), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return fields if len(fields) > 19 else None


def descendants(pid: int) -> List[Descendant]:
    """Every process below ``pid`` (children, their children, ...), from /proc; empty where there is none."""
    children: Dict[int, List[int]] = collections.defaultdict(list)
    stats: Dict[int, List[str]] = {}
    try:
        entries = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        fields = _proc_stat(entry)
        if fields is not None:
            stats[entry] = fields
            children[int(fields[1])].append(entry)
    found, todo = [], list(children[pid])
    while todo:
        child = todo.pop()
        found.append(Descendant(child, int(stats[child][2]), stats[child][19]))
        todo += children[child]
    return found


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each process group by pid and every descendant outside it (``mpirun`` puts each rank in a
    process group of its own), then SIGKILL what is left after a grace period."""
    strays = [d for p in procs if p.poll() is None for d in descendants(p.pid) if d.pgid != p.pid]
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        strays = [d for d in strays if d.alive()]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # each child leads its own session, so pgid == pid
            except ProcessLookupError:
                pass
        for d in strays:
            try:
                os.kill(d.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while any(d.alive() for d in strays) and time.monotonic() < deadline:
            time.sleep(0.05)


def read_report(results: Path) -> Optional[dict]:
    try:
        return json.loads(results.read_text())
    except (OSError, ValueError):
        return None


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, results: Path, cell_timeout: float) -> Optional[str]:
    """Waits for all processes; returns why the run failed (a non-zero exit, the run's timeout, or one
    size running longer than ``cell_timeout``, seen in rank 0's ``current``), or None."""
    started = time.monotonic()
    deadline = started + timeout
    current: Optional[str] = None
    current_since = started
    next_check = started
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return f"process {failed[0][0]} exited with code {failed[0][1]}"
        if all(c == 0 for c in codes):
            return None
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 0.5
            report = read_report(results)
            running = report.get("current") if report else None
            if running != current:
                current, current_since = running, now
            elif current is not None and now - current_since > cell_timeout:
                return f"{format_size(int(current))} timed out after {cell_timeout:g} s"
        time.sleep(0.1)
    return f"timed out after {timeout:g} s"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in text[-lines:])


def raise_interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def sigterm_interrupts() -> None:
    """From now on SIGTERM raises KeyboardInterrupt, so that ``finally`` blocks stop the workers and
    clean up; call it first in a benchmark's ``main`` (before data generation and probes too)."""
    signal.signal(signal.SIGTERM, raise_interrupt)


def run_benchmark(body: Callable[[], None], save: Callable[[], None]) -> int:
    """Runs a benchmark's ``body``, then ``save`` (the JSON results) whatever happened.

    Returns:
        the exit status: 0, or 130 when interrupted (SIGINT, or SIGTERM after :func:`sigterm_interrupts`).
    """
    try:
        body()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        save()
    return 0
