"""The job token: calls without it or with a wrong one are rejected and change nothing."""

import logging
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticdl_strategy.coordinator import CoordinatorParams, WorkerCounts
from elasticdl_strategy.coordinator.client import CoordinatorClient
from elasticdl_strategy.coordinator.server import CoordinatorServer
from elasticdl_strategy.errors import AuthenticationError, ConfigError
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import TOKEN_METADATA_KEY, TokenAuthInterceptor, call_metadata, new_token
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.peer_link import ABORT_METHOD, TRANSFER_METHOD
from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc, peer_pb2
from elasticdl_strategy.transport.refusals import RefusalLog, grpc_peer_host
from elasticdl_strategy.transport.worker_server import WorkerServer
from tests.cluster import ThreadCluster

BAD_METADATA = [None, ((TOKEN_METADATA_KEY, "x" * 64),)]


@pytest.fixture
def cluster():
    with ThreadCluster(2) as c:
        yield c


@pytest.mark.parametrize("metadata", BAD_METADATA, ids=["no-token", "wrong-token"])
def test_peer_rpcs_without_the_token_are_rejected_and_the_ring_is_unaffected(cluster, metadata, caplog):
    channel = grpc.insecure_channel(cluster.addresses[1])
    abort = channel.unary_unary(
        ABORT_METHOD, peer_pb2.AbortRequest.SerializeToString, peer_pb2.AbortResponse.FromString
    )
    with pytest.raises(grpc.RpcError) as info:
        abort(
            peer_pb2.AbortRequest(src_rank=0, membership_version=1, kind="mismatch", reason="forged"),
            metadata=metadata,
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    transfer = channel.stream_stream(TRANSFER_METHOD, None, peer_pb2.TransferReply.FromString)
    hello = frames.encode_hello(peer_pb2.StreamHello(src_rank=0, membership_version=1))
    header = peer_pb2.MessageHeader(
        channel=1, tag=0, sequence=0, nbytes=8, dtype="float32", shape=[2], inline_data=b"\0" * 8
    )
    with pytest.raises(grpc.RpcError) as info:
        list(transfer(iter([hello, frames.encode_header(header)]), metadata=metadata, timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()

    assert cluster.token not in caplog.text and "x" * 64 not in caplog.text  # refusals are logged, never tokens
    results = cluster.run(lambda c: c.allreduce(np.full(3, c.rank + 1.0)))
    for r in results:
        np.testing.assert_array_equal(r, [3.0, 3.0, 3.0])


@pytest.fixture
def silent():
    """Request streams that send nothing (until the test ends): calls that stay half-open."""
    never = threading.Event()

    def requests():
        never.wait(30)
        yield b""

    yield requests
    never.set()


def test_calls_that_send_headers_but_no_request_hold_no_server_thread(silent):
    # A server of 2 threads; 6 calls without the token send their headers and never their
    # request. Rejected at once, they leave both threads free for a legitimate call.
    token = new_token()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenAuthInterceptor(token)])
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Call": echo})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            half_open = channel.stream_unary("/test.Echo/Call")
            calls = [half_open.future(silent(), timeout=30) for _ in range(6)]
            for call in calls:
                assert call.exception(timeout=5).code() == grpc.StatusCode.UNAUTHENTICATED
            reply = channel.unary_unary("/test.Echo/Call")(b"hi", metadata=call_metadata(token), timeout=2)
            assert reply == b"hi"
    finally:
        server.stop(0)


def test_refusals_are_logged_once_per_source_per_interval(caplog):
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("test.refusals"), what="calls", interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for second in range(25):  # 3 refusals a second from one source, 1 a second from another
            now[0] = float(second)
            for _ in range(3):
                refusals.refused("10.0.0.7", "no job token")
            refusals.refused("10.0.0.8", "a wrong job token")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6  # at 0, 10 and 20 s for each source
    assert lines[0] == "refused 1 calls from 10.0.0.7: 1 no job token"
    assert "refused 30 calls from 10.0.0.7 in the last 10s: 30 no job token" in lines
    assert "refused 10 calls from 10.0.0.8 in the last 10s: 10 a wrong job token" in lines


def test_grpc_peer_strings_give_the_peer_address():
    assert grpc_peer_host("ipv4:10.0.0.3:5123") == "10.0.0.3"
    assert grpc_peer_host("ipv6:%5B::1%5D:5123") == "::1"
    assert grpc_peer_host("ipv6:[::ffff:10.0.0.3]:5123") == "10.0.0.3"
    assert grpc_peer_host("unix:/tmp/socket") is None


def test_health_checks_that_never_send_their_request_hold_no_thread(silent):
    # A worker server of 4 threads; 12 health checks send their headers and nothing else.
    server = WorkerServer("127.0.0.1:0", new_token(), TransportOptions(data_socket=False), max_threads=4)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            half_open = channel.stream_unary(
                "/grpc.health.v1.Health/Check", None, health_pb2.HealthCheckResponse.FromString
            )
            calls = [half_open.future(silent(), timeout=30) for _ in range(12)]
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)  # Kubernetes' probe
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert all(c.result(timeout=5).status == health_pb2.HealthCheckResponse.SERVING for c in calls)
    finally:
        server.stop(0)


def test_health_answers_without_a_token(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("metadata", BAD_METADATA, ids=["no-token", "wrong-token"])
def test_coordinator_rejects_calls_without_the_token_and_keeps_its_state(metadata):
    token = new_token()
    server = CoordinatorServer(
        CoordinatorParams(WorkerCounts.of(1, max_workers=2)), "127.0.0.1:0", token, TransportOptions()
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            heartbeats = lambda request, **kwargs: list(stub.Heartbeats(iter([request]), **kwargs))  # noqa: E731
            for call, request in [
                (stub.Register, coordinator_pb2.RegisterRequest(worker_id="intruder", address="127.0.0.1:1")),
                (stub.Leave, coordinator_pb2.LeaveRequest(worker_id="intruder")),
                (heartbeats, coordinator_pb2.HeartbeatRequest(worker_id="intruder")),
            ]:
                with pytest.raises(grpc.RpcError) as info:
                    call(request, metadata=metadata, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.coordinator.membership.version == 0
        client = CoordinatorClient(f"127.0.0.1:{server.port}", "w", "y" * 64, TransportOptions())
        with pytest.raises(AuthenticationError, match="EDL_JOB_TOKEN"):
            client.register("127.0.0.1:2", timeout=5)
        client.close()
    finally:
        server.stop(0)


def test_short_token_is_refused():
    with pytest.raises(ConfigError, match="at least 16"):
        ThreadCluster(1, token="short")


def test_every_refuser_of_calls_counts_into_one_log_per_source():
    # One line per source per interval with all its kinds: the token check, the bound per address
    # and the malformed-request check share one log.
    from elasticdl_strategy.transport import auth, limits, malformed, refusals

    assert auth.call_refusals is limits.call_refusals is malformed.call_refusals is refusals.call_refusals
