"""The gRPC health service (``grpc.health.v1.Health/Check``) of every server of a job.

It answers without a token (Kubernetes' gRPC probes send none), so it must
cost a stranger nothing: ``Check`` takes its request as a stream and answers
at once, without reading it. (A handler with a unary request makes gRPC wait,
in a server thread, for the request message; a client that sends headers and
nothing else would hold that thread for good, and enough of them would
freeze the server.) Every service name gets the server's own status. ``Watch``
and ``List`` are not served (``UNIMPLEMENTED``, answered by gRPC itself).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticdl_strategy.transport.endpoints import open_aio_channel, open_channel
from elasticdl_strategy.transport.options import TransportOptions

SERVICE = "grpc.health.v1.Health"


def answers_health_check(address: str, options: TransportOptions, timeout: float = 1.0) -> bool:
    """Whether the server at ``address`` answers a health check with SERVING within ``timeout``.

    Example::

        if not answers_health_check("10.0.0.3:50052", options):
            ...  # gone, or too busy to answer: treat it as failed
    """
    channel = open_channel(address, options)
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


async def answers_health_check_aio(address: str, options: TransportOptions, timeout: float = 1.0) -> bool:
    """:func:`answers_health_check` in an event loop: the wait holds no thread."""
    channel = open_aio_channel(address, options)
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        await channel.close()


class HealthService:
    """The health of one server: ``SERVING`` until :meth:`stop_serving`.

    Example::

        health = HealthService()
        server = grpc.server(pool, handlers=[health.generic_handler()])
        ...
        health.stop_serving()  # probes see NOT_SERVING while the server drains
    """

    def __init__(self):
        self._status = health_pb2.HealthCheckResponse.SERVING

    def stop_serving(self) -> None:
        self._status = health_pb2.HealthCheckResponse.NOT_SERVING

    def generic_handler(self, aio: bool = False) -> grpc.GenericRpcHandler:
        """The handler to serve; ``aio=True`` for a ``grpc.aio`` server."""
        check = grpc.stream_unary_rpc_method_handler(
            self._check_aio if aio else self._check,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Check": check})

    def _check(self, request_iterator, context) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=self._status)

    async def _check_aio(self, request_iterator, context) -> health_pb2.HealthCheckResponse:
        return self._check(request_iterator, context)
