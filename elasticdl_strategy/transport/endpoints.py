"""gRPC servers and channels set up the same way everywhere: limits, keepalive, auth, TLS."""

from __future__ import annotations

from concurrent import futures
from typing import Callable, Iterable, Optional, Tuple

import grpc

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.auth import TokenAuthInterceptor
from elasticdl_strategy.transport.options import TransportOptions


def start_server(
    handlers: Iterable[grpc.GenericRpcHandler],
    bind: str,
    token: str,
    options: TransportOptions,
    max_workers: int = 16,
    register: Optional[Callable[[grpc.Server], None]] = None,
) -> Tuple[grpc.Server, int]:
    """Starts a gRPC server on ``bind`` (``host:port``, port 0 picks a free one).

    ``register`` is called with the server before it starts, for generated
    ``add_*Servicer_to_server`` functions.

    Returns:
        ``(server, port)``.

    Raises:
        ConfigError: the address cannot be bound (e.g. the port is in use).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="edl-rpc"),
        handlers=list(handlers),
        interceptors=[TokenAuthInterceptor(token)],
        options=options.grpc_options() + [("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=None,
    )
    if register is not None:
        register(server)
    try:
        if options.tls is not None:
            port = server.add_secure_port(bind, options.tls.server_credentials())
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise ConfigError(f"cannot listen on {bind}: {e}") from None
    if port == 0:
        raise ConfigError(f"cannot listen on {bind}: the address is in use or invalid")
    server.start()
    return server, port


def open_channel(address: str, options: TransportOptions, extra: Optional[list] = None) -> grpc.Channel:
    """Opens a channel to ``address`` with the transport's limits and keepalive settings."""
    args = options.grpc_options() + list(extra or [])
    if options.tls is not None:
        if options.tls.server_name:
            args.append(("grpc.ssl_target_name_override", options.tls.server_name))
        return grpc.secure_channel(address, options.tls.channel_credentials(), options=args)
    return grpc.insecure_channel(address, options=args)
