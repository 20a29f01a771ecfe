"""``elastic.run``: the training loop that survives failures and membership changes."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import signal
import threading
import time
from typing import Callable, Iterator, List, Optional, TypeVar

from elasticdl_strategy import runtime
from elasticdl_strategy.elastic.state import State
from elasticdl_strategy.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationError,
    ElasticDLError,
    JobFinished,
    MembershipChangedInterrupt,
    PeerFailureError,
    WorkerLeft,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Runs ``func(state, ...)`` until it returns, surviving failures and membership changes.

    On entry the state is synced from rank 0, which first loads the newest
    checkpoint if the state has a checkpoint directory (so a job started again
    after all workers died resumes from it). When a peer fails, the
    survivors re-form with the coordinator's next membership, roll back to the
    last commit, sync and call ``func`` again. When workers join or leave at a
    commit, everyone re-forms at that commit without rolling back. On SIGTERM
    this worker commits with the others at the end of the step (see
    :meth:`State.leave_pending`) and leaves while the others carry on: ``run``
    raises :class:`~elasticdl_strategy.errors.WorkerLeft`, which ends the process
    with exit code 0 unless the script catches it.

    Before every sync — on entry and after every re-formation, on every member,
    newcomers included — the state's reset callbacks run. They run before the
    sync so that whatever they set in the state (a learning rate from
    ``runtime.size()``, a relative rescaling, a value a newcomer cannot
    compute) ends as rank 0's on every rank; what they set outside the state,
    every rank set for itself.

    ``func`` is called again from the top after every reset: create
    iterators and ``tf.function`` s inside it (or make the step an
    :func:`~elasticdl_strategy.elastic.function` once, outside it: its traces
    are kept per number of workers and rank), and resume from the state
    (``records.dataset()`` does by itself).

    Example::

        @elastic.run
        def train(state):
            while state.records.epoch < 3:
                for indices in state.records.dataset():
                    strategy.run(step, (indices,))
                    state.records.advance()
                    state.commit()

        train(state)

    Raises:
        WorkerLeft: this worker left the job (asked to by SIGTERM, or the job finished without it);
            uncaught, it ends the process with exit code 0.
        RendezvousTimeoutError: fewer than ``--min-workers`` remained for longer than the rendezvous timeout.
        CollectiveMismatchError: the workers run different code (never retried).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs) -> T:
        worker = runtime.current_worker()
        worker.enter_elastic_loop()
        with _leave_on_sigterm(state, worker):
            reset: Optional[_Reset] = None  # None: the first entry
            while True:
                try:
                    _prepare(worker, state, reset)
                    reset = None
                    result = func(state, *args, **kwargs)
                    worker.elastic_loop_returned()
                    return result
                except Exception as error:  # noqa: BLE001 - classify decides; what it cannot handle is re-raised
                    decision = classify(error, worker)
                    if decision.action is Action.RAISE:
                        raise
                    if decision.action is Action.LEAVE:
                        raise _leave(decision.reason) from None
                    reset = _Reset.after(decision, reset, worker)

    return wrapper


class Action(enum.Enum):
    """What ``elastic.run`` does about an exception its training function raised."""

    RAISE = "raise it to the caller"
    LEAVE = "end this worker"  # it is no longer a member: it left gracefully, or the job ended without it
    SWITCH = "re-form without rolling back"  # members join or leave at the commit just recorded
    RECOVER = "re-form and roll back to the last commit"  # a peer failed


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    failure: Optional[CommunicationError] = None  # RECOVER: the failure behind the error


def classify(error: Exception, worker) -> Decision:
    """What to do about ``error``, raised while training or re-forming on ``worker``.

    A communication failure is recoverable if re-forming can fix it: not a
    mismatch (the workers run different code), and not on a single worker.
    Errors raised inside a ``tf.function`` reach us wrapped by TensorFlow, so
    their causes and the communicator's own record of its failure are consulted.
    """
    if isinstance(error, WorkerLeft):
        return Decision(Action.LEAVE, str(error) or "left the job gracefully")
    if isinstance(error, JobFinished):  # evicted (say, after hanging) while the others finished without it
        return Decision(Action.LEAVE, "the job finished without this worker; exiting")
    if isinstance(error, MembershipChangedInterrupt):
        return Decision(Action.SWITCH, str(error))
    failure = _recoverable_failure(error, worker)
    if failure is None:
        return Decision(Action.RAISE)
    return Decision(Action.RECOVER, str(failure), failure)


@dataclasses.dataclass
class _Reset:
    """A re-formation to do: after a failure (roll back) or at a membership switch (no rollback)."""

    reason: str
    failed: bool
    started: float
    suspects: List[str] = dataclasses.field(default_factory=list)

    @classmethod
    def after(cls, decision: Decision, pending: Optional["_Reset"], worker) -> "_Reset":
        """The reset that ``decision`` asks for; a failure while ``pending`` was done keeps its start time."""
        started = pending.started if pending else time.monotonic()
        if decision.action is Action.SWITCH:
            return cls(decision.reason, failed=False, started=started)
        assert decision.failure is not None
        logger.warning("%s: re-forming and rolling back to the last commit", decision.failure)
        return cls(decision.reason, failed=True, started=started, suspects=_suspects(decision.failure, worker))


def _prepare(worker, state: State, reset: Optional[_Reset]) -> None:
    """Before (re-)entering the training function: re-form (or, on the first entry, load the newest
    checkpoint on rank 0), run the reset callbacks, and sync the state from rank 0."""
    if reset is not None:
        _recover(worker, state, reset)
    elif worker.communicator.rank == 0:
        # Rank 0 is a fresh process only when no member of a previous membership
        # survives (a new job, or one started again after all workers died).
        state.load_checkpoint()
    state.on_reset()
    state.sync()
    if reset is not None:
        _log_recovered(worker, state, reset)


def _recover(worker, state: State, reset: _Reset) -> None:
    # A SIGTERM while waiting (say, for --min-workers) leaves at once: nothing since the last commit is kept.
    asked_to_leave = lambda: state.leave_requested  # noqa: E731
    if worker.reform(reset.reason, failed=reset.failed, suspects=reset.suspects, stop=asked_to_leave) is None:
        raise WorkerLeft("asked to leave while waiting for a new membership; left the job")
    if not reset.failed:
        return
    last = worker.client.last_commit().commit_id
    if state.has_snapshot(last) or worker.communicator.rank != 0:
        state.restore(last)  # a rank without it receives rank 0's state in the sync
        return
    # The new rank 0 never held the job's last committed state (it joined after it, or the rank 0
    # that loaded the checkpoint died): only a checkpoint can give it back.
    if state.load_checkpoint() and state.commit_id >= last:
        return
    raise ElasticDLError(
        f"worker {worker.worker_id}: no remaining worker holds the state of commit #{last} (the workers left "
        "joined after it) and no checkpoint has it: continuing would lose or repeat data. Start the job "
        "again from its last checkpoint"
    )


def _log_recovered(worker, state: State, reset: _Reset) -> None:
    logger.info(
        "training continues as rank %d of %d at commit #%d%s, %.2fs after the %s",
        worker.communicator.rank,
        worker.communicator.size,
        state.commit_id,
        _where(state),
        time.monotonic() - reset.started,
        "failure (rolled back)" if reset.failed else "membership change",
    )


def _leave(reason: str) -> WorkerLeft:
    """Leaves the job (which goes on without this worker); returns what to raise to the script."""
    logger.info("%s", reason)
    runtime.shutdown(finished=False)
    return WorkerLeft(reason)


def _where(state: State) -> str:
    if state.records is None:
        return ""
    return f" ({state.records.position})"


def _causes(error: Optional[BaseException]) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _recoverable_failure(error: BaseException, worker) -> Optional[CommunicationError]:
    """The communication failure behind ``error`` if re-forming can fix it; ``None`` otherwise.

    Errors raised inside a ``tf.function`` reach us wrapped by TensorFlow, so
    the communicator's own record of its failure is consulted too.
    """
    if worker.client is None:
        return None
    for cause in _causes(error):
        if isinstance(cause, CollectiveMismatchError):
            return None
        if isinstance(cause, CommunicationError):
            return cause
        if isinstance(cause, ElasticDLError):
            return None  # e.g. RendezvousTimeoutError: too few workers left; re-forming again won't help
    failure = worker.communicator.failure
    if failure is not None and not isinstance(failure, CollectiveMismatchError):
        return failure
    return None


def _suspects(failure: CommunicationError, worker) -> List[str]:
    members = worker.membership.members
    ranks: List[int] = []
    if isinstance(failure, PeerFailureError) and failure.peer_rank is not None:
        ranks = [failure.peer_rank]
    elif isinstance(failure, CollectiveTimeoutError):
        ranks = list(failure.waiting_for)
    return [members[r].worker_id for r in ranks if 0 <= r < len(members)]


class _leave_on_sigterm:
    """While training, SIGTERM asks for a graceful leave at the next commit instead of killing."""

    def __init__(self, state: State, worker):
        self.state = state
        self.worker = worker
        self.previous = None

    def _handle(self, signum, frame) -> None:
        if not self.state.leave_requested:
            logger.info("SIGTERM: this worker leaves the job at the next commit")
        self.state.leave_requested = True
        if self.worker.client is not None:  # a wait for a new membership (_recover) leaves at once
            self.worker.client.interrupt_wait()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
