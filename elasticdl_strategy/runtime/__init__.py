"""Layer 4: this process's place in the job, and the collectives on the current membership.

:func:`init` joins the job the launcher described (its server, its session
with the coordinator, a communicator for the membership); the functions below
run collectives on that communicator. Start the script with the launcher
(``elasticdl-strategy run --workers 2 -- python train.py``) and call::

    import numpy as np
    from elasticdl_strategy import runtime

    runtime.init()
    total = runtime.allreduce(np.ones(4, np.float32))   # [2. 2. 2. 2.] on both workers
    if runtime.rank() == 0:
        runtime.send(np.arange(3), dst=1, tag=7)
    elif runtime.rank() == 1:
        print(runtime.recv(src=0, tag=7))
    runtime.shutdown()

A script started without the launcher runs as a single worker (rank 0 of 1).
All functions raise :class:`~elasticdl_strategy.errors.ElasticDLError`
subclasses on failure; every blocking call has a deadline (``timeout``
argument, default ``EDL_TIMEOUT`` = 60 s).

This layer sits above both :mod:`~elasticdl_strategy.collective` and
:mod:`~elasticdl_strategy.coordinator`, and ties them together in
:class:`~elasticdl_strategy.runtime.worker.Worker`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import Dict, Iterator, Mapping, Optional, Sequence

import numpy as np

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.collective.p2p import Request
from elasticdl_strategy.environment import COORDINATOR_ADDR, WorkerEnvironment
from elasticdl_strategy.errors import JobFinished, UsageError, WorkerLeft
from elasticdl_strategy.logs import configure as configure_logging
from elasticdl_strategy.runtime.worker import ElasticLoop, Registration, Worker
from elasticdl_strategy.transport.options import workers_outnumber_cores

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "joined_running_job",
    "rank",
    "size",
    "communicator",
    "current_worker",
    "stats",
    "allreduce",
    "reduce",
    "broadcast",
    "allgather",
    "gather",
    "scatter",
    "reduce_scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "Request",
    "Communicator",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_worker: Optional[Worker] = None
_admission: Optional["_Admission"] = None
_WAIT_SLICE_S = 0.5  # waits for the admission in slices: Ctrl-C stays prompt


def init(env: Optional[Mapping[str, str]] = None, admit_in_background: bool = False) -> None:
    """Joins the job described by the launcher's environment (``os.environ`` by default).

    Blocks until the coordinator has formed a membership containing this
    worker. Without ``EDL_COORDINATOR_ADDR`` it sets up a single worker
    (rank 0 of 1) and says so in one log line. Calling it again is a no-op.

    ``admit_in_background``: a worker joining a job that is already training
    returns once registered, and waits for its admission (at the members' next
    commit) in the background meanwhile: what needs the membership (:func:`rank`,
    :func:`size`, :func:`communicator`, :func:`current_worker`) waits for it
    then, and raises what the admission raised. So building a model overlaps
    the wait (:class:`~elasticdl_strategy.AllReduceStrategy` asks for it).
    Not where this host's workers outnumber its cores: there the newcomer's
    building would take the cores the members train on, while they wait for it
    anyway once it is admitted (``benchmarks/recovery.py``: its join took longer).

    Raises:
        ConfigError: the environment is invalid.
        RendezvousError, RendezvousTimeoutError: no membership could be formed in time.
        AuthenticationError: the coordinator rejected the job token.
        WorkerLeft: this worker was a standby, and the job finished without it (uncaught: exit code 0).
    """
    global _worker, _admission
    with _lock:
        if _worker is not None or _admission is not None:
            return
        env = os.environ if env is None else env
        parsed = WorkerEnvironment.from_env(env)
        if parsed is None:
            configure_logging(lambda: "single worker", env)
            logger.warning(
                "%s is not set (not started by the launcher): running as a single worker, rank 0 of 1",
                COORDINATOR_ADDR,
            )
            _worker = Worker.single()
            _leave_when_the_program_ends()
            return
        worker_id = parsed.worker_id
        configure_logging(lambda: _describe_worker(worker_id), env)
        crowded = workers_outnumber_cores(env)
        admission = _admission = _Admission(parsed)
    _leave_when_the_program_ends()
    try:
        _wait(admission.registered)
        if admission.error is None and admission.joins_running_job and admit_in_background and not crowded:
            return
        _wait_for_admission()
    except BaseException:
        if not admission.done.is_set():  # interrupted (Ctrl-C): the admission stops too
            shutdown(finished=False)
        raise


class _Admission:
    """Joining the job in a thread of its own: registration, the wait for a membership with this
    worker, its communicator. ``registered`` is set once registered (``joins_running_job`` known)
    or failed; ``done`` once admitted (``_worker`` set) or failed (``error``)."""

    def __init__(self, env: WorkerEnvironment):
        self.registered = threading.Event()
        self.done = threading.Event()
        self.joins_running_job = False
        self.error: Optional[BaseException] = None
        self.stopped = False  # set under _lock by stop(): the wait gives up, a late worker leaves
        self._registration: Optional[Registration] = None
        self.thread = threading.Thread(target=self._join, args=(env,), name="edl-admission", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Gives up the wait for a membership (call under ``_lock``); see ``thread`` for when it ended."""
        self.stopped = True
        if self._registration is not None:
            self._registration.interrupt()

    def _join(self, env: WorkerEnvironment) -> None:
        global _worker
        try:
            self._registration = Registration(env)
            self.joins_running_job = self._registration.joins_running_job
            self.registered.set()
            worker = self._registration.admit(stop=lambda: self.stopped)
        except JobFinished as e:
            logger.info("%s: this standby leaves", e)
            self.error = WorkerLeft(f"{e}: this standby leaves")
        except BaseException as e:  # noqa: BLE001 - raised in the thread that needs the membership
            self.error = e
        else:
            with _lock:
                admitted = not self.stopped
                if admitted:
                    _worker = worker
            if not admitted:  # stop() came first: shutdown() found no worker to shut down
                worker.shutdown(finished=False)
                self.error = WorkerLeft("shut down before it was admitted")
        finally:
            self.registered.set()
            self.done.set()


