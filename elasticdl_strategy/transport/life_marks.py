"""Life marks: a same-host peer's death seen as its threads end, not when its sockets close.

A killed process's files are closed only after the kernel has torn down its
memory: a TensorFlow worker with 0.6–1.1 GiB resident takes 50–90 ms from
SIGKILL to the end of its connections (measured on the 2-core development VM),
all of it time its peers spend waiting for a message that will not come.
Robust mutexes end sooner: as each thread of a dying process exits, before
its memory goes, the kernel marks the robust mutexes the thread holds as
owner-dead and wakes a waiter (``set_robust_list(2)``).

So a sender :func:`hold`\\ s a process-shared robust mutex in the first page of
each arena it offers (one thread of its own holds it for as long as the
stream lives), and the receiver that mapped the arena :func:`watch`\\ es it: a
thread waits to lock it and is woken at once with ``EOWNERDEAD`` when the
sender dies. A sender that ends its stream on purpose releases the mark
*before* its goodbye, so the watcher then just gets the lock and stops.

Both sides keep a ctypes view of the arena while they use its mutex, so the
mapping cannot be unmapped under them (``mmap.close`` refuses while a view is
exported).

Only Linux with glibc on x86-64 (where ``pthread_mutex_t`` takes 40 bytes of
the :data:`MARK_BYTES` reserved for it): elsewhere :data:`AVAILABLE` is false
and deaths are seen when the connection breaks, as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import platform
import threading
import time
from typing import Callable

from elasticdl_strategy.transport import futex

logger = logging.getLogger(__name__)

MARK_BYTES = 64  # room for a pthread_mutex_t (40 bytes with glibc on x86-64)
_ATTR_BYTES = 8  # pthread_mutexattr_t (4 bytes)
_PROCESS_SHARED = 1  # PTHREAD_PROCESS_SHARED
_ROBUST = 1  # PTHREAD_MUTEX_ROBUST
_WATCH_SLICE_S = 1.0  # how often a watcher looks whether it was stopped
_HOLD_TIMEOUT_S = 5.0

AVAILABLE = futex.AVAILABLE and platform.libc_ver()[0] == "glibc"
_CLOCK_MONOTONIC = 1
_HAS_CLOCKLOCK = False
if AVAILABLE:
    _libc = ctypes.CDLL(None, use_errno=True)
    AVAILABLE = hasattr(_libc, "pthread_mutex_timedlock") and hasattr(_libc, "pthread_mutexattr_setrobust")
    _HAS_CLOCKLOCK = hasattr(_libc, "pthread_mutex_clocklock")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _lock_within(mutex: ctypes.Array, seconds: float) -> int:
    """Locks ``mutex``, waiting at most ``seconds``; returns 0, ``EOWNERDEAD``, ``ETIMEDOUT`` or another error."""
    if _HAS_CLOCKLOCK:  # glibc 2.30+: a deadline on the monotonic clock, which no clock step moves
        deadline = time.monotonic() + seconds  # CLOCK_MONOTONIC on Linux
        spec = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
        return _libc.pthread_mutex_clocklock(mutex, _CLOCK_MONOTONIC, ctypes.byref(spec))
    deadline = time.time() + seconds
    spec = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
    return _libc.pthread_mutex_timedlock(mutex, ctypes.byref(spec))


def _mutex_at(mapping: mmap.mmap, offset: int) -> ctypes.Array:
    """A ctypes view of the mark's bytes (it keeps ``mapping`` mapped while it lives)."""
    return (ctypes.c_char * MARK_BYTES).from_buffer(mapping, offset)


class HeldMark:
    """The sender's side: a thread of this process holds the mark until :meth:`release`."""

    def __init__(self, mapping: mmap.mmap, offset: int):
        self._mutex = _mutex_at(mapping, offset)
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        for result in (
            _libc.pthread_mutexattr_init(attr),
            _libc.pthread_mutexattr_setpshared(attr, _PROCESS_SHARED),
            _libc.pthread_mutexattr_setrobust(attr, _ROBUST),
            _libc.pthread_mutex_init(self._mutex, attr),
        ):
            if result:
                raise OSError(result, f"cannot make a life mark: {errno.errorcode.get(result, result)}")
        self._locked = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="edl-life-mark", daemon=True)
        self._thread.start()
        if not self._locked.wait(_HOLD_TIMEOUT_S):
            self._released.set()  # should it lock after all, it lets go at once
            raise OSError(errno.ETIMEDOUT, "the life mark's thread did not start")

    def _hold(self) -> None:
        # The kernel frees a robust mutex when the thread holding it ends: this thread must live on.
        _libc.pthread_mutex_lock(self._mutex)
        self._locked.set()
        self._released.wait()
        _libc.pthread_mutex_unlock(self._mutex)

    def release(self) -> None:
        """Lets go of the mark on purpose (a watcher then stops without a word); idempotent."""
        self._released.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_HOLD_TIMEOUT_S)


class Watch:
    """The receiver's side: a thread waiting for the mark's holder to die (see :func:`watch`)."""

    def __init__(self, mapping: mmap.mmap, offset: int, on_death: Callable[[], None]):
        self._mutex = _mutex_at(mapping, offset)
        self._on_death = on_death
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="edl-life-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            result = _lock_within(self._mutex, _WATCH_SLICE_S)
            if result == errno.ETIMEDOUT:
                continue
            if result in (0, errno.EOWNERDEAD):
                # At once: a thread that ends holding a robust mutex leaves it on its robust list,
                # which the kernel walks when the thread exits, maybe after the arena was unmapped.
                _libc.pthread_mutex_unlock(self._mutex)
            if result == errno.EOWNERDEAD and not self._stopped.is_set():
                self._on_death()
            elif result not in (0, errno.EOWNERDEAD):
                logger.debug("a life mark could not be watched: %s", errno.errorcode.get(result, result))
            return  # got it: the holder released it on purpose, or died (reported); the mark is done

    def stop(self) -> None:
        """Stops watching (the stream ended): a death from now on is not reported. Does not wait."""
        self._stopped.set()


def hold(mapping: mmap.mmap, offset: int) -> HeldMark:
    """Makes a life mark at ``offset`` of ``mapping`` (:data:`MARK_BYTES`, 8-byte aligned, shared
    with the peer) and holds it in a thread of this process.

    Raises:
        OSError: the mark cannot be made (the caller then offers its arena without one).
    """
    return HeldMark(mapping, offset)


def watch(mapping: mmap.mmap, offset: int, on_death: Callable[[], None]) -> Watch:
    """Calls ``on_death()`` (in a thread of its own) as soon as the holder of the life mark at
    ``offset`` of ``mapping`` dies; not when it releases the mark, nor after :meth:`Watch.stop`."""
    return Watch(mapping, offset, on_death)
