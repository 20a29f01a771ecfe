"""A thread pool of daemon threads, for the handlers of the worker's gRPC server.

``concurrent.futures.ThreadPoolExecutor`` runs non-daemon threads and joins them when the
interpreter exits, in a hook (``threading._register_atexit``) that runs before any public one,
``atexit`` included. A handler blocked on a peer's long-lived stream then holds the process
at exit forever, and only a private hook could stop the server first; the pool also refuses
new calls once exit has begun. The threads here are daemons: the program ends when the main
thread does, and the runtime stops the server from an ``atexit`` handler.

Example::

    pool = DaemonThreadPool(max_workers=64, thread_name_prefix="edl-rpc")
    server = grpc.server(pool)
    assert pool.submit(pow, 2, 10).result() == 1024
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures
from typing import Any, Callable, List, Optional, Tuple

_Work = Tuple[futures.Future, Callable[..., Any], tuple, dict]


class DaemonThreadPool(futures.Executor):
    """Up to ``max_workers`` daemon threads, started as work arrives and kept while the pool lives
    (an idle thread takes the next call before a new one is started)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "edl-pool"):
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, not {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[Optional[_Work]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        """Runs ``fn(*args, **kwargs)`` on a pool thread; returns its future.

        Raises:
            RuntimeError: the pool was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after the pool was shut down")
            future: futures.Future = futures.Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._serve, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
            return future

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            future, fn, args, kwargs = work
            del work
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                    future.set_exception(error)
                    del error
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # no references kept while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuses new work; the threads end after the work queued before (cancelled if asked)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            self._cancel_queued()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _cancel_queued(self) -> None:
        kept = []
        while True:
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work[0].cancel()
            kept.append(work)
        for work in kept:
            if work is None:
                self._work.put(None)
