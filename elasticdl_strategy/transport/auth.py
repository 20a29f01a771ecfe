"""The job token: every RPC carries it, every server checks it.

The token is a per-job secret made by the launcher and handed to every process
through the ``EDL_JOB_TOKEN`` environment variable (on Kubernetes, from a
Secret). Servers compare it in constant time and reject a call without it, or
with a wrong one, with ``UNAUTHENTICATED`` before any handler runs. The token
itself is never logged.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Optional, Sequence, Tuple

import grpc

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.malformed import refuse_malformed
from elasticdl_strategy.transport.refusals import call_refusals, grpc_peer_host

TOKEN_METADATA_KEY = "x-elasticdl-job-token"
MIN_TOKEN_LENGTH = 16

# Read-only services that must answer without a token (Kubernetes' gRPC probes send none).
_UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


def new_token() -> str:
    """Returns a fresh random job token (256 bits, hex)."""
    return secrets.token_hex(32)


def validate_token(token: Optional[str]) -> str:
    if not token or len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the job token must be at least {MIN_TOKEN_LENGTH} characters "
            "(set EDL_JOB_TOKEN, or start workers with the launcher which makes one)"
        )
    return token


def call_metadata(token: str) -> Tuple[Tuple[str, str], ...]:
    """Metadata to pass with every call: ``stub.Method(request, metadata=call_metadata(token))``."""
    return ((TOKEN_METADATA_KEY, token),)


def _rejecting_handler(method: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler that aborts at once, whatever the method's kind.

    It takes the request as a stream and never reads it: for a handler with a
    unary request gRPC would first wait, in a server thread, for the request
    message, which a client that sends only headers never sends (each such
    call would hold a thread for good).
    """

    def reject(request_iterator, context):
        call_refusals.refused(grpc_peer_host(context.peer()), reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} rejected: the call carried {reason}")

    return grpc.stream_stream_rpc_method_handler(reject)


def _aio_rejecting_handler(method: str, reason: str) -> grpc.RpcMethodHandler:
    """:func:`_rejecting_handler` for a ``grpc.aio`` server."""

    async def reject(request_iterator, context):
        call_refusals.refused(grpc_peer_host(context.peer()), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} rejected: the call carried {reason}")

    return grpc.stream_stream_rpc_method_handler(reject)


class _TokenCheck:
    """Which calls are let through: the exempt methods, and those carrying the job token."""

    def __init__(self, token: str, exempt_prefixes: Sequence[str]):
        self._token = validate_token(token).encode()
        self._exempt = tuple(exempt_prefixes)

    def refusal(self, handler_call_details) -> Optional[str]:
        """Why the call is refused, or ``None`` when it may proceed."""
        if handler_call_details.method.startswith(self._exempt):
            return None
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
                break
        if presented is not None and hmac.compare_digest(presented, self._token):
            return None
        return "no job token" if presented is None else "a wrong job token"


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose metadata lacks the job token; refuses malformed requests of the others.

    Example::

        server = grpc.server(pool, interceptors=[TokenAuthInterceptor(token)])
    """

    def __init__(self, token: str, exempt_prefixes: Sequence[str] = _UNAUTHENTICATED_PREFIXES):
        self._check = _TokenCheck(token, exempt_prefixes)

    def intercept_service(self, continuation, handler_call_details):
        reason = self._check.refusal(handler_call_details)
        if reason is None:
            return refuse_malformed(continuation(handler_call_details), aio=False)
        return _rejecting_handler(handler_call_details.method, reason)


class AioTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """:class:`TokenAuthInterceptor` for a ``grpc.aio`` server.

    Example::

        server = grpc.aio.server(interceptors=[AioTokenAuthInterceptor(token)])
    """

    def __init__(self, token: str, exempt_prefixes: Sequence[str] = _UNAUTHENTICATED_PREFIXES):
        self._check = _TokenCheck(token, exempt_prefixes)

    async def intercept_service(self, continuation, handler_call_details):
        reason = self._check.refusal(handler_call_details)
        if reason is None:
            return refuse_malformed(await continuation(handler_call_details), aio=True)
        return _aio_rejecting_handler(handler_call_details.method, reason)
