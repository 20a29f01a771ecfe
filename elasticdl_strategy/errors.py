"""The exceptions raised by elasticdl_strategy, in one small hierarchy.

Catch :class:`ElasticDLError` to handle every failure the library reports::

    from elasticdl_strategy import errors, runtime

    try:
        runtime.allreduce(grads)
    except errors.PeerFailureError as e:
        print("rank", e.peer_rank, "is gone:", e)

The hierarchy (``tests/test_errors.py`` checks it against the code)::

    ElasticDLError
    ├── ConfigError              bad flags, environment or configuration, found before anything starts
    ├── UsageError               a call made while the job runs has invalid arguments or comes at the wrong time
    ├── AuthenticationError      a call was rejected: missing or wrong job token
    ├── RendezvousError          the coordinator could not form or reach a membership
    │   ├── RendezvousTimeoutError
    │   ├── JobFinished              a standby learns that the job ended without it
    │   └── WorkerReplaced           a new process took this worker's id: this one must stop
    ├── CommunicationError       a point-to-point or collective operation failed
    │   ├── PeerFailureError         a peer died, left or became unreachable
    │   ├── CollectiveMismatchError  ranks called different collectives or arguments
    │   ├── CollectiveTimeoutError   a collective or recv passed its deadline
    │   ├── CommunicatorClosedError  the communicator was shut down
    │   ├── CommitAbortedError       a commit was not recorded: the membership changed
    │   ├── DataSocketClosed         (internal) a data socket ended; its stream fails or falls back to gRPC
    │   └── IncompleteStream         (internal) a stream ended inside a message or without its goodbye
    ├── MembershipChangedInterrupt   (elastic) members join or leave at this commit
    ├── WorkerLeft               (elastic; also SystemExit(0)) no longer a member: its program should end
    └── KubernetesError          the Kubernetes API refused or failed a request

:func:`elasticdl_strategy.elastic.run` recovers from every CommunicationError
except CollectiveMismatchError, handles MembershipChangedInterrupt, and raises WorkerLeft
to the script when this worker is no longer a member.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


class ElasticDLError(Exception):
    """Base class of every error raised by elasticdl_strategy."""


class ConfigError(ElasticDLError, ValueError):
    """A flag, environment variable or configuration value is invalid.

    Raised before any process, server or collective starts (by the launchers,
    the coordinator's and servers' configuration, ``AllReduceStrategy(...)``).
    """


class UsageError(ElasticDLError, ValueError):
    """A call made while the job runs has invalid arguments, or comes at the wrong time.

    For example a dtype the collectives cannot reduce, a root that is not a
    rank, a checkpoint of another model, a TensorFlow 1 API. Nothing was sent:
    correct the call.
    """


class AuthenticationError(ElasticDLError):
    """A call was rejected because it carried no job token or a wrong one."""


class RendezvousError(ElasticDLError):
    """The coordinator could not be reached or could not form a membership."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough workers registered before the rendezvous deadline."""


class JobFinished(RendezvousError):
    """The job finished while this worker waited to join it (a standby): nothing left to do."""


class WorkerReplaced(RendezvousError):
    """A new process registered under this worker's id (this one was restarted or relaunched
    while it hung): this process must stop."""


class CommunicationError(ElasticDLError):
    """A point-to-point or collective operation failed.

    Attributes:
        rank: the rank that raised the error (``None`` when unknown).
    """

    def __init__(self, message: str, *, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


class PeerFailureError(CommunicationError):
    """A peer process died, left the job or became unreachable.

    Attributes:
        peer_rank: rank of the failed peer (``None`` when unknown).
        rank: rank of the process that observed the failure.
    """

    def __init__(self, message: str, *, peer_rank: Optional[int], rank: Optional[int] = None):
        super().__init__(message, rank=rank)
        self.peer_rank = peer_rank


class CollectiveMismatchError(CommunicationError):
    """Ranks called different collectives, or the same one with different arguments.

    Attributes:
        ranks: the ranks whose calls differ.
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = (), rank: Optional[int] = None):
        super().__init__(message, rank=rank)
        self.ranks = tuple(ranks)


class CollectiveTimeoutError(CommunicationError):
    """A collective or receive did not complete before its deadline.

    Attributes:
        waiting_for: ranks that had not delivered their part when time ran out.
    """

    def __init__(self, message: str, *, waiting_for: Iterable[int] = (), rank: Optional[int] = None):
        super().__init__(message, rank=rank)
        self.waiting_for = tuple(sorted(waiting_for))


class CommunicatorClosedError(CommunicationError):
    """An operation was attempted on a communicator that has been shut down."""


class CommitAbortedError(CommunicationError):
    """An elastic commit was not recorded because the membership changed (a worker failed).

    Attributes:
        membership_version: the version the coordinator moved to.
    """

    def __init__(self, message: str, *, membership_version: int, rank: Optional[int] = None):
        super().__init__(message, rank=rank)
        self.membership_version = membership_version


class DataSocketClosed(CommunicationError):
    """Internal: a direct data socket ended (EOF or reset) or was shut down.

    The transport fails the socket's stream with it or falls back to gRPC;
    the collectives report a :class:`PeerFailureError` if the peer is gone.
    """


class IncompleteStream(CommunicationError):
    """Internal: a stream ended inside a message, or without its goodbye: the sender died.

    The receiving side ends the stream's receives with the reason; the
    collectives report a :class:`PeerFailureError`.
    """


class MembershipChangedInterrupt(ElasticDLError):
    """Raised by an elastic commit when workers join or leave at it.

    The state was committed; :func:`elasticdl_strategy.elastic.run` re-forms
    with the new membership and continues without rolling back.
    """

    def __init__(self, message: str, *, membership_version: int):
        super().__init__(message)
        self.membership_version = membership_version


class WorkerLeft(ElasticDLError, SystemExit):
    """This worker is no longer a member of the job, and its program should end: its graceful
    leave (SIGTERM) was recorded at a commit, or the job finished without it (a standby, or a
    worker evicted while it hung).

    Raised to the training script by :func:`elasticdl_strategy.elastic.run` (the worker has
    already left the job) and :func:`elasticdl_strategy.runtime.init` (a standby); the script
    decides what to do. It is also a ``SystemExit`` with code 0: left uncaught, it ends the
    process the way a finished program ends (``finally`` blocks and ``atexit`` handlers run,
    nothing is printed), and the launchers count a worker that left, not one that failed.
    PyTorch Lightning's ``SIGTERMException`` is a ``SystemExit`` for the same reason.

    Example::

        try:
            train(state)  # an elastic.run training function
        except errors.WorkerLeft as left:
            print(f"not evaluating: {left}")
            raise
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 0  # SystemExit's exit status when uncaught (else it would be the message)


class KubernetesError(ElasticDLError):
    """The Kubernetes API refused or failed a request (the message says which and why)."""