def _not_initialized() -> UsageError:
    return UsageError("elasticdl_strategy.runtime is not initialized: call runtime.init() first")


def _wait(event: threading.Event) -> None:
    while not event.wait(_WAIT_SLICE_S):
        pass


def _wait_for_admission() -> Worker:
    """This process's worker once admitted; raises what the admission raised."""
    global _admission
    admission = _admission
    if admission is None:
        raise _not_initialized()
    _wait(admission.done)  # bounded by the admission's own deadline (a standby waits for a place)
    if admission.error is not None:
        with _lock:
            if _admission is admission:
                _admission = None  # init() may try again
        raise admission.error
    worker = _worker
    if worker is None:
        raise UsageError("elasticdl_strategy.runtime was shut down")
    return worker


def joined_running_job() -> bool:
    """Whether this worker joined (or is joining) a job that was already training: its state then
    comes from the others. Known once registered; does not wait for the admission."""
    worker = _worker
    if worker is not None:
        return worker.joined_running_job
    admission = _admission
    if admission is None:
        raise _not_initialized()
    return admission.joins_running_job


def _describe_worker(worker_id: str) -> str:
    """``"worker-1 rank 0/2"`` (its current rank and size), or ``"worker-1 joining"``."""
    worker = _worker
    if worker is None:
        return f"{worker_id} joining"
    return f"{worker_id} rank {worker.communicator.rank}/{worker.communicator.size}"


_leaving_at_exit = False


def _leave_when_the_program_ends() -> None:
    """Registers an ``atexit`` handler that shuts down (so that a script need not call
    :func:`shutdown`) and says whether the job is finished: it is, unless the program ended
    with an uncaught exception (which Python records in ``sys.last_value`` before ``atexit``
    handlers run) or inside an elastic training loop (a ``sys.exit`` from it).

    The exit is not held up by the server's handler threads, still serving peers: they are
    daemons (:mod:`~elasticdl_strategy.transport.daemon_pool`).
    """
    global _leaving_at_exit
    if _leaving_at_exit:
        return
    _leaving_at_exit = True

    def leave() -> None:
        worker = _worker
        crashed = getattr(sys, "last_value", None) is not None
        shutdown(finished=not crashed and (worker is None or worker.elastic_loop is not ElasticLoop.RUNNING))

    atexit.register(leave)


def shutdown(finished: bool = True) -> None:
    """Leaves the job: closes streams and the server, tells the coordinator. Idempotent.

    ``finished`` (the default, and at a successful exit): this worker's
    program is done, so the job is: workers waiting to join stop waiting.
    """
    global _worker, _admission
    with _lock:
        worker, _worker = _worker, None
        admission, _admission = _admission, None
        if admission is not None:
            admission.stop()
    if worker is not None:
        worker.shutdown(finished=finished)
    elif admission is not None:
        admission.thread.join(timeout=5.0)  # its wait ends at once; leaving takes at most 2 s


def is_initialized() -> bool:
    """Whether :func:`init` was called (a worker still waiting for its admission included)."""
    return _worker is not None or _admission is not None


def _current() -> Worker:
    worker = _worker
    return worker if worker is not None else _wait_for_admission()


def current_worker() -> Worker:
    """This process's :class:`~elasticdl_strategy.runtime.worker.Worker` (for the elastic layer)."""
    return _current()


def communicator() -> Communicator:
    """The communicator of the current membership.

    Raises:
        UsageError: called within :func:`tracing_for` (a collective there would pair with the
            other workers' in the wrong order).
    """
    shape = getattr(_traced_shape, "value", None)
    if shape is not None:
        raise UsageError(
            f"no collective while tracing ahead for {shape[0]} workers (rank {shape[1]}): the function "
            "communicates while it is traced (say, creates a variable); it is traced when first called there"
        )
    return _current().communicator


