"""A process that holds a known array for tests that read another process's memory."""

import contextlib
import functools
import subprocess
import sys
from typing import Iterator, Tuple

import numpy as np

from elasticdl_strategy.transport import cross_memory

# Holds np.arange(300000, dtype=float32), says its pid and where the array lies, and waits for a
# line on its input (or its end).
_HOLDER = (
    "import numpy as np, os, sys; a = np.arange(300000, dtype=np.float32); "
    "print(os.getpid(), a.ctypes.data, flush=True); sys.stdin.readline()"
)


@contextlib.contextmanager
def holder() -> Iterator[Tuple[int, int]]:
    """``(pid, address)`` of a process holding the array; the process is killed on exit (by pid).
    Its first line comes or it exits (then the unpacking raises): the read cannot hang."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid, address = (int(word) for word in process.stdout.readline().split())
        yield pid, address
    finally:
        process.kill()
        process.wait()


@functools.lru_cache(maxsize=1)
def cross_memory_allowed() -> bool:
    """Whether this machine lets a process read another of its user's (a policy may forbid it)."""
    if not cross_memory.AVAILABLE:
        return False
    with holder() as (pid, address):
        into = np.empty(4, np.float32)
        try:
            cross_memory.read(pid, address, into)
        except OSError:
            return False
        return into.tolist() == [0.0, 1.0, 2.0, 3.0]
