"""Waiting on a 32-bit word of shared memory, across processes: Linux futexes, through ``ctypes``.

A lane's receiver sleeps in :func:`wait` until the word changes (the sender
bumped its write counter) and the sender :func:`wake`\\ s it after every
publish. The kernel compares the word before sleeping, so a publish that
happens between the reader's last look and its sleep makes ``wait`` return at
once: no wake-up is lost. ``ctypes`` releases the GIL for the call, so other
threads run while one sleeps here.

Only Linux on x86-64 (where the futex system call is number 202): elsewhere
:data:`AVAILABLE` is false and lanes are not used.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
from typing import Literal

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not the _PRIVATE variants
AVAILABLE = sys.platform.startswith("linux") and _SYS_FUTEX is not None

if AVAILABLE:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleeps while the 32-bit word at ``address`` holds ``expected``, at most ``timeout`` seconds.

    Returns when woken, when the word differs, on a signal, or at the timeout (callers look again).
    """
    seconds = max(0.0, timeout)
    spec = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    result = _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected),
                      ctypes.byref(spec), None, 0)  # fmt: skip
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, os.strerror(code))


def wake(address: int) -> None:
    """Wakes every thread or process sleeping in :func:`wait` on the word at ``address``."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_BARRIER = threading.Lock()


def memory_barrier() -> None:
    """A full memory barrier: no load after it is taken before a store ahead of it is visible.

    Taking and releasing a lock is an atomic read-modify-write in the C library (a ``lock``-
    prefixed instruction: a full barrier on x86-64, the only machine futexes are used on, see
    :data:`AVAILABLE`); numpy and Python have no barrier of their own.
    """
    with _BARRIER:
        pass


def word(mapping: mmap.mmap, offset: int, kind: Literal["I", "Q"]) -> memoryview:
    """The 4-byte ("I") or 8-byte ("Q") word at ``offset`` (a multiple of its size) as a one-element
    memoryview: an aligned load or store of a Python int, 3x faster than through numpy."""
    return memoryview(mapping)[offset : offset + struct.calcsize(kind)].cast(kind)
