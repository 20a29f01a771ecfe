"""The worker's side of the coordinator: register, wait for a membership, heartbeat, leave."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import grpc

from elasticdl_strategy.coordinator.membership import Membership
from elasticdl_strategy.coordinator.params import MAX_MEMBERSHIP_WAIT_S
from elasticdl_strategy.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    JobFinished,
    RendezvousError,
    RendezvousTimeoutError,
    UsageError,
    WorkerReplaced,
)
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.endpoints import open_channel
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc
from elasticdl_strategy.transport.retry import Deadline, backoff, retryable

logger = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 10.0


class CoordinatorClient:
    """Talks to the coordinator at ``address`` on behalf of worker ``worker_id``.

    Example::

        client = CoordinatorClient("127.0.0.1:50051", "worker-0", token, TransportOptions())
        client.register("127.0.0.1:40001", timeout=60)
        membership = client.wait_for_membership(after_version=0, timeout=60)
        client.start_heartbeats(lambda: membership.version, on_response=lambda response: ...)
    """

    def __init__(self, address: str, worker_id: str, token: str, options: TransportOptions, host: str = ""):
        self.address = address
        self.worker_id = worker_id
        self.host = host  # sent with every registration: what tells this worker's host from others
        self.incarnation = secrets.token_hex(8)  # this process, as opposed to an earlier one with the same id
        self._metadata = call_metadata(token)
        self._channel = open_channel(address, options)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.heartbeat_interval_s = 1.0
        self._stop = threading.Event()
        self._heartbeats: Optional[threading.Thread] = None
        # interrupt_wait() and the wait for a membership hand these over without a lock (a signal
        # handler may interrupt the waiting thread itself): each writes its own, then reads the other's.
        self._interrupted = False
        self._long_poll: Optional[grpc.Future] = None

    def _call(self, method, request, timeout: float):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._rejected(e) from None

    def _rejected(self, error: grpc.RpcError) -> Exception:
        """``error``, or an AuthenticationError where the coordinator rejected the job token."""
        if error.code() != grpc.StatusCode.UNAUTHENTICATED:
            return error
        return AuthenticationError(
            f"the coordinator at {self.address} rejected worker {self.worker_id}: {error.details()} "
            "(check EDL_JOB_TOKEN)"
        )

    def register(
        self,
        address: str,
        timeout: float,
        membership: Optional[Membership] = None,
        last_commit: Optional[coordinator_pb2.CommitRecord] = None,
    ) -> coordinator_pb2.RegisterResponse:
        """Registers this worker's peer ``address``, retrying until ``timeout``.

        ``membership`` and ``last_commit`` are passed when re-registering with a
        coordinator that restarted, so that it can recover the job's state.

        Returns:
            the response: join order (1 for the first worker of the job), and
            whether this worker joins a job that is already training.

        Raises:
            RendezvousError: the coordinator could not be reached in time or refused the worker.
            AuthenticationError: the job token was rejected.
        """
        deadline, pauses = Deadline(timeout), backoff()
        request = coordinator_pb2.RegisterRequest(
            worker_id=self.worker_id, address=address, incarnation=self.incarnation, host=self.host
        )
        if membership is not None:
            request.membership.CopyFrom(membership.to_proto())
        if last_commit is not None:
            request.last_commit.CopyFrom(last_commit)
        while True:
            try:
                response = self._call(self._stub.Register, request, min(_RPC_TIMEOUT_S, timeout))
                self.heartbeat_interval_s = response.heartbeat_interval_s or self.heartbeat_interval_s
                return response
            except grpc.RpcError as e:
                if not retryable(e):
                    raise RendezvousError(
                        f"worker {self.worker_id}: the coordinator at {self.address} refused registration: "
                        f"{e.code().name}: {e.details()}"
                    ) from None
                if not deadline.pause(next(pauses)):
                    raise RendezvousError(
                        f"worker {self.worker_id}: cannot reach the coordinator at {self.address} "
                        f"within {timeout:g}s ({e.code().name}: {e.details()}); is it running?"
                    ) from None

    def wait_for_membership(
        self, after_version: int, timeout: float, stop: Optional[Callable[[], bool]] = None
    ) -> Optional[Membership]:
        """Waits for a membership newer than ``after_version`` that contains this worker.

        While a membership with enough workers trains without this worker (it
        is a standby, or joins at the next commit), the wait goes on; the
        timeout counts only while too few workers are registered.

        Returns:
            the membership, or ``None`` when ``stop()`` is true: checked at
            the start, and at once when :meth:`interrupt_wait` is called.

        Raises:
            RendezvousTimeoutError: none was published within ``timeout``;
                the message says how many workers had registered.
        """
        deadline, pauses = time.monotonic() + timeout, backoff()
        last = None
        while True:
            if stop is not None and stop():
                return None
            remaining = deadline - time.monotonic()
            request = coordinator_pb2.GetMembershipRequest(
                worker_id=self.worker_id,
                after_version=after_version,
                wait_s=max(0.0, min(remaining, MAX_MEMBERSHIP_WAIT_S)),
                incarnation=self.incarnation,
            )
            try:
                response = self._poll_membership(request)
                if response is None:  # interrupted: check stop() again
                    self._interrupted = False
                    continue
                last = response
                if last.replaced:
                    raise WorkerReplaced(
                        f"worker {self.worker_id}: a new process registered under this worker id (this one was "
                        "restarted or relaunched while it hung); this process stops"
                    )
                if last.job_finished:
                    raise JobFinished(f"worker {self.worker_id}: the job finished; no membership will come")
                membership = Membership.from_proto(last.membership)
                if (
                    membership.version > after_version
                    and membership.rank_of(self.worker_id) >= 0
                    and membership.size >= last.min_workers
                ):
                    return membership
                if membership.size >= last.min_workers and membership.rank_of(self.worker_id) < 0:
                    # The job trains without us (a standby, or a joiner waiting for the next commit):
                    # that is no reason to give up.
                    deadline = max(deadline, time.monotonic() + min(timeout, 30.0))
            except grpc.RpcError as e:
                if not retryable(e):
                    raise RendezvousError(f"worker {self.worker_id}: GetMembership failed: {e.details()}") from None
                time.sleep(min(next(pauses), max(0.0, deadline - time.monotonic())))  # the deadline may move
            if time.monotonic() >= deadline:
                if last is None:
                    raise RendezvousTimeoutError(
                        f"worker {self.worker_id}: no answer from the coordinator at {self.address} within {timeout:g}s"
                    )
                raise RendezvousTimeoutError(
                    f"worker {self.worker_id}: no membership within {timeout:g}s: {last.registered} worker(s) "
                    f"registered, at least {last.min_workers} needed (raise EDL_RENDEZVOUS_TIMEOUT, "
                    "or start more workers / lower --min-workers)"
                )

    def interrupt_wait(self) -> None:
        """Makes the wait for a membership in progress (if any) check its ``stop()`` at once.

        Make ``stop()`` true first. Safe from any thread and from a signal handler.
        """
        self._interrupted = True
        call = self._long_poll
        if call is not None:
            call.cancel()

    def _poll_membership(self, request: coordinator_pb2.GetMembershipRequest):
        """One long poll: the coordinator's answer, or ``None`` if :meth:`interrupt_wait` cut it short."""
        call = self._stub.GetMembership.future(
            request, timeout=request.wait_s + _RPC_TIMEOUT_S, metadata=self._metadata
        )
        self._long_poll = call
        if self._interrupted:  # interrupt_wait() came before the call was visible to it
            call.cancel()
        try:
            return call.result()
        except grpc.FutureCancelledError:
            return None
        except grpc.RpcError as e:
            raise self._rejected(e) from None
        finally:
            self._long_poll = None

    def start_heartbeats(
        self, current_version: Callable[[], int], on_response: Callable[[coordinator_pb2.HeartbeatResponse], None]
    ) -> None:
        """Heartbeats every ``heartbeat_interval_s`` in a daemon thread, passing each response on.

        The heartbeats are the messages of one stream to the coordinator, opened again (after an
        interval, with a heartbeat at once) when it breaks: the coordinator restarted, or could
        not be reached.
        """

        def requests() -> Iterator[coordinator_pb2.HeartbeatRequest]:
            while True:
                yield coordinator_pb2.HeartbeatRequest(
                    worker_id=self.worker_id, membership_version=current_version(), incarnation=self.incarnation
                )
                if self._stop.wait(self.heartbeat_interval_s):
                    return

        def loop():
            while not self._stop.is_set():
                call = self._stub.Heartbeats(requests(), metadata=self._metadata)
                try:
                    for response in call:
                        try:
                            on_response(response)
                        except Exception:
                            logger.exception("heartbeat handler failed")
                except grpc.RpcError as e:
                    if not self._stop.is_set():
                        logger.warning("heartbeat stream ended: %s; opening it again", e.code().name)
                self._stop.wait(self.heartbeat_interval_s)

        self._heartbeats = threading.Thread(target=loop, name="edl-heartbeat", daemon=True)
        self._heartbeats.start()

    def get_membership(self) -> Membership:
        request = coordinator_pb2.GetMembershipRequest(
            worker_id=self.worker_id, after_version=-1, wait_s=0, incarnation=self.incarnation
        )
        return Membership.from_proto(self._call(self._stub.GetMembership, request, _RPC_TIMEOUT_S).membership)

    def last_commit(self) -> coordinator_pb2.CommitRecord:
        """The last commit the coordinator recorded (commit id 0: none yet)."""
        request = coordinator_pb2.GetMembershipRequest(
            worker_id=self.worker_id, after_version=-1, wait_s=0, incarnation=self.incarnation
        )
        return self._call(self._stub.GetMembership, request, _RPC_TIMEOUT_S).last_commit

    def commit(
        self,
        membership_version: int,
        commit_id: int,
        position: coordinator_pb2.DataPosition,
        leaving_workers: Sequence[str],
        timeout: float,
        on_unavailable: Optional[Callable[[], None]] = None,
    ) -> coordinator_pb2.CommitResponse:
        """Records commit ``commit_id``, which every member agreed on, for all of them
        (``leaving_workers`` leave at it); one member (rank 0) calls this.

        ``on_unavailable`` runs when the coordinator cannot be reached or no
        longer knows this membership (it restarted); the call then retries.

        Returns:
            the coordinator's answer: recorded, or not (the membership changed), and the
            membership to continue in.

        Raises:
            CollectiveTimeoutError: no answer within ``timeout``.
            grpc.RpcError: the coordinator refused the commit (a leaver that is not a member).
        """
        deadline, pauses = Deadline(timeout), backoff()
        request = coordinator_pb2.CommitRequest(
            worker_id=self.worker_id,
            membership_version=membership_version,
            commit_id=commit_id,
            position=position,
            leaving_workers=list(leaving_workers),
            incarnation=self.incarnation,
        )
        reason = "no answer from the coordinator"
        while not deadline.expired():
            try:
                response = self._call(self._stub.Commit, request, _RPC_TIMEOUT_S)
            except grpc.RpcError as e:
                if not retryable(e):
                    raise
                reason = f"the coordinator at {self.address} is unreachable ({e.code().name})"
                deadline.pause_at_most(next(pauses))
                continue
            if response.membership_version < membership_version and on_unavailable is not None:
                reason = f"the coordinator no longer knows membership version {membership_version}"
                on_unavailable()  # it restarted: re-register, then retry
                continue
            return response
        raise CollectiveTimeoutError(
            f"worker {self.worker_id}: commit #{commit_id} not recorded within {timeout:g}s: {reason}"
        )

    def report_failure(self, membership_version: int, suspects, reason: str, dead=()) -> None:
        """Tells the coordinator a collective failed, naming unreachable workers (and of them, those
        seen ``dead`` for certain, which it then does not probe); best effort."""
        request = coordinator_pb2.FailureReport(
            worker_id=self.worker_id,
            membership_version=membership_version,
            suspects=list(suspects),
            reason=reason,
            incarnation=self.incarnation,
            dead=list(dead),
        )
        try:
            self._call(self._stub.ReportFailure, request, _RPC_TIMEOUT_S)
        except (grpc.RpcError, AuthenticationError) as e:
            logger.warning("failure report not delivered: %s", e)

    def get_shards(self, spec: coordinator_pb2.DatasetSpec, epoch: int, timeout: float = _RPC_TIMEOUT_S):
        """Returns ``(starts, ends)`` of the shards of ``epoch``, registering ``spec`` on first use.

        Raises:
            UsageError: ``spec`` differs from the job's dataset.
        """
        deadline, pauses = Deadline(timeout), backoff()
        request = coordinator_pb2.GetShardsRequest(worker_id=self.worker_id, spec=spec, epoch=epoch)
        while True:
            try:
                response = self._call(self._stub.GetShards, request, _RPC_TIMEOUT_S)
                return list(response.starts), list(response.ends)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise UsageError(e.details()) from None
                if not retryable(e) or not deadline.pause(next(pauses)):
                    raise RendezvousError(f"worker {self.worker_id}: GetShards failed: {e.details()}") from None

    def leave(self, reason: str, finished: bool = False) -> None:
        """Tells the coordinator this worker is leaving (``finished``: its program succeeded); best effort."""
        request = coordinator_pb2.LeaveRequest(
            worker_id=self.worker_id, reason=reason, finished=finished, incarnation=self.incarnation
        )
        try:
            self._call(self._stub.Leave, request, 2.0)
        except (grpc.RpcError, AuthenticationError) as e:
            logger.debug("leave not delivered: %s", e)

    def close(self) -> None:
        self._stop.set()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=_RPC_TIMEOUT_S + 1)
        self._channel.close()
