"""What happens to a coordinator (events) and what it answers (answers): the vocabulary of
:func:`~elasticdl_strategy.coordinator.transitions.transition`.

An event of a call carries the call's request message. Health probes are the
executor's: a transition that needs one answers :class:`Probe`, and the executor
delivers the same event again with what the probes found (``probed``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

import grpc

# What health probes found: the probed worker's join order -> whether it answered.
Probed = Mapping[int, bool]


@dataclasses.dataclass(frozen=True)
class Register:
    """A ``RegisterRequest``; ``probed`` holds the probes of live processes under its id so far."""

    request: Any
    probed: Probed = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Poll:
    """A membership long poll (``GetMembershipRequest``) asks for its answer; ``waited_out``: its
    time is up, it is answered whatever the state."""

    request: Any
    waited_out: bool = False


@dataclasses.dataclass(frozen=True)
class PollOpened:
    """A worker's long poll started waiting: while it waits, the worker counts as alive."""

    worker_id: str


@dataclasses.dataclass(frozen=True)
class PollClosed:
    """A worker's long poll ended."""

    worker_id: str


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    request: Any


@dataclasses.dataclass(frozen=True)
class Leave:
    request: Any


@dataclasses.dataclass(frozen=True)
class ReportFailure:
    """A ``FailureReport``; ``probed`` is ``None`` until its suspects were probed."""

    request: Any
    probed: Optional[Probed] = None


@dataclasses.dataclass(frozen=True)
class Commit:
    """A ``CommitRequest``: the commit every member agreed on, sent by rank 0."""

    request: Any


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed: silent workers die, a pending first membership may form."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """The coordinator stops: every waiting call is answered now."""


Event = Union[Register, Poll, PollOpened, PollClosed, Heartbeat, Leave, ReportFailure, Commit, Tick, Stop]


@dataclasses.dataclass(frozen=True)
class Reply:
    """End the call with ``response``."""

    response: Any


@dataclasses.dataclass(frozen=True)
class Refuse:
    """End the call with an error status."""

    code: grpc.StatusCode
    message: str


@dataclasses.dataclass(frozen=True)
class Wait:
    """No answer yet: ask again (the same event) after the next change of state."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A worker process to health-check."""

    worker_id: str
    address: str
    join_order: int


@dataclasses.dataclass(frozen=True)
class Probe:
    """Health-check ``targets``, then deliver the event again with what was found."""

    targets: Tuple[Target, ...]


Answer = Union[Reply, Refuse, Wait, Probe]
