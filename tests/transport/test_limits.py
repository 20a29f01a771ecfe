"""Bounds on open calls: per connection (HTTP/2 streams) and per source address (aio servers)."""

import asyncio
import logging
import threading

import grpc
import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport import limits
from elasticdl_strategy.transport.auth import call_metadata, new_token
from elasticdl_strategy.transport.endpoints import (
    MAX_STREAMS_PER_CONNECTION,
    open_aio_channel,
    open_channel,
    start_aio_server,
    start_server,
)
from elasticdl_strategy.transport.limits import AioAddressLimitInterceptor
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.refusals import RefusalLog

METHOD = "/test.Held/Hold"
TOKEN = new_token()
OPTIONS = TransportOptions()


def test_a_connection_has_at_most_its_bound_of_calls_in_handlers_and_another_connection_is_served():
    inside, peak, lock, release = [0], [0], threading.Lock(), threading.Event()

    def hold(request, context):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        release.wait(20)
        with lock:
            inside[0] -= 1
        return b"done"

    handler = grpc.method_handlers_generic_handler("test.Held", {"Hold": grpc.unary_unary_rpc_method_handler(hold)})
    server, port = start_server([handler], "127.0.0.1:0", TOKEN, OPTIONS, max_workers=4 * MAX_STREAMS_PER_CONNECTION)
    crowded, other = (open_channel(f"127.0.0.1:{port}", OPTIONS) for _ in range(2))
    try:
        grpc.channel_ready_future(crowded).result(timeout=5)
        calls = [
            crowded.unary_unary(METHOD).future(b"", metadata=call_metadata(TOKEN), timeout=20)
            for _ in range(2 * MAX_STREAMS_PER_CONNECTION)
        ]
        assert _wait(lambda: inside[0] >= MAX_STREAMS_PER_CONNECTION)
        served = other.unary_unary(METHOD).future(b"", metadata=call_metadata(TOKEN), timeout=20)
        assert _wait(lambda: inside[0] == MAX_STREAMS_PER_CONNECTION + 1)  # the other connection's call
        release.set()
        assert served.result(timeout=10) == b"done"
        for call in calls:  # the rest waited for a slot, or were refused (a burst before the bound was known)
            assert call.exception(timeout=10) is None or call.code() == grpc.StatusCode.UNAVAILABLE
        assert peak[0] == MAX_STREAMS_PER_CONNECTION + 1
    finally:
        release.set()
        crowded.close()
        other.close()
        server.stop(0)


def _wait(condition, timeout=10.0):
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return True
        event.wait(0.01)
    return condition()


def test_calls_past_the_limit_of_an_address_are_refused_at_once_and_counted_until_they_end(caplog, monkeypatch):
    # A log of its own: the shared one may have logged this source within its interval already.
    monkeypatch.setattr(limits, "call_refusals", RefusalLog(logging.getLogger(limits.__name__), what="calls"))

    async def main():
        release, inside = asyncio.Event(), [0]

        async def hold(request, context):
            inside[0] += 1
            try:
                await release.wait()
                return b"done"
            finally:
                inside[0] -= 1

        async def until(n):
            while inside[0] != n:
                await asyncio.sleep(0.01)

        handler = grpc.method_handlers_generic_handler("test.Held", {"Hold": grpc.unary_unary_rpc_method_handler(hold)})
        server, port = await start_aio_server([handler], "127.0.0.1:0", TOKEN, OPTIONS, calls_per_address=3)
        channels = [open_aio_channel(f"127.0.0.1:{port}", OPTIONS) for _ in range(4)]  # one connection each
        try:
            hold_on = [ch.unary_unary(METHOD) for ch in channels]

            def call(i, timeout=20):
                return hold_on[i](b"", metadata=call_metadata(TOKEN), timeout=timeout)

            held = [asyncio.ensure_future(call(i)) for i in range(3)]
            await asyncio.wait_for(until(3), 10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(3, timeout=2)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "3 calls from 127.0.0.1 are open" in refused.value.details()
            held[0].cancel()  # a cancelled call no longer counts ...
            release.set()  # ... nor do finished ones
            assert await asyncio.gather(*held[1:]) == [b"done", b"done"]
            release.clear()
            again = [asyncio.ensure_future(call(i)) for i in range(3)]
            await asyncio.wait_for(until(3), 10)
            assert not any(call.done() for call in again)
            release.set()
            assert await asyncio.gather(*again) == [b"done"] * 3
        finally:
            for channel in channels:
                await channel.close()
            await server.stop(0)

    asyncio.run(main())
    assert "past the limit of open calls" in caplog.text


def test_a_limit_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 1, not 0"):
        AioAddressLimitInterceptor(0)
