"""The ``Coordinator`` gRPC service: a thin ``grpc.aio`` executor around :class:`Coordinator`.

Every method asks the coordinator for an answer; where it has none yet (a
membership long poll) the call waits for the next state change as a
coroutine, so a thousand waiting workers cost no thread. Health probes of
workers (a suspect in a failure report, a live process under a registering
worker's id) are asynchronous too, and run concurrently.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable, Dict, TypeVar

import grpc

from elasticdl_strategy.coordinator.coordinator import MAX_MEMBERSHIP_WAIT_S, Coordinator, Refusal
from elasticdl_strategy.transport.health import answers_health_check_aio
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

# How long a worker gets to answer a health check before it is taken for gone.
PROBE_TIMEOUT_S = 1.0

T = TypeVar("T")
Probe = Callable[[str], Awaitable[bool]]


def health_probe(options: TransportOptions) -> Probe:
    """A probe: whether the server at an address answers a health check within :data:`PROBE_TIMEOUT_S`."""

    async def probe(address: str) -> bool:
        return await answers_health_check_aio(address, options, timeout=PROBE_TIMEOUT_S)

    return probe


def shared(probe: Probe) -> Probe:
    """``probe`` where concurrent probes of one address share one health check: after a failure
    every survivor reports the same suspect, and a thousand reports must not make a thousand
    connections. Used in one event loop."""
    in_flight: Dict[str, asyncio.Future] = {}

    async def shared_probe(address: str) -> bool:
        check = in_flight.get(address)
        if check is None:
            check = in_flight[address] = asyncio.ensure_future(probe(address))
            check.add_done_callback(lambda _: in_flight.pop(address, None))
        return await asyncio.shield(check)  # a caller cancelled does not cancel the others' check

    return shared_probe


def _refusals_abort(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Ends the call with the status of a :class:`Refusal` the coordinator raised."""

    @functools.wraps(method)
    async def call(self, request, context):
        try:
            return await method(self, request, context)
        except Refusal as e:
            await context.abort(e.code, e.message)
            raise  # not reached: abort raises

    return call


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves ``coordinator`` on a ``grpc.aio`` server.

    Example::

        service = CoordinatorService(Coordinator(params), health_probe(options))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, aio_server)
    """

    def __init__(self, coordinator: Coordinator, probe: Probe):
        self.coordinator = coordinator
        self._probe = shared(probe)

    @_refusals_abort
    async def Register(self, request, context):
        probed = None
        for _ in range(3):
            answer = self.coordinator.register(request, probed)
            if answer is not None:
                return answer
            probed = self.coordinator.conflict(request)
            if probed is not None and await self._probe(probed.address):
                raise Refusal(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"worker id {request.worker_id!r} is already used by a live process at {probed.address}",
                )
        raise Refusal(grpc.StatusCode.UNAVAILABLE, f"worker id {request.worker_id!r} is being registered concurrently")

    async def GetMembership(self, request, context):
        wait_s = min(max(request.wait_s, 0.0), MAX_MEMBERSHIP_WAIT_S)
        c = self.coordinator
        c.waiting(request.worker_id, True)
        try:
            answer = await c.changes.wait_for(lambda: c.membership_answer(request), wait_s)
        finally:
            c.waiting(request.worker_id, False)
        return answer or c.membership_answer(request, waited_out=True)

    async def Heartbeats(self, request_iterator, context):
        async for request in request_iterator:
            yield self.coordinator.heartbeat(request)

    async def Leave(self, request, context):
        return self.coordinator.leave(request)

    async def ReportFailure(self, request, context):
        suspects = self.coordinator.failure_suspects(request)
        if suspects is None:
            return coordinator_pb2.FailureReportResponse(membership_version=self.coordinator.membership.version)
        answered = await asyncio.gather(*(self._probe(w.address) for w in suspects))
        unreachable = [w for w, alive in zip(suspects, answered) if not alive]
        return self.coordinator.report_failure(request, unreachable)

    @_refusals_abort
    async def Commit(self, request, context):
        return self.coordinator.commit(request)

    @_refusals_abort
    async def GetShards(self, request, context):
        return self.coordinator.get_shards(request)
