"""A bound on the calls one source address may have open at once on a server.

Beside the bound per connection (HTTP/2's ``max_concurrent_streams``, see
:mod:`~elasticdl_strategy.transport.endpoints`), a client may open many
connections; :class:`AioAddressLimitInterceptor` counts the calls that passed
authentication by the caller's IP address, and refuses a call past the limit
with ``RESOURCE_EXHAUSTED`` at once (logged through a :class:`RefusalLog`).
"""

from __future__ import annotations

import collections
import functools
import inspect

import grpc

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.refusals import call_refusals, grpc_peer_host

_BEHAVIOURS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class AioAddressLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call when its source address already has ``limit`` calls open (``grpc.aio`` servers).

    Put it after the token check, so that only calls that may proceed are counted.

    Example::

        server = grpc.aio.server(interceptors=[AioTokenAuthInterceptor(token), AioAddressLimitInterceptor(256)])
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ConfigError(f"the limit of calls per address must be at least 1, not {limit}")
        self.limit = limit
        self._open: collections.Counter = collections.Counter()  # touched in the event loop only

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        for name in _BEHAVIOURS:
            behaviour = getattr(handler, name)
            if behaviour is not None:
                return handler._replace(**{name: self._bounded(behaviour, handler_call_details.method)})
        return handler

    def _bounded(self, behaviour, method: str):
        if inspect.isasyncgenfunction(behaviour):

            @functools.wraps(behaviour)
            async def stream(request, context):
                source = await self._enter(context, method)
                try:
                    async for response in behaviour(request, context):
                        yield response
                finally:
                    self._leave(source)

            return stream

        @functools.wraps(behaviour)
        async def call(request, context):
            source = await self._enter(context, method)
            try:
                return await behaviour(request, context)
            finally:
                self._leave(source)

        return call

    async def _enter(self, context, method: str) -> str:
        source = grpc_peer_host(context.peer()) or "an unknown source"
        if self._open[source] >= self.limit:
            call_refusals.refused(source, "past the limit of open calls")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} refused: {self.limit} calls from {source} are open"
            )
        self._open[source] += 1
        return source

    def _leave(self, source: str) -> None:
        self._open[source] -= 1
        if not self._open[source]:
            del self._open[source]