def rank() -> int:
    """This worker's rank: its position in join order, 0 for the oldest."""
    shape = getattr(_traced_shape, "value", None)
    return shape[1] if shape is not None else communicator().rank


def size() -> int:
    """Number of workers in the current membership."""
    shape = getattr(_traced_shape, "value", None)
    return shape[0] if shape is not None else communicator().size


# A thread tracing a function ahead for another membership shape (elastic.function) sees that shape.
_traced_shape = threading.local()


@contextlib.contextmanager
def tracing_for(size: int, rank: int) -> Iterator[None]:
    """Within it, :func:`size` and :func:`rank` answer ``size`` and ``rank`` in this thread only:
    for tracing a ``tf.function`` ahead for a membership this worker may be in next. Nothing
    run within it may communicate: :func:`communicator` raises there."""
    previous = getattr(_traced_shape, "value", None)
    _traced_shape.value = (size, rank)
    try:
        yield
    finally:
        _traced_shape.value = previous


def stats() -> Dict[str, int]:
    """Payload bytes and messages this rank sent and received since ``init``, and the collectives
    it called (small ones among workers of one host send no message: a host segment)."""
    p2p = communicator().p2p
    return {
        "collectives": communicator().collectives_called,
        "bytes_sent": p2p.bytes_sent,
        "bytes_received": p2p.bytes_received,
        "messages_sent": p2p.messages_sent,
        "messages_received": p2p.messages_received,
    }


def allreduce(
    array,
    op: str = "sum",
    out: Optional[np.ndarray] = None,
    timeout: Optional[float] = None,
    compression: Optional[str] = None,
) -> np.ndarray:
    """Reduces ``array`` over all ranks with ``op`` ("sum", "mean", "min", "max", "prod").

    Every rank gets a bitwise-identical result. Pass ``out=array`` to reduce in place.
    ``compression="fp16"`` or ``"bf16"`` sends 16-bit values (float32/float64 arrays,
    sum/mean/min/max); see :meth:`Communicator.allreduce` for the accuracy.
    """
    return communicator().allreduce(array, op=op, out=out, timeout=timeout, compression=compression)


def reduce(array, root: int = 0, op: str = "sum", timeout: Optional[float] = None) -> Optional[np.ndarray]:
    """Reduces ``array`` over all ranks onto ``root``; ``None`` on the other ranks."""
    return communicator().reduce(array, root=root, op=op, timeout=timeout)


def broadcast(array, root: int = 0, timeout: Optional[float] = None) -> np.ndarray:
    """Returns ``root``'s ``array`` on every rank (all pass arrays of the same shape and dtype)."""
    return communicator().broadcast(array, root=root, timeout=timeout)


def allgather(array, timeout: Optional[float] = None) -> np.ndarray:
    """Concatenates every rank's ``array`` along axis 0 in rank order (axis 0 may differ per rank)."""
    return communicator().allgather(array, timeout=timeout)


def gather(array, root: int = 0, timeout: Optional[float] = None) -> Optional[np.ndarray]:
    """Like :func:`allgather`, but only ``root`` gets the result; ``None`` elsewhere."""
    return communicator().gather(array, root=root, timeout=timeout)


def scatter(arrays: Optional[Sequence], root: int = 0, timeout: Optional[float] = None) -> np.ndarray:
    """Rank ``i`` receives ``arrays[i]`` of ``root``; non-root ranks may pass ``None``."""
    return communicator().scatter(arrays, root=root, timeout=timeout)


def reduce_scatter(array, op: str = "sum", timeout: Optional[float] = None) -> np.ndarray:
    """Reduces ``array`` over all ranks and returns this rank's block of rows (split like ``np.array_split``)."""
    return communicator().reduce_scatter(array, op=op, timeout=timeout)


def barrier(timeout: Optional[float] = None) -> None:
    """Returns once every rank has called ``barrier``."""
    communicator().barrier(timeout=timeout)


def send(array, dst: int, tag: int = 0, timeout: Optional[float] = None) -> None:
    """Sends ``array`` to rank ``dst``; matched by (sender, tag, order) on the receiver."""
    communicator().p2p.send(array, dst, tag=tag, timeout=timeout)


def recv(src: int, tag: int = 0, out: Optional[np.ndarray] = None, timeout: Optional[float] = None) -> np.ndarray:
    """Receives the next array sent by ``src`` with ``tag`` (into ``out`` if given)."""
    return communicator().p2p.recv(src, tag=tag, out=out, timeout=timeout)


def isend(array, dst: int, tag: int = 0) -> Request:
    """Non-blocking :func:`send`; don't modify ``array`` until ``request.wait()`` returns."""
    return communicator().p2p.isend(array, dst, tag=tag)


def irecv(src: int, tag: int = 0, out: Optional[np.ndarray] = None) -> Request:
    """Non-blocking :func:`recv`; ``request.wait()`` returns the array."""
    return communicator().p2p.irecv(src, tag=tag, out=out)
