"""The commit vote: the members agree on a commit among themselves, and one of them records it.

A commit is a barrier of all members. The coordinator used to be that barrier: every member
sent its own Commit and waited for the last one, so a commit cost the coordinator one call
per worker on its one event loop (half a second at 1,000 workers). Here:

1. every member contributes to one all-reduce (``max``) its commit id, its data position
   and whether it leaves, each number beside its negation, so that the maximum of both
   shows any disagreement;
2. rank 0 alone records the agreed commit with the coordinator (the leavers named);
3. a second all-reduce hands the coordinator's answer to every member.

Both all-reduces are small (8 bytes per member, then 1 KiB): log2(N) exchanges each by
recursive doubling once N is large. A member that dies during the vote fails it for the
others (a ``PeerFailureError``), as it would fail a training step.

Example (what :meth:`~elasticdl_strategy.elastic.State.commit` does)::

    response = agreement.commit_for_all(worker, commit_id=7, position=Position(1, 3, 96), leaving=False)
    response.recorded, response.membership_version
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.coordinator.position import Position
from elasticdl_strategy.errors import CollectiveMismatchError
from elasticdl_strategy.transport.protos import coordinator_pb2

RESPONSE_BYTES = 1024  # the coordinator's answer as rank 0 shares it (a longer reason is cut)


def commit_for_all(worker, commit_id: int, position: Position, leaving: bool) -> coordinator_pb2.CommitResponse:
    """Agrees on commit ``commit_id`` at ``position`` with every member of ``worker``'s membership
    and records it with the coordinator; ``leaving``: this worker leaves the job at it.

    Returns:
        the coordinator's answer, the same on every member.

    Raises:
        CollectiveMismatchError: the members commit different ids or at different data positions.
        PeerFailureError, CollectiveTimeoutError: a member failed or hung during the vote.
    """
    communicator = worker.communicator
    leavers = vote(communicator, commit_id, position, leaving)
    answer = np.zeros(RESPONSE_BYTES, np.uint8)
    failure = None
    if communicator.rank == 0:
        ids = [m.worker_id for m in worker.membership.members]
        try:
            response = worker.client.commit(
                worker.membership.version,
                commit_id,
                position.to_proto(),
                leaving_workers=[ids[r] for r in leavers],
                timeout=communicator.timeout_s,
                on_unavailable=worker.reregister,
            )
        except Exception as e:  # noqa: BLE001 - the others learn it was not recorded; rank 0 raises it below
            failure = e
            response = coordinator_pb2.CommitResponse(
                recorded=False, membership_version=worker.membership.version, reason=f"rank 0 could not record it: {e}"
            )
        encode(response, answer)
    communicator.allreduce(answer, op="max", out=answer)
    if failure is not None:
        raise failure
    return decode(answer)


def extremes(
    communicator: Communicator, values: Sequence[int], flag: int = 0
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lowest and highest over all members of each of ``values`` (integers), and every rank's
    ``flag``, from one all-reduce: each value beside its negation, op max. The same on every member.

    Example (on every member)::

        lowest, highest, leaving = extremes(communicator, [commit_id], flag=int(leaves))
        everyone_agrees = lowest[0] == highest[0]
    """
    mine = np.asarray(values, np.int64)
    n = len(mine)
    packed = np.zeros(2 * n + communicator.size, np.int64)
    packed[:n], packed[n : 2 * n] = mine, -mine
    packed[2 * n + communicator.rank] = flag
    communicator.allreduce(packed, op="max", out=packed)
    return -packed[n : 2 * n], packed[:n], packed[2 * n :]


def vote(communicator: Communicator, commit_id: int, position: Position, leaving: bool) -> List[int]:
    """The all-reduce of step 1: returns the ranks that leave.

    Raises:
        CollectiveMismatchError: on every member alike, when they disagree.
    """
    mine = [commit_id, position.epoch, position.batch, position.cursor]
    lowest, highest, leaves = extremes(communicator, mine, flag=int(leaving))
    rank = communicator.rank
    if highest[0] != lowest[0]:
        raise CollectiveMismatchError(
            f"rank {rank}: the members commit different ids (#{lowest[0]} to #{highest[0]}, this worker "
            f"#{commit_id}): every worker must commit at the same steps",
            rank=rank,
        )
    if np.any(highest != lowest):
        low, high = Position(*(int(x) for x in lowest[1:])), Position(*(int(x) for x in highest[1:]))
        raise CollectiveMismatchError(
            f"rank {rank}: the members commit #{commit_id} at different data positions (from {low} to {high}, "
            f"this worker at {position}): the workers disagree on the data consumed",
            rank=rank,
        )
    return [int(r) for r in np.flatnonzero(leaves)]


def encode(response: coordinator_pb2.CommitResponse, out: np.ndarray) -> None:
    """Writes ``response`` into the uint8 array ``out`` (4 bytes of length, then the message),
    cutting its reason to fit."""
    data = response.SerializeToString()
    if len(data) > len(out) - 4:
        cut = coordinator_pb2.CommitResponse()
        cut.CopyFrom(response)
        reason = cut.reason.encode()[: len(out) - 4 - (len(data) - len(cut.reason.encode())) - 8]
        cut.reason = reason.decode(errors="ignore") + "..."
        data = cut.SerializeToString()
    out[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
    out[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)


def decode(data: np.ndarray) -> coordinator_pb2.CommitResponse:
    length = int.from_bytes(data[:4].tobytes(), "little")
    return coordinator_pb2.CommitResponse.FromString(data[4 : 4 + length].tobytes())
