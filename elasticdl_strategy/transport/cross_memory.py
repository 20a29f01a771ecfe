"""Reading another process's memory in one copy: Linux cross-memory attach, through ``ctypes``.

Shared memory moves a payload in two copies: the sender's into a shared file, the receiver's out
of it. ``process_vm_readv`` lets a process copy straight out of another's address space (the
kernel copies between the two processes' pages), so a large all-reduce between processes of one
host reads each peer's array where it lies (:mod:`elasticdl_strategy.collective.host_allreduce`),
as Open MPI's shared-memory transport does with the same call.

The kernel allows it where the caller may trace the other process: the same user, and no
Yama or container policy against it (a pod without ``SYS_PTRACE`` under ``ptrace_scope`` 1, some
sandboxes). Nothing here finds that out in advance: callers try a read (:func:`read`) of a word
whose value they know and use the call only if every read succeeded. ``ctypes`` releases the
GIL for the call.

Example (two processes; ``address`` is where the other one's array starts, ``pid`` its id)::

    mine = np.empty(1024, np.float32)
    read(pid, address, mine)  # its first 4 KiB, now here
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any, List, Sequence, Tuple

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv: Any = None
if sys.platform.startswith("linux"):
    _readv = getattr(ctypes.CDLL(None, use_errno=True), "process_vm_readv", None)  # None: an old C library
    if _readv is not None:
        _vector = (ctypes.c_void_p, ctypes.c_ulong)  # iovecs and their count
        _readv.restype = ctypes.c_ssize_t
        _readv.argtypes = [ctypes.c_int, *_vector, *_vector, ctypes.c_ulong]
AVAILABLE = _readv is not None


# The most one call copies: the kernel copies at most 2 GiB - 4 KiB a call and says nothing of the rest.
MAX_CALL_BYTES = 1 << 30
# The most pieces one call copies (the kernel's IOV_MAX).
MAX_PIECES = 1024


def read(pid: int, address: int, into: np.ndarray) -> None:
    """Copies ``into.nbytes`` bytes from ``address`` in process ``pid`` into ``into`` (C-contiguous),
    in calls of at most :data:`MAX_CALL_BYTES`.

    Raises:
        OSError: the kernel refused (``EPERM``: not allowed to trace it; ``ESRCH``: no such
            process; ``EFAULT``: not mapped there), or copied less than asked (``EFAULT``).
    """
    read_pieces(pid, [(address, into)])


def read_pieces(pid: int, pieces: Sequence[Tuple[int, np.ndarray]]) -> None:
    """For each ``(address, into)`` of ``pieces``, copies ``into.nbytes`` bytes from ``address`` in
    process ``pid`` into ``into`` (C-contiguous): many pieces in one call, up to :data:`MAX_PIECES`
    pieces and :data:`MAX_CALL_BYTES` bytes a call.

    Raises:
        OSError: as :func:`read`.
    """
    batch: List[Tuple[int, int, int]] = []  # (remote address, local address, bytes)
    total = 0
    for address, into in pieces:
        start, nbytes = into.ctypes.data, into.nbytes
        for offset in range(0, nbytes, MAX_CALL_BYTES):
            size = min(MAX_CALL_BYTES, nbytes - offset)
            if len(batch) == MAX_PIECES or total + size > MAX_CALL_BYTES:
                _read_batch(pid, batch, total)
                batch, total = [], 0
            batch.append((address + offset, start + offset, size))
            total += size
    if batch:
        _read_batch(pid, batch, total)


def _read_batch(pid: int, batch: List[Tuple[int, int, int]], total: int) -> None:
    local = (_Iovec * len(batch))(*(_Iovec(here, size) for _, here, size in batch))
    remote = (_Iovec * len(batch))(*(_Iovec(there, size) for there, _, size in batch))
    copied = _readv(pid, local, len(batch), remote, len(batch), 0)
    if copied != total:
        code = ctypes.get_errno() if copied < 0 else errno.EFAULT  # a short read ends at an unmapped page
        raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)} ({copied} of {total} bytes)")
