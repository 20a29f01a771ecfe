"""gRPC servers and channels set up the same way everywhere: limits, keepalive, auth, TLS.

Two kinds of server: :func:`start_server` (a pool of daemon threads, see
:mod:`~elasticdl_strategy.transport.daemon_pool`; the worker's ``Peer``
service, whose streams move bytes in their handler threads) and
:func:`start_aio_server` (``grpc.aio``, one event loop; the coordinator, whose
calls mostly wait — long polls, commit barriers — and must cost no thread
each). Both bound the calls a connection may have open at once
(:data:`MAX_STREAMS_PER_CONNECTION`; a client past it waits for a slot, by
HTTP/2 flow control), and every channel gets its own connection
(``grpc.use_local_subchannel_pool``) so that the clients of one process never
share one connection's bound.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, List, Optional, Tuple

import grpc

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.auth import AioTokenAuthInterceptor, TokenAuthInterceptor
from elasticdl_strategy.transport.daemon_pool import DaemonThreadPool
from elasticdl_strategy.transport.limits import AioAddressLimitInterceptor
from elasticdl_strategy.transport.options import TransportOptions

# One client holds at most a few calls at once on a connection (a worker to the coordinator: a long
# poll or a commit, a heartbeat, a report; a peer: one stream per membership, two while one is
# replaced, and aborts).
MAX_STREAMS_PER_CONNECTION = 32


def _server_args(options: TransportOptions) -> List[Tuple[str, int]]:
    return options.grpc_options() + [
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]


def _bind(server, bind: str, options: TransportOptions) -> int:
    try:
        if options.tls is not None:
            port = server.add_secure_port(bind, options.tls.server_credentials())
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise ConfigError(f"cannot listen on {bind}: {e}") from None
    if port == 0:
        raise ConfigError(f"cannot listen on {bind}: the address is in use or invalid")
    return port


def start_server(
    handlers: Iterable[grpc.GenericRpcHandler],
    bind: str,
    token: str,
    options: TransportOptions,
    max_workers: int = 16,
    register: Optional[Callable[[grpc.Server], None]] = None,
) -> Tuple[grpc.Server, int]:
    """Starts a thread-pool gRPC server on ``bind`` (``host:port``, port 0 picks a free one).

    ``register`` is called with the server before it starts, for generated
    ``add_*Servicer_to_server`` functions.

    Returns:
        ``(server, port)``.

    Raises:
        ConfigError: the address cannot be bound (e.g. the port is in use).
    """
    server = grpc.server(
        DaemonThreadPool(max_workers=max_workers, thread_name_prefix="edl-rpc"),
        handlers=list(handlers),
        interceptors=[TokenAuthInterceptor(token)],
        options=_server_args(options),
        maximum_concurrent_rpcs=None,
    )
    if register is not None:
        register(server)
    port = _bind(server, bind, options)
    server.start()
    return server, port


async def start_aio_server(
    handlers: Iterable[grpc.GenericRpcHandler],
    bind: str,
    token: str,
    options: TransportOptions,
    calls_per_address: int,
    register: Optional[Callable[[grpc.aio.Server], None]] = None,
) -> Tuple[grpc.aio.Server, int]:
    """Starts a ``grpc.aio`` server on ``bind`` in the running event loop; handlers are coroutines.

    At most ``calls_per_address`` authenticated calls from one IP address are open at once
    (:class:`~elasticdl_strategy.transport.limits.AioAddressLimitInterceptor`).

    Returns:
        ``(server, port)``.

    Raises:
        ConfigError: the address cannot be bound.
    """
    server = grpc.aio.server(
        handlers=list(handlers),
        interceptors=[AioTokenAuthInterceptor(token), AioAddressLimitInterceptor(calls_per_address)],
        options=_server_args(options),
    )
    if register is not None:
        register(server)
    port = _bind(server, bind, options)
    await server.start()
    return server, port


# A channel whose server went away tries again within this long (gRPC's default backoff grows to
# 120 s): a coordinator restarted in place is found again by every worker within a heartbeat or two.
_MAX_RECONNECT_BACKOFF_MS = 1000


def _channel_args(options: TransportOptions, extra: Optional[list]) -> list:
    args: list = options.grpc_options() + [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ]
    args += list(extra or [])
    if options.tls is not None and options.tls.server_name:
        args.append(("grpc.ssl_target_name_override", options.tls.server_name))
    return args


def open_channel(address: str, options: TransportOptions, extra: Optional[list] = None) -> grpc.Channel:
    """Opens a channel to ``address`` with the transport's limits and keepalive settings."""
    args = _channel_args(options, extra)
    if options.tls is not None:
        return grpc.secure_channel(address, options.tls.channel_credentials(), options=args)
    return grpc.insecure_channel(address, options=args)


def open_aio_channel(address: str, options: TransportOptions) -> grpc.aio.Channel:
    """:func:`open_channel` for ``grpc.aio`` (call it in the event loop that will use it)."""
    asyncio.get_running_loop()  # fail here, not at first use, outside an event loop
    args = _channel_args(options, None)
    if options.tls is not None:
        return grpc.aio.secure_channel(address, options.tls.channel_credentials(), options=args)
    return grpc.aio.insecure_channel(address, options=args)
