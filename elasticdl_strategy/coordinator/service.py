"""The ``Coordinator`` gRPC service: turns calls into :mod:`~elasticdl_strategy.coordinator.events`.

Every method hands its request to the coordinator as an event and ends the
call with the answer; where there is none yet (a membership long poll) the
call waits for the next state change as a coroutine, so a thousand waiting
workers cost no thread. Health probes of
workers (a suspect in a failure report, a live process under a registering
worker's id) are asynchronous too, and run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Dict, Optional

import grpc

from elasticdl_strategy.coordinator import events
from elasticdl_strategy.coordinator.coordinator import Coordinator
from elasticdl_strategy.coordinator.params import MAX_MEMBERSHIP_WAIT_S
from elasticdl_strategy.transport.health import answers_health_check_aio
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2_grpc

logger = logging.getLogger(__name__)

# How long a worker gets to answer a health check before it is taken for gone.
PROBE_TIMEOUT_S = 1.0
# Rounds of probes for one registration: each finds another process under the id (registering concurrently).
MAX_PROBES = 3

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


async def _end(answer: Optional[events.Answer], context):
    """The response that ends a call, or the call ended with the refusal's status."""
    if isinstance(answer, events.Refuse):
        await context.abort(answer.code, answer.message)
    if not isinstance(answer, events.Reply):
        raise AssertionError(f"a call ended without a reply: {answer!r}")
    return answer.response


def _response(answer: Optional[events.Answer]):
    """The reply's response, or ``None`` while the call is to wait."""
    return answer.response if isinstance(answer, events.Reply) else None


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves ``coordinator`` on a ``grpc.aio`` server: each call becomes an event.

    Example::

        service = CoordinatorService(Coordinator(params), health_probe(options))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, aio_server)
    """

    def __init__(self, coordinator: Coordinator, probe: Probe):
        self.coordinator = coordinator
        self._probe = shared(probe)

    async def _probe_all(self, probe: events.Probe) -> Dict[int, bool]:
        answered = await asyncio.gather(*(self._probe(t.address) for t in probe.targets))
        return {t.join_order: alive for t, alive in zip(probe.targets, answered)}

    async def Register(self, request, context):
        probed: Dict[int, bool] = {}
        for _ in range(MAX_PROBES):
            answer = self.coordinator.handle(events.Register(request, probed))
            if not isinstance(answer, events.Probe):
                return await _end(answer, context)
            probed = {**probed, **await self._probe_all(answer)}
        message = f"worker id {request.worker_id!r} is being registered concurrently"
        return await _end(events.Refuse(grpc.StatusCode.UNAVAILABLE, message), context)

    async def GetMembership(self, request, context):
        wait_s = min(max(request.wait_s, 0.0), MAX_MEMBERSHIP_WAIT_S)
        c = self.coordinator
        c.handle(events.PollOpened(request.worker_id))
        try:
            response = await c.changes.wait_for(lambda: _response(c.handle(events.Poll(request))), wait_s)
        finally:
            c.handle(events.PollClosed(request.worker_id))
        return response or await _end(c.handle(events.Poll(request, waited_out=True)), context)

    async def Heartbeats(self, request_iterator, context):
        async for request in request_iterator:
            yield _response(self.coordinator.handle(events.Heartbeat(request)))

    async def Leave(self, request, context):
        return await _end(self.coordinator.handle(events.Leave(request)), context)

    async def ReportFailure(self, request, context):
        answer = self.coordinator.handle(events.ReportFailure(request))
        if isinstance(answer, events.Probe):
            answer = self.coordinator.handle(events.ReportFailure(request, await self._probe_all(answer)))
        return await _end(answer, context)

    async def Commit(self, request, context):
        return await _end(self.coordinator.handle(events.Commit(request)), context)

    async def GetShards(self, request, context):
        return await _end(self.coordinator.get_shards(request), context)
