"""Running the coordinator as a process: ``elasticdl-strategy coordinator ...``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from typing import List, Optional

from elasticdl_strategy.coordinator.coordinator import Coordinator
from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.service import CoordinatorService, health_probe
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.transport.auth import validate_token
from elasticdl_strategy.transport.endpoints import start_aio_server
from elasticdl_strategy.transport.health import HealthService
from elasticdl_strategy.transport.options import TLSConfig, TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2_grpc

logger = logging.getLogger(__name__)

# Calls open at once from one address (all of a host's workers share one): a worker holds a long
# poll or a commit, a heartbeat, and now and then a report, a shard request or a leave.
CALLS_PER_WORKER = 4
CALLS_BESIDE_WORKERS = 16  # the launcher's and operators' calls
# Longest the server's event loop may take to start or stop serving.
_START_TIMEOUT_S = 10.0


class CoordinatorServer:
    """A :class:`Coordinator` served over gRPC with token auth and gRPC health.

    The server runs a ``grpc.aio`` event loop in a thread of its own: waiting
    calls (membership long polls) are coroutines, the reaper a task.

    Example::

        server = CoordinatorServer(CoordinatorParams(WorkerCounts.of(2)), "127.0.0.1:0", token, TransportOptions())
        address = f"127.0.0.1:{server.port}"
        ...
        server.stop()

    Raises:
        ConfigError: the address cannot be bound.
    """

    def __init__(self, params: CoordinatorParams, bind: str, token: str, options: TransportOptions):
        self.coordinator = Coordinator(params)
        self.health = HealthService()
        self._service = CoordinatorService(self.coordinator, health_probe(options))  # probes use the job's TLS
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edl-coordinator", daemon=True)
        self._thread.start()
        try:
            self._server, self.port = self._run(self._start(bind, validate_token(token), options), _START_TIMEOUT_S)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_START_TIMEOUT_S)
            raise
        self._reaper = asyncio.run_coroutine_threadsafe(self._reap(), self._loop)
        self._stopped = False

    def _run(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _start(self, bind: str, token: str, options: TransportOptions):
        def register(server):
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self._service, server)

        calls = CALLS_PER_WORKER * self.coordinator.params.counts.max_workers + CALLS_BESIDE_WORKERS
        return await start_aio_server([self.health.generic_handler(aio=True)], bind, token, options, calls, register)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.coordinator.params.reap_period_s)
            self.coordinator.reap()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving: waiting calls are answered, others get ``grace`` seconds to finish."""
        if self._stopped:
            return
        self._stopped = True
        self.coordinator.stop()
        self.health.stop_serving()
        self._reaper.cancel()
        try:
            self._run(self._server.stop(grace), grace + _START_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_START_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1", help="host to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    parser.add_argument("--port-file", help="write the bound port to this file once serving")
    parser.add_argument("--workers", type=int, default=1, help="workers expected for the first membership")
    parser.add_argument("--min-workers", type=int, help="fewest workers to train with (default: --workers)")
    parser.add_argument("--max-workers", type=int, help="most workers in a membership (default: --workers)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between worker heartbeats")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0, help="silence that declares a worker dead")
    parser.add_argument("--last-call", type=float, default=5.0, help="seconds to wait for more than --min-workers")


def params_from_args(args: argparse.Namespace) -> CoordinatorParams:
    return CoordinatorParams(
        WorkerCounts.of(args.workers, args.min_workers, args.max_workers),
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        last_call_s=args.last_call,
    )


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; the job token comes from ``EDL_JOB_TOKEN``."""
    params = params_from_args(args)
    options = TransportOptions(tls=TLSConfig.from_env(os.environ))
    server = CoordinatorServer(params, f"{args.bind}:{args.port}", os.environ.get("EDL_JOB_TOKEN", ""), options)
    logger.info("coordinator serving on %s:%d", args.bind, server.port)
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, args.port_file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.stop()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="elasticdl-strategy coordinator")
    add_arguments(parser)
    return run(parser.parse_args(argv))
