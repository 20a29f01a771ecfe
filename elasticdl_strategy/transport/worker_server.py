"""The one gRPC server every worker runs: the ``Peer`` service and gRPC health.

The server outlives memberships: when the membership changes, the worker
installs a new listener (the new communicator's point-to-point endpoint) with
:meth:`WorkerServer.set_listener`. A stream that announces a newer membership
version than the installed listener waits briefly for it to appear.
"""

from __future__ import annotations

import threading
from typing import Optional

from elasticdl_strategy.transport.data_socket import DataSocketListener, host_of
from elasticdl_strategy.transport.endpoints import start_server
from elasticdl_strategy.transport.health import HealthService
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.peer_link import PeerService, StreamListener
from elasticdl_strategy.transport.protos import peer_pb2

# Every inbound stream holds a server thread for its life: N - 1 per membership (a direct
# all-reduce talks to every peer), two memberships while one is being replaced, plus short calls.
# Enough for jobs of several hundred workers; threads are only started as calls need them.
MAX_THREADS = 1024


class WorkerServer:
    """Serves a worker's peer endpoint on ``bind`` (port 0 picks a free port), and
    accepts direct data sockets on the same host at ``data_port`` (0: any free port).

    Example::

        server = WorkerServer("127.0.0.1:0", token, TransportOptions())
        address = f"127.0.0.1:{server.port}"   # registered with the coordinator
        server.set_listener(version, p2p)       # once the membership is known
    """

    def __init__(
        self, bind: str, token: str, options: TransportOptions, max_threads: int = MAX_THREADS, data_port: int = 0
    ):
        self._options = options
        self._cond = threading.Condition()
        self._listener: Optional[StreamListener] = None
        self._version = -1
        self.health = HealthService()
        self.data_sockets: Optional[DataSocketListener] = None
        if options.data_socket:
            self.data_sockets = DataSocketListener(
                host_of(bind),
                data_port,
                options.keepalive_s,
                options.message_limit,
                options.connect_timeout_s,
                tls=options.tls.server_ssl_context() if options.tls is not None else None,
            )
        service = PeerService(
            self,
            options.shared_memory_dir if options.shared_memory else None,
            self.data_sockets,
            attach_timeout_s=options.connect_timeout_s,
        )
        self._server, self.port = start_server(
            [service.generic_handler(), self.health.generic_handler()],
            bind,
            token,
            options,
            max_workers=max_threads,
        )

    def set_listener(self, version: int, listener: Optional[StreamListener]) -> None:
        """Routes streams and aborts of membership ``version`` to ``listener``."""
        with self._cond:
            self._version, self._listener = version, listener
            self._cond.notify_all()

    def _listener_for(self, version: int) -> StreamListener:
        with self._cond:
            self._cond.wait_for(lambda: self._version >= version, timeout=self._options.connect_timeout_s)
            if self._listener is None or self._version != version:
                raise ValueError(f"this worker is at membership version {self._version}, not {version}")
            return self._listener

    # StreamListener, delegating by membership version.
    def open_stream(self, hello: peer_pb2.StreamHello):
        return self._listener_for(hello.membership_version).open_stream(hello)

    def on_abort(self, request: peer_pb2.AbortRequest) -> None:
        try:
            listener = self._listener_for(request.membership_version)
        except ValueError:
            return  # an abort for a membership this worker has left behind
        listener.on_abort(request)

    def stop(self, grace: float = 1.0) -> None:
        self.health.stop_serving()
        self._server.stop(grace).wait(timeout=grace + 1.0)
        if self.data_sockets is not None:
            self.data_sockets.close()
