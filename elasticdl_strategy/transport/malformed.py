"""Malformed requests that carry the token: refused with ``INVALID_ARGUMENT``, quietly.

Left to gRPC, a request that does not parse is logged as an error with a
traceback on every call (by the thread-pool server and by ``grpc.aio`` alike).
:func:`refuse_malformed` gives a handler with a unary request a deserializer
that never raises — it hands on a marker instead — and a behaviour that
refuses the marker: one rate-limited line per source (a
:class:`~elasticdl_strategy.transport.refusals.RefusalLog`), no traceback.
Requests that are streams are our own frames, parsed (and refused with a
typed error) by the services themselves.
"""

from __future__ import annotations

import functools

import grpc

from elasticdl_strategy.transport.refusals import call_refusals, grpc_peer_host

_MALFORMED = object()


def refuse_malformed(handler: grpc.RpcMethodHandler, aio: bool) -> grpc.RpcMethodHandler:
    """``handler``, refusing requests that do not parse (``aio``: for a ``grpc.aio`` server)."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    name = "unary_stream" if handler.response_streaming else "unary_unary"
    behaviour = getattr(handler, name)

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception:  # DecodeError, or anything a parser raises on hostile bytes
            return _MALFORMED

    if aio and handler.response_streaming:

        @functools.wraps(behaviour)
        async def refusing_stream(request, context):
            if request is _MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(context))
            async for response in behaviour(request, context):
                yield response

        refusing = refusing_stream
    elif aio:

        @functools.wraps(behaviour)
        async def refusing_call(request, context):
            if request is _MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(context))
            return await behaviour(request, context)

        refusing = refusing_call
    else:

        @functools.wraps(behaviour)
        def refusing_sync(request, context):
            if request is _MALFORMED:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(context))
            return behaviour(request, context)

        refusing = refusing_sync
    return handler._replace(request_deserializer=deserialize, **{name: refusing})


def _refuse(context) -> str:
    call_refusals.refused(grpc_peer_host(context.peer()), "malformed request")
    return "the request does not parse"
