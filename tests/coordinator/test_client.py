"""The coordinator client's retries: paused, bounded by their deadline, against a coordinator that is down."""

import time

import grpc
import pytest

from elasticdl_strategy.coordinator.client import CoordinatorClient
from elasticdl_strategy.errors import CollectiveTimeoutError, RendezvousError
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


@pytest.fixture
def down():
    """A client whose every call fails at once with UNAVAILABLE; ``calls`` counts them."""
    client = CoordinatorClient("127.0.0.1:1", "w0", new_token(), TransportOptions())
    calls = []

    def call(method, request, timeout):
        calls.append(time.monotonic())
        raise Unavailable()

    client._call = call
    try:
        yield client, calls
    finally:
        client.close()


def test_a_commit_against_a_coordinator_that_is_down_pauses_between_attempts_until_its_deadline(down):
    client, calls = down
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="unreachable"):
        client.commit(1, 1, coordinator_pb2.DataPosition(), leaving_workers=[], timeout=1.5)
    elapsed = time.monotonic() - started
    # Backoff 50 ms, doubling: about 6 attempts in 1.5 s (an unpaused loop made tens of thousands).
    assert 3 <= len(calls) <= 12, len(calls)
    assert 1.4 <= elapsed < 3.0, elapsed


@pytest.mark.parametrize("call", ["register", "get_shards"])
def test_register_and_get_shards_give_up_at_their_deadline_with_a_rendezvous_error(down, call):
    client, calls = down
    started = time.monotonic()
    with pytest.raises(RendezvousError):
        if call == "register":
            client.register("127.0.0.1:2", timeout=1.0)
        else:
            client.get_shards(coordinator_pb2.DatasetSpec(num_records=10, shard_size=5), 0, timeout=1.0)
    assert 2 <= len(calls) <= 10 and time.monotonic() - started < 2.5
