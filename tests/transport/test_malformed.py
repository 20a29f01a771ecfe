"""Requests that carry the token but do not parse: INVALID_ARGUMENT, one log line, no traceback."""

import logging

import grpc
import pytest

from elasticdl_strategy.coordinator import CoordinatorParams, WorkerCounts
from elasticdl_strategy.coordinator.server import CoordinatorServer
from elasticdl_strategy.transport.auth import call_metadata, new_token
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2
from elasticdl_strategy.transport.worker_server import WorkerServer

GARBAGE = b"\x08\xff garbage"


@pytest.fixture
def servers():
    token = new_token()
    coordinator = CoordinatorServer(CoordinatorParams(WorkerCounts.of(1)), "127.0.0.1:0", token, TransportOptions())
    worker = WorkerServer("127.0.0.1:0", token, TransportOptions())
    yield token, {"coordinator": coordinator.port, "worker": worker.port}
    coordinator.stop(0)
    worker.stop(0)


@pytest.mark.parametrize(
    "server, method",
    [
        ("coordinator", "/elasticdl_strategy.coordinator.Coordinator/Register"),
        ("coordinator", "/elasticdl_strategy.coordinator.Coordinator/Commit"),
        ("worker", "/elasticdl_strategy.peer.Peer/Abort"),
    ],
)
def test_malformed_requests_are_refused_with_one_line_and_the_server_goes_on(servers, server, method, caplog):
    token, ports = servers
    caplog.set_level(logging.DEBUG)
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[server]}")
    try:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method)(GARBAGE, metadata=call_metadata(token), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "the request does not parse"
        if server == "coordinator":  # a well-formed call is served as before
            register = channel.unary_unary(
                "/elasticdl_strategy.coordinator.Coordinator/Register",
                coordinator_pb2.RegisterRequest.SerializeToString,
                coordinator_pb2.RegisterResponse.FromString,
            )
            request = coordinator_pb2.RegisterRequest(worker_id="w", address="h:1")
            assert register(request, metadata=call_metadata(token), timeout=5).join_order == 1
    finally:
        channel.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    refusals = [r.getMessage() for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(refusals) <= 1 and token not in caplog.text  # one line per source per interval
