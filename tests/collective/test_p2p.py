"""Point-to-point: blocking and non-blocking, matching by (sender, tag, sequence), buffers, deadlines."""

import contextlib
import os
import threading
import time

import numpy as np
import pytest

from elasticdl_strategy.collective import p2p as p2p_module
from elasticdl_strategy.collective.mailbox import Mailbox, ReduceSink
from elasticdl_strategy.collective.p2p import PointToPoint, _AwaitedOnSocket, _DirectReceive, _InboundStream
from elasticdl_strategy.collective.ring import CollectiveCall
from elasticdl_strategy.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationError,
    PeerFailureError,
    UsageError,
)
from elasticdl_strategy.transport import inbound, lanes
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.byte_paths import DataSocketPath
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.inbound import WAITING_THREAD_READS_AT_MOST, SocketFrames
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.worker_server import WorkerServer
from tests.cluster import ThreadCluster, transport_options
from tests.conditions import wait_for


@pytest.fixture(scope="module")
def pair():
    cluster = ThreadCluster(2, TransportOptions(chunk_size=64 << 10, inline_threshold=1024, timeout_s=10))
    yield cluster
    cluster.close()


def p2p(cluster, rank):
    return cluster.communicators[rank].p2p


def test_messages_match_by_tag_and_order_not_arrival(pair):
    a, b = p2p(pair, 0), p2p(pair, 1)
    for i in range(3):
        a.send(np.full(4, i), dst=1, tag=5)
    a.send(np.full(4, 99), dst=1, tag=9)
    # Receive tag 9 first although it arrived last, then tag 5 in send order.
    np.testing.assert_array_equal(b.recv(0, tag=9), np.full(4, 99))
    for i in range(3):
        np.testing.assert_array_equal(b.recv(0, tag=5), np.full(4, i))


def test_irecv_posted_before_send_and_chunked_large_message(pair):
    a, b = p2p(pair, 0), p2p(pair, 1)
    data = np.random.default_rng(0).standard_normal((300, 1001)).astype(np.float32)  # ~1.2 MB, 19 chunks
    out = np.zeros_like(data)
    request = b.irecv(0, tag=1, out=out)
    assert not request.done()
    send = a.isend(data, dst=1, tag=1)
    assert request.wait(timeout=10) is out
    send.wait(timeout=10)
    assert send.done() and request.done()
    np.testing.assert_array_equal(out, data)


def test_recv_without_out_returns_sender_dtype_and_shape(pair):
    a, b = p2p(pair, 0), p2p(pair, 1)
    a.send(np.arange(6, dtype=np.int32).reshape(2, 3), dst=1)
    got = b.recv(0)
    assert got.dtype == np.int32 and got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.arange(6).reshape(2, 3))


def test_recv_into_wrong_size_buffer_is_a_clear_error(pair):
    a, b = p2p(pair, 0), p2p(pair, 1)
    a.send(np.ones(5, np.float32), dst=1, tag=3)
    with pytest.raises(CollectiveMismatchError, match="holds 20 bytes.*receive buffer holds 40"):
        b.recv(0, tag=3, out=np.zeros(10, np.float32))


def test_recv_times_out_naming_the_sender(pair):
    b = p2p(pair, 1)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="waiting for rank 0") as info:
        b.recv(0, tag=77, timeout=0.3)
    assert info.value.waiting_for == (0,)
    assert time.monotonic() - start < 5
    # The timed-out receive was withdrawn: the message goes to the next one.
    p2p(pair, 0).send(np.full(1, 5.0), dst=1, tag=77)
    np.testing.assert_array_equal(b.recv(0, tag=77), [5.0])


def test_irecv_wait_timeout_keeps_the_receive_posted(pair):
    a, b = p2p(pair, 0), p2p(pair, 1)
    request = b.irecv(0, tag=78)
    with pytest.raises(CollectiveTimeoutError):
        request.wait(timeout=0.1)
    a.send(np.full(2, 3), dst=1, tag=78)
    np.testing.assert_array_equal(request.wait(), [3, 3])


def test_send_to_self(pair):
    a = p2p(pair, 0)
    data = np.arange(3.0)
    request = a.isend(data, dst=0, tag=2)
    data[:] = -1  # the message was copied
    request.wait()
    np.testing.assert_array_equal(a.recv(0, tag=2), np.arange(3.0))


def test_invalid_peer_is_a_config_error(pair):
    with pytest.raises(UsageError, match="ranks are 0..1"):
        p2p(pair, 0).send(np.ones(1), dst=2)


@pytest.mark.parametrize("transport", ["data-socket", "grpc"])
def test_a_worker_receives_from_more_peers_than_a_fixed_thread_pool(transport):
    # Each inbound stream holds one server thread for its life: a direct all-reduce of N workers
    # has N - 1 of them on every worker, so the server must not stop at a fixed small number.
    n = 80
    token = new_token()
    options = transport_options(transport)
    server = WorkerServer("127.0.0.1:0", token, options)
    addresses = [f"127.0.0.1:{server.port}"] + ["127.0.0.1:1"] * (n - 1)  # senders serve nothing here
    receiver = PointToPoint(0, addresses, 1, token, options)
    server.set_listener(1, receiver)
    senders = [PointToPoint(r, addresses, 1, token, options) for r in range(1, n)]
    try:
        requests = [s.isend(np.full(4, s.rank, np.int64), dst=0) for s in senders]
        for r in range(1, n):
            np.testing.assert_array_equal(receiver.recv(src=r, timeout=20), np.full(4, r, np.int64))
        for request in requests:
            request.wait(timeout=5)
    finally:
        for p in senders + [receiver]:
            p.close(timeout=2.0)
        server.stop(grace=0.2)


class _StalledReceiver:
    """A peer's receiving end that takes a message's header and then stops reading (a peer cut off by
    the network, as the sender sees it: nothing moves, and no error either)."""

    def __init__(self):
        self.header_arrived, self.release = threading.Event(), threading.Event()

    def open_stream(self, hello):
        return self

    def on_abort(self, request):
        pass

    def on_header(self, header):
        self.header_arrived.set()
        self.release.wait(30)
        raise ValueError("released")

    def on_closed(self, error, goodbye):
        pass


@pytest.mark.parametrize("transport", ["data-socket", "grpc"])
def test_sends_to_a_peer_declared_failed_fail_at_once_even_while_stuck_on_its_connection(transport, monkeypatch):
    # A cut between hosts shows first on one of the two connections of a pair (here: the peer's
    # stream to us broke); the send stuck on the other must fail with it, not wait for its deadline.
    token, options = new_token(), transport_options(transport, timeout_s=30)
    server = WorkerServer("127.0.0.1:0", token, options)
    stalled = _StalledReceiver()
    server.set_listener(1, stalled)
    sender = PointToPoint(0, ["127.0.0.1:1", f"127.0.0.1:{server.port}"], 1, token, options)
    shutdown = FrameSocket.shutdown

    def shutdown_and_let_the_woken_write_fail_first(self):
        # The unlucky schedule, every time: the blocked write wakes and handles its broken pipe
        # before the failing thread goes on. The send must still fail with the peer's reason.
        shutdown(self)
        with contextlib.suppress(PeerFailureError, CollectiveTimeoutError):
            request.wait(timeout=2)

    monkeypatch.setattr(FrameSocket, "shutdown", shutdown_and_let_the_woken_write_fail_first)
    try:
        request = sender.isend(np.ones(16 << 20, np.float32), dst=1)  # 64 MiB: more than any buffer
        assert stalled.header_arrived.wait(10)
        assert not request.done()
        sender.peer_failed(1, "its stream to us broke")
        started = time.monotonic()
        with pytest.raises(PeerFailureError, match="its stream to us broke"):
            request.wait(timeout=5)
        assert time.monotonic() - started < 1.0
        with pytest.raises(PeerFailureError):  # and later sends too
            sender.isend(np.ones(4), dst=1).wait(timeout=5)
    finally:
        stalled.release.set()
        sender.close(timeout=2.0)
        server.stop(grace=0.2)


@pytest.fixture
def shm_pair():
    cluster = ThreadCluster(2, transport_options("shared-memory", timeout_s=10))
    a, b = p2p(cluster, 0), p2p(cluster, 1)
    a.send(np.zeros(1 << 20, np.uint8), dst=1)  # opens the stream; the lane is used from its answer on
    b.recv(0)
    wait_for(lambda: a.shared_memory_peers == [1], "the peer mapped the arena")
    yield cluster, a, b
    cluster.close()


def asleep_in_futex(native_id: int) -> bool:
    with open(f"/proc/self/task/{native_id}/wchan") as f:
        return "futex" in f.read()


def test_messages_up_to_3_quarters_of_the_lane_take_it_and_stay_in_order_with_larger_ones_on_the_stream(shm_pair):
    _, a, b = shm_pair
    before, quarter = a.lane_messages_sent, a.options.shm_lane_bytes // 4
    # In one record up to a quarter of the lane, in pieces up to 3/4 of it, larger ones on the stream.
    sizes = [8, quarter + 1, 16, 3 * quarter + 1, 4096, 1, quarter // 2]
    for i, n in enumerate(sizes):
        a.send(np.full(n, i, np.uint8), dst=1, tag=3)
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(b.recv(0, tag=3), np.full(n, i, np.uint8))
    assert a.lane_messages_sent - before == 6


@pytest.mark.parametrize("posted_first", [True, False], ids=["posted-first", "sent-first"])
def test_a_message_in_pieces_reaches_a_buffer_and_a_reduction_whole(shm_pair, posted_first):
    _, a, b = shm_pair
    n = a.options.shm_lane_bytes * 3 // 8 // 8  # float64: 3/8 of the lane each, in pieces
    values = np.random.default_rng(3).standard_normal(n)
    out, acc = np.zeros(n), np.ones(n)
    before = a.lane_messages_sent
    if posted_first:
        copied = b.irecv(0, tag=20, out=out)
        reduced = b.irecv(0, tag=21, sink=ReduceSink(1, acc, np.add))
    a.send(values, dst=1, tag=20)
    a.send(values, dst=1, tag=21)
    if not posted_first:
        copied = b.irecv(0, tag=20, out=out)
        reduced = b.irecv(0, tag=21, sink=ReduceSink(1, acc, np.add))
    copied.wait(timeout=10)
    reduced.wait(timeout=10)
    assert a.lane_messages_sent - before == 2
    np.testing.assert_array_equal(out, values)
    np.testing.assert_array_equal(acc, values + 1.0)


def test_a_message_whose_pieces_stop_coming_fails_with_its_sender(shm_pair):
    _, a, b = shm_pair
    lane = a._streams[1]._lane
    header = peer_pb2.MessageHeader(channel=0, tag=22, sequence=0, nbytes=3 * lanes.piece_bytes(lane.capacity))
    first = np.zeros(lanes.piece_bytes(lane.capacity), np.uint8)
    with lane._lock:  # the first piece only, as from a sender that died while writing the rest
        lane._write_record(
            lane._record_sizes(header.ByteSize(), 3 * first.nbytes)[0], header.SerializeToString(), first.data
        )
    lane.ring()
    request = b.irecv(0, tag=22, out=np.zeros(3 * first.nbytes, np.uint8))
    with pytest.raises(CollectiveTimeoutError):
        request.wait(timeout=0.3)  # the first piece came, the rest never does
    b.peer_failed(0, "its stream broke")
    with pytest.raises(PeerFailureError, match="its stream broke"):
        request.wait(timeout=5)


def test_a_receive_asleep_on_the_lane_wakes_for_its_message(shm_pair):
    _, a, b = shm_pair
    got, ids = [], []

    def receive():
        ids.append(threading.get_native_id())
        got.append((b.recv(0, tag=4), time.monotonic()))

    receiver = threading.Thread(target=receive)
    receiver.start()
    wait_for(lambda: ids and asleep_in_futex(ids[0]), "the receiver sleeps on the lane's doorbell")
    sent = time.monotonic()
    a.send(np.arange(10), dst=1, tag=4)
    receiver.join(timeout=10)
    np.testing.assert_array_equal(got[0][0], np.arange(10))
    assert got[0][1] - sent < 1.0


def test_a_receive_asleep_on_the_lane_fails_at_once_when_its_peer_fails(shm_pair):
    _, _, b = shm_pair
    outcome, ids = [], []

    def receive():
        ids.append(threading.get_native_id())
        try:
            b.recv(0, tag=5)
        except PeerFailureError as e:
            outcome.append((e, time.monotonic()))

    receiver = threading.Thread(target=receive)
    receiver.start()
    wait_for(lambda: ids and asleep_in_futex(ids[0]), "the receiver sleeps on the lane's doorbell")
    failed = time.monotonic()
    b.peer_failed(0, "its stream broke")
    receiver.join(timeout=10)
    assert outcome and "its stream broke" in str(outcome[0][0]) and outcome[0][1] - failed < 1.0


def test_a_receive_on_the_lane_times_out_and_withdraws(shm_pair):
    _, a, b = shm_pair
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError):
        b.recv(0, tag=6, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    a.send(np.array([7]), dst=1, tag=6)  # the withdrawn receive's message goes to the next one
    np.testing.assert_array_equal(b.recv(0, tag=6), [7])


def test_messages_in_the_lane_still_arrive_when_their_sender_leaves_right_after(shm_pair):
    cluster, a, b = shm_pair
    for i in range(50):
        a.send(np.full(100, i), dst=1, tag=8)
    a.close(timeout=5)  # its goodbye travels on the stream, after the messages it left in the lane
    for i in range(50):
        np.testing.assert_array_equal(b.recv(0, tag=8), np.full(100, i))


def test_a_receive_polled_with_done_completes_from_the_lane(shm_pair):
    _, a, b = shm_pair
    request = b.irecv(0, tag=9)
    a.send(np.arange(5), dst=1, tag=9)
    deadline = time.monotonic() + 5
    while not request.done():  # only polled: nobody waits, the poll must read the lane
        assert time.monotonic() < deadline, "done() never saw the message in the lane"
    np.testing.assert_array_equal(request.wait(timeout=0), np.arange(5))


def test_a_receive_into_a_buffer_reads_its_message_from_the_lane_in_the_callers_thread(shm_pair, monkeypatch):
    _, a, b = shm_pair
    posted = []
    real_post = b.mailbox.post_reserved
    monkeypatch.setattr(b.mailbox, "post_reserved", lambda key, sink: (posted.append(key), real_post(key, sink))[1])
    received = b.messages_received
    out = np.zeros(100)
    request = b.irecv(0, tag=10, out=out)
    a.send(np.arange(100.0), dst=1, tag=10)
    assert request.wait(timeout=5) is out and request.wait(timeout=0) is out and request.done()
    np.testing.assert_array_equal(out, np.arange(100.0))
    assert posted == [] and b.messages_received == received + 1  # no mailbox entry, still counted


def test_receives_into_buffers_match_by_tag_and_order_across_the_lane_and_the_stream(shm_pair):
    _, a, b = shm_pair
    quarter = a.options.shm_lane_bytes // 4
    sent = [(tag, np.full(n, i, np.uint8)) for i, (tag, n) in enumerate([(1, 8), (2, quarter + 1), (1, 16), (2, 24)])]
    for tag, array in sent:
        a.send(array, dst=1, tag=tag)
    for tag in (2, 1):  # tag 2 first although tag 1 came first, in send order within a tag
        for _, array in [m for m in sent if m[0] == tag]:
            np.testing.assert_array_equal(b.recv(0, tag=tag, out=np.zeros_like(array)), array)


def test_a_receive_into_a_buffer_gets_its_message_when_it_comes_by_the_stream(shm_pair):
    _, a, b = shm_pair
    before, filler = a.lane_messages_sent, np.zeros(4096, np.uint8)
    sent = 0
    while a.lane_messages_sent - before == sent:  # fill the lane: the first refused message takes the stream
        a.send(filler, dst=1, tag=11)
        sent += 1
    request = b.irecv(0, tag=11, out=np.zeros(4096, np.uint8))
    a.send(np.arange(12), dst=1, tag=12)  # the lane is still full: on the stream too
    np.testing.assert_array_equal(b.recv(0, tag=12, out=np.zeros(12, np.int64)), np.arange(12))
    request.wait(timeout=5)
    for _ in range(sent - 1):
        b.recv(0, tag=11, out=np.zeros(4096, np.uint8))


def test_a_receive_into_a_buffer_of_the_wrong_size_raises_mismatch_every_time_it_is_waited_for(shm_pair):
    _, a, b = shm_pair
    request = b.irecv(0, tag=13, out=np.zeros(3))
    a.send(np.zeros(4), dst=1, tag=13)
    for _ in range(2):
        with pytest.raises(CollectiveMismatchError, match="holds 32 bytes"):
            request.wait(timeout=5)
    a.send(np.ones(3), dst=1, tag=13)  # the next message goes to the next receive
    np.testing.assert_array_equal(b.recv(0, tag=13, out=np.zeros(3)), np.ones(3))


def test_a_cancelled_receive_into_a_buffer_leaves_its_message_to_the_next_receive(shm_pair):
    _, a, b = shm_pair
    assert b.irecv(0, tag=14, out=np.zeros(2)).cancel()
    a.send(np.array([5.0, 6.0]), dst=1, tag=14)
    np.testing.assert_array_equal(b.recv(0, tag=14, out=np.zeros(2)), [5.0, 6.0])


def test_a_receive_into_a_buffer_polled_with_done_completes(shm_pair):
    _, a, b = shm_pair
    out = np.zeros(5)
    request = b.irecv(0, tag=15, out=out)
    a.send(np.arange(5.0), dst=1, tag=15)
    deadline = time.monotonic() + 5
    while not request.done():  # only polled: nobody waits
        assert time.monotonic() < deadline, "done() never saw the message"
    assert request.wait(timeout=0) is out
    np.testing.assert_array_equal(out, np.arange(5.0))


def test_threads_receiving_different_tags_from_one_lane_each_get_theirs(shm_pair):
    _, a, b = shm_pair
    results = {}

    def receive(tag):
        results[tag] = [b.recv(0, tag=tag, out=np.zeros(1))[0] for _ in range(200)]

    threads = [threading.Thread(target=receive, args=(tag,)) for tag in (20, 21)]
    for thread in threads:
        thread.start()
    for i in range(200):
        for tag in (20, 21):
            a.send(np.array([tag * 1000.0 + i]), dst=1, tag=tag)
    for thread in threads:
        thread.join(timeout=30)
    assert results == {tag: [tag * 1000.0 + i for i in range(200)] for tag in (20, 21)}


def test_a_send_into_the_lane_has_succeeded_when_isend_returns_and_a_collective_keeps_only_the_others(shm_pair):
    _, a, b = shm_pair
    sent = a.isend(np.arange(10), dst=1, tag=30)
    pending = b.irecv(0, tag=31)
    assert sent.succeeded() and not pending.succeeded()
    failed = b.irecv(0, tag=32)
    failed.abandon(PeerFailureError("gone", peer_rank=0))
    assert failed.done() and not failed.succeeded()
    call = CollectiveCall(a, peer_pb2.CollectiveDescriptor(op="test"), time.monotonic() + 10)
    call.send(np.arange(10), 1)
    assert call.sends == []  # in the lane: nothing left to wait for
    call.send(np.zeros(a.options.shm_lane_bytes, np.uint8), 1)  # larger than a lane takes: the stream
    assert len(call.sends) == 1
    call.finish_sends()
    np.testing.assert_array_equal(b.recv(0, tag=30), np.arange(10))


@pytest.fixture
def socket_pair():
    cluster = ThreadCluster(2, transport_options("data-socket", timeout_s=10))
    a, b = p2p(cluster, 0), p2p(cluster, 1)
    a.send(np.zeros(16), dst=1)  # opens the stream; the messages after it go on its data socket
    b.recv(0)
    wait_for(lambda: a.data_socket_peers == [1] and 0 in b._sockets, "the stream moved to its data socket")
    yield cluster, a, b
    cluster.close()


def _threads_reading_headers(monkeypatch) -> list:
    """The names of the threads that read each message header from now on, in order (each header is
    observed once, whether it is handed over or read straight into its receive's buffer)."""
    readers = []
    observe = _InboundStream.observe

    def recorded_observe(self, header):
        readers.append(threading.current_thread().name)
        return observe(self, header)

    monkeypatch.setattr(_InboundStream, "observe", recorded_observe)
    return readers


def test_over_a_data_socket_the_sender_writes_and_the_waiting_receiver_reads_in_their_own_threads(
    socket_pair, monkeypatch
):
    _, a, b = socket_pair
    # The receive reads the socket itself for its whole timeout, not only for spin_us (200 us): a send
    # that comes later, on a loaded machine, finds it posted, and the stream's thread may read it then.
    sockets = b._sockets
    monkeypatch.setattr(
        b, "_take_from_socket", lambda key, sink, timeout: sockets[key[0]].take_from_socket(key, sink, timeout, False)
    )
    writers, readers = [], _threads_reading_headers(monkeypatch)
    send_frame = FrameSocket.send_frame

    def recorded_send_frame(self, *args):
        writers.append(threading.current_thread().name)
        return send_frame(self, *args)

    monkeypatch.setattr(FrameSocket, "send_frame", recorded_send_frame)
    received = {}
    receiving = threading.Thread(target=lambda: received.update(array=b.recv(0, tag=5, timeout=10)), name="receiving")
    receiving.start()
    try:
        wait_for(lambda: b._sockets[0].socket._reader is not None, "the receive reading the socket")
        a.send(np.arange(1000.0), dst=1, tag=5)
    finally:
        receiving.join(timeout=10)
    np.testing.assert_array_equal(received["array"], np.arange(1000.0))
    assert writers == [threading.current_thread().name] and readers == ["receiving"]


def test_a_receive_that_finds_the_socket_taken_for_a_moment_reads_it_itself_soon_after(socket_pair, monkeypatch):
    # The stream's thread holds the socket for a moment (it looked for something to read) just as a
    # receive wants it, then leaves it to waiting threads and watches only for their news (the readers'
    # grace, held here until the test ends). The message that comes next is read by nobody until the
    # receive looks again: soon, not after a slice of its wait (made a minute here, as the sweep).
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    monkeypatch.setattr(p2p_module, "_NO_LANE_SLICE_S", 60.0)
    monkeypatch.setattr(p2p_module, "SWEEP_S", 60.0)
    in_grace, done = threading.Event(), threading.Event()
    wait_for_something = SocketFrames._wait_for_something

    def watching_only_for_news(self):
        if done.is_set():
            return wait_for_something(self)
        in_grace.set()
        self._socket.wait_until_woken(60.0, self._wake_server)
        return False

    refusals = []
    read_while = SocketFrames.read_while

    def recorded_read_while(self, *args, **kwargs):
        read = read_while(self, *args, **kwargs)
        if not read:
            refusals.append(threading.current_thread().name)
        return read

    monkeypatch.setattr(SocketFrames, "_wait_for_something", watching_only_for_news)
    monkeypatch.setattr(SocketFrames, "read_while", recorded_read_while)
    frames._wake(server=True)  # out of the wait it is in, into the one above
    wait_for(in_grace.is_set, "the stream's thread watching only for news")
    outcome = {}

    def receive():
        try:
            outcome["array"] = b.recv(0, tag=7, timeout=5)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    receiving = threading.Thread(target=receive, name="receiving", daemon=True)
    frames._reading.acquire()  # as the stream's thread does while it looks
    try:
        receiving.start()
        wait_for(lambda: len(refusals) >= 2, "the receive's direct take and its posted wait refused the socket")
    finally:
        frames._reading.release()
    try:
        a.send(np.arange(10.0), dst=1, tag=7)
        receiving.join(timeout=10)
    finally:
        done.set()
        frames._wake(server=True)
    assert "error" not in outcome, f"the receive failed: {outcome.get('error')!r}"
    np.testing.assert_array_equal(outcome["array"], np.arange(10.0))


def test_the_stream_thread_woken_by_a_message_leaves_it_to_the_thread_that_just_read_the_socket(
    socket_pair, monkeypatch
):
    # After a quiet spell the stream's thread watches the socket again, and the first message of a
    # step wakes it as the waiting thread reads it. The next message is that thread's to read too:
    # taken by the stream's thread it would be handed over (a thread hand-off per message).
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    watching, woken_by_a_message = threading.Event(), threading.Event()
    waiting_again, done = threading.Event(), threading.Event()
    wait_for_something = SocketFrames._wait_for_something

    def woken_once(self):
        if done.is_set():
            return wait_for_something(self)
        if not woken_by_a_message.is_set():
            watching.set()
            woken_by_a_message.wait(30)
            inbound._drain(self._wake_server)  # the test's wake that brought it here, if still pending
            return True  # as poll says when a message came (not its eventfd)
        waiting_again.set()
        self._socket.wait_until_woken(60.0, self._wake_server)
        return False

    readers = _threads_reading_headers(monkeypatch)
    monkeypatch.setattr(SocketFrames, "_wait_for_something", woken_once)
    frames._wake(server=True)  # out of the wait it is in, into the one above
    try:
        wait_for(watching.is_set, "the stream's thread watching the socket")
        a.send(np.arange(10.0), dst=1, tag=8)  # in the socket, unread
        wait_for(lambda: frames._socket.wait_readable(0), "the message in the socket")
        frames._last_read = time.monotonic()  # a waiting thread has just read the socket
        woken_by_a_message.set()
        wait_for(waiting_again.is_set, "the stream's thread waiting again")
        received = {}
        receive = lambda: received.update(array=b.recv(0, tag=8, timeout=10))  # noqa: E731
        receiving = threading.Thread(target=receive, name="receiving")
        receiving.start()
        receiving.join(timeout=10)
    finally:
        done.set()
        frames._wake(server=True)
    np.testing.assert_array_equal(received["array"], np.arange(10.0))
    assert readers == ["receiving"]


def _receiving(b, tag, results, name):
    """A thread named ``name`` receiving ``tag`` from rank 0 into ``results[name]`` (the error if any)."""

    def receive():
        try:
            results[name] = b.recv(0, tag=tag, timeout=10)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[name] = e

    thread = threading.Thread(target=receive, name=name, daemon=True)
    thread.start()
    return thread


def _receives_read_in_their_posted_waits(monkeypatch, b) -> None:
    """No direct takes on ``b`` (a receive reads the socket in its posted wait, as long as it waits),
    and the stream thread's grace and the callers' sweeps made a minute."""
    monkeypatch.setattr(p2p_module, "SWEEP_S", 60.0)
    monkeypatch.setattr(inbound, "_READERS_GRACE_S", 60.0)
    monkeypatch.setattr(b, "_direct_take", lambda src, sink: None)


def _looking_again_after_a_minute(monkeypatch):
    """Receives started from now on, turned away from a socket, look again only after a minute (as
    the stream thread's grace in these tests): only a hand-over gets them their message soon.
    Returns a function that makes receives started after it look again soon."""
    saved = {name: getattr(p2p_module, name) for name in ("_REFUSED_FIRST_RETRY_S", "_NO_LANE_SLICE_S")}
    for name in saved:
        monkeypatch.setattr(p2p_module, name, 60.0)
    return lambda: [setattr(p2p_module, name, value) for name, value in saved.items()]


def test_a_thread_turned_away_from_the_socket_gets_its_message_after_the_reader_leaves(socket_pair, monkeypatch):
    # Thread B is turned away while thread A reads and waits on its receive (its looks again made a
    # minute apart here, as the stream thread's grace): A, leaving, hands the socket to the stream
    # thread, which reads B's message when it comes.
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    monkeypatch.setattr(p2p_module, "SWEEP_S", 60.0)
    monkeypatch.setattr(inbound, "_READERS_GRACE_S", 60.0)
    monkeypatch.setattr(b, "_direct_take", lambda src, sink: None)  # every receive reads in its posted wait
    readers, results = _threads_reading_headers(monkeypatch), {}
    first = _receiving(b, 1, results, "A")
    wait_for(lambda: frames._reader == first.ident, "A reading the socket")
    _looking_again_after_a_minute(monkeypatch)  # B, from here on
    second = _receiving(b, 2, results, "B")
    wait_for(lambda: second.ident in frames._refused, "B turned away")
    hand_overs = frames._hand_overs
    a.send(np.arange(3.0), dst=1, tag=1)
    first.join(timeout=10)
    wait_for(lambda: frames._hand_overs > hand_overs, "A handing the socket over as it leaves")
    a.send(np.arange(4.0), dst=1, tag=2)
    second.join(timeout=10)
    np.testing.assert_array_equal(results["A"], np.arange(3.0))
    np.testing.assert_array_equal(results["B"], np.arange(4.0))
    assert readers[0] == "A" and readers[1] not in ("A", "B")  # B's message: the stream thread's
    assert frames._hand_overs - hand_overs == 1  # once: the stream thread did not go round handing over


def test_a_reader_that_ends_a_hand_over_hands_it_over_again_for_a_thread_still_waiting(socket_pair, monkeypatch):
    # A hands the socket over for B as it leaves; C then takes it and reads its own message, which
    # ends that hand-over: leaving, C hands it over again, since B still waits.
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    _receives_read_in_their_posted_waits(monkeypatch, b)
    readers, results = _threads_reading_headers(monkeypatch), {}
    first = _receiving(b, 1, results, "A")
    wait_for(lambda: frames._reader == first.ident, "A reading the socket")
    restore = _looking_again_after_a_minute(monkeypatch)  # B, from here on
    second = _receiving(b, 2, results, "B")
    wait_for(lambda: second.ident in frames._refused, "B turned away")
    a.send(np.arange(3.0), dst=1, tag=1)
    first.join(timeout=10)
    restore()  # C looks again soon, as every receive does
    third = _receiving(b, 3, results, "C")
    wait_for(lambda: frames._reader == third.ident, "C reading the socket")
    a.send(np.arange(6.0), dst=1, tag=3)
    third.join(timeout=10)
    a.send(np.arange(4.0), dst=1, tag=2)
    second.join(timeout=10)
    np.testing.assert_array_equal(results["B"], np.arange(4.0))  # not after a minute's grace or retry
    assert readers[:2] == ["A", "C"] and readers[2] not in ("A", "B", "C")


def test_a_thread_turned_away_just_as_the_reader_leaves_takes_the_socket_itself(socket_pair, monkeypatch):
    # B is turned away while A reads, but says so only after A, leaving, looked for threads turned
    # away: B then looks once more and reads its message itself, or, if the stream thread took the
    # socket meanwhile, that thread reads it for B (it looks for threads turned away when it lets go).
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    _receives_read_in_their_posted_waits(monkeypatch, b)
    turned_away, looked = threading.Event(), threading.Event()

    class Refusals(dict):
        def __setitem__(self, thread, waiting):
            if threading.current_thread().name == "B":
                turned_away.set()
                looked.wait(10)  # says so only after A looked
            super().__setitem__(thread, waiting)

    take_refused = SocketFrames._take_refused

    def looking(self):
        found = take_refused(self)
        if threading.current_thread().name == "A":
            looked.set()
        return found

    monkeypatch.setattr(SocketFrames, "_take_refused", looking)
    readers, results = _threads_reading_headers(monkeypatch), {}
    first = _receiving(b, 1, results, "A")
    wait_for(lambda: frames._reader == first.ident, "A reading the socket")
    frames._refused = Refusals()  # now: one turned away before (A itself) may have been taken already
    _looking_again_after_a_minute(monkeypatch)  # B, from here on
    second = _receiving(b, 2, results, "B")
    assert turned_away.wait(10)
    a.send(np.arange(3.0), dst=1, tag=1)
    first.join(timeout=10)
    a.send(np.arange(4.0), dst=1, tag=2)
    second.join(timeout=10)
    np.testing.assert_array_equal(results["B"], np.arange(4.0))  # not after a minute's grace or retry
    assert readers[0] == "A" and len(readers) == 2


def test_a_hand_over_to_the_stream_thread_during_a_read_outlasts_the_read(socket_pair, monkeypatch):
    # A thread about to block writing hands the socket to the stream thread (the peer may be blocked
    # writing to us) while another thread reads it: the hand-over stands when that read ends, and a
    # message nobody waits for is read at once, not after the readers' grace (a minute here).
    _, a, b = socket_pair
    frames = b._sockets[0].socket
    monkeypatch.setattr(inbound, "_READERS_GRACE_S", 60.0)
    monkeypatch.setattr(b, "_direct_take", lambda src, sink: None)  # T holds the socket until its message
    readers, results = _threads_reading_headers(monkeypatch), {}
    reading = _receiving(b, 1, results, "T")
    wait_for(lambda: frames._reader == reading.ident, "T reading the socket")
    frames.hand_to_server()
    a.send(np.arange(3.0), dst=1, tag=1)
    reading.join(timeout=10)
    a.send(np.arange(5.0), dst=1, tag=3)  # nobody waits for it
    wait_for(lambda: len(readers) == 2, "the stream thread reading the message nobody waits for")
    assert readers[0] == "T" and readers[1] != "T"
    np.testing.assert_array_equal(b.recv(0, tag=3, timeout=10), np.arange(5.0))


def test_a_receive_reading_a_message_whose_sender_hangs_in_the_middle_fails_when_the_sender_is_declared_failed(
    socket_pair, monkeypatch
):
    _, a, b = socket_pair
    resume = threading.Event()
    send_frame = FrameSocket.send_frame
    readers = _threads_reading_headers(monkeypatch)

    def hanging_send_frame(self, frame, payload=None, on_block=None):  # a quarter of the payload, then it hangs
        send_frame(self, frame, payload[: len(payload) // 4], on_block)
        resume.wait(30)

    monkeypatch.setattr(FrameSocket, "send_frame", hanging_send_frame)
    outcome = {}

    def receive():
        try:
            b.recv(0, tag=6, out=np.zeros(1 << 19), timeout=30)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    sending = threading.Thread(target=lambda: a.isend(np.ones(1 << 19), dst=1, tag=6), daemon=True)
    receiving = threading.Thread(target=receive, name="receiving", daemon=True)
    try:
        receiving.start()
        wait_for(lambda: b._sockets[0].socket._reader is not None, "the receive reading the socket")
        sending.start()
        wait_for(lambda: readers == ["receiving"], "the receive reading the 4 MiB message itself")
        b.peer_failed(0, "hung")
        receiving.join(timeout=5)
        assert not receiving.is_alive(), "the receive is still reading the hung sender's message"
        assert isinstance(outcome.get("error"), PeerFailureError), outcome
    finally:
        resume.set()
        sending.join(timeout=10)
        receiving.join(timeout=10)


def _sent_while_the_receive_reads(monkeypatch, send) -> None:
    """Makes the next receive that reads a data socket itself call ``send()`` once it holds the
    socket (so that no other thread reads what is sent: until then it tries again, as the stream's
    thread may hold the socket a moment), and wait for its message up to 30 s, however slow the
    machine."""
    take_from_socket, sent = _InboundStream.take_from_socket, []

    def taking_until_sent(self, key, sink, seconds, spin):
        give_up = time.monotonic() + 30
        while True:
            taken = take_from_socket(self, key, sink, 30.0, spin)
            if sent or time.monotonic() > give_up:
                return taken

    monkeypatch.setattr(_InboundStream, "take_from_socket", taking_until_sent)
    waiting = _AwaitedOnSocket.waiting

    def sending_once(self):
        if not sent and threading.current_thread() is threading.main_thread():  # not a thread asking for it
            sent.append(send())
        return waiting(self)

    monkeypatch.setattr(_AwaitedOnSocket, "waiting", sending_once)


def _recorded(monkeypatch, cls, name: str) -> list:
    """The tags of the message headers (``deliver``) or keys (``post_reserved``) passed to ``cls.name``."""
    calls, method = [], getattr(cls, name)

    def recording(self, first, second, *rest):
        calls.append(second.tag if name == "deliver" else first[2])
        return method(self, first, second, *rest)

    monkeypatch.setattr(cls, name, recording)
    return calls


def test_a_receive_from_a_data_socket_is_read_by_the_waiting_caller_straight_into_its_buffer(socket_pair, monkeypatch):
    _, a, b = socket_pair
    _sent_while_the_receive_reads(
        monkeypatch, lambda: (a.isend(np.full(4, 7.0), 1, tag=7), a.isend(np.arange(9.0), 1, tag=8))
    )
    delivered, posted = _recorded(monkeypatch, Mailbox, "deliver"), _recorded(monkeypatch, Mailbox, "post_reserved")
    out = np.zeros(9)
    received = b.irecv(0, tag=8, out=out)
    assert not received.succeeded()  # nothing received before it is waited for
    assert received.wait(timeout=10) is out and received.succeeded()
    np.testing.assert_array_equal(out, np.arange(9.0))
    assert delivered == [7] and posted == []  # the other message to the mailbox, this one straight in
    monkeypatch.undo()
    np.testing.assert_array_equal(b.recv(0, tag=7, timeout=10), np.full(4, 7.0))


def test_only_a_message_a_waiting_caller_reads_itself_is_taken_straight_from_the_data_socket(socket_pair):
    _, a, b = socket_pair
    largest = WAITING_THREAD_READS_AT_MOST // 8
    small, large = b.irecv(0, tag=20, out=np.zeros(largest)), b.irecv(0, tag=21, out=np.zeros(largest + 1))
    # The stream's thread reads the large one: a caller spinning for it would hold the GIL it needs.
    assert isinstance(small, _DirectReceive) and not isinstance(large, _DirectReceive)
    a.send(np.ones(largest), dst=1, tag=20)
    a.send(np.ones(largest + 1), dst=1, tag=21)
    assert small.wait(timeout=20).sum() == largest and large.wait(timeout=20).sum() == largest + 1


def test_a_message_on_a_data_socket_that_does_not_fit_the_waiting_receive_fails_it_and_the_stream_goes_on(
    socket_pair, monkeypatch
):
    _, a, b = socket_pair
    _sent_while_the_receive_reads(monkeypatch, lambda: (a.isend(np.zeros(5), 1, tag=3), a.isend(np.ones(4), 1, tag=3)))
    with pytest.raises(CollectiveMismatchError, match="40 bytes"):
        b.recv(0, tag=3, out=np.zeros(4), timeout=10)
    np.testing.assert_array_equal(b.recv(0, tag=3, out=np.zeros(4), timeout=10), np.ones(4))


def test_a_message_that_does_not_fit_the_waiting_receive_is_read_once_and_fails_it(socket_pair, monkeypatch):
    _, a, b = socket_pair
    sockets = b._sockets
    monkeypatch.setattr(  # the receive reads the socket for its whole timeout, as in the test above
        b, "_take_from_socket", lambda key, sink, timeout: sockets[key[0]].take_from_socket(key, sink, timeout, False)
    )
    readers = _threads_reading_headers(monkeypatch)
    outcome: dict = {}

    def receive():
        try:
            outcome["result"] = b.irecv(0, tag=5, sink=ReduceSink(1, np.zeros(4), np.add)).wait(timeout=10)
        except CollectiveMismatchError as e:
            outcome["error"] = e

    receiving = threading.Thread(target=receive, name="receiving")
    receiving.start()
    try:
        wait_for(lambda: b._sockets[0].socket._reader is not None, "the receive reading the socket")
        a.send(np.zeros(3), dst=1, tag=5)  # 24 bytes where 32 are expected
    finally:
        receiving.join(timeout=15)
    assert "24-byte segment where 32 bytes were expected" in str(outcome.get("error")), outcome
    assert readers == ["receiving"]  # its header read once, by the waiting thread, then to the mailbox


@pytest.mark.parametrize("pair", ["shm_pair", "socket_pair"])
def test_a_receive_cancelled_before_its_message_came_has_not_succeeded_and_leaves_it_to_the_next(pair, request):
    _, a, b = request.getfixturevalue(pair)
    cancelled = b.irecv(0, tag=40, out=np.zeros(3))
    assert cancelled.cancel()
    assert cancelled.done() and not cancelled.succeeded()
    with pytest.raises(CommunicationError, match="cancelled"):
        cancelled.wait(timeout=1)
    a.send(np.ones(3), dst=1, tag=40)
    np.testing.assert_array_equal(b.recv(0, tag=40, out=np.zeros(3), timeout=10), np.ones(3))


def test_a_receive_that_may_come_by_a_lane_has_not_succeeded_before_its_message_came(shm_pair):
    _, a, b = shm_pair
    received = b.irecv(0, tag=12, out=np.zeros(3))
    assert not received.succeeded() and not received.done()
    a.send(np.ones(3), dst=1, tag=12)
    received.wait(timeout=10)
    assert received.succeeded()


def test_a_message_the_sender_writes_itself_does_not_wake_the_idle_writer_thread(socket_pair):
    _, a, b = socket_pair
    stream = a._streams[1]
    wakes = []
    notify_all = stream._cond.notify_all
    stream._cond.notify_all = lambda: (wakes.append(threading.current_thread().name), notify_all())[1]
    sent = stream.bytes_sent
    for tag in range(20):
        a.send(np.full(100, tag, np.float64), dst=1, tag=tag)
        np.testing.assert_array_equal(b.recv(0, tag=tag, timeout=10), np.full(100, tag, np.float64))
    assert stream.bytes_sent - sent == 20 * 800
    assert wakes == []  # the writer thread sleeps through them: it has nothing to write


@pytest.mark.parametrize("transport", ["shared-memory", "data-socket"])
@pytest.mark.parametrize("spin_yield", [True, False])
def test_a_spinning_receive_offers_its_core_between_looks_only_when_told(transport, spin_yield, monkeypatch):
    options = transport_options(transport, timeout_s=10, spin_us=2000, spin_yield=spin_yield)
    with ThreadCluster(2, options) as cluster:
        a, b = p2p(cluster, 0), p2p(cluster, 1)
        a.send(np.zeros(16), dst=1)  # opens the stream: its lane or data socket is in use from here on
        b.recv(0)
        wait_for(
            lambda: (a.shared_memory_peers if transport == "shared-memory" else a.data_socket_peers) == [1], "path"
        )
        yields = []
        monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
        with pytest.raises(CollectiveTimeoutError):
            b.recv(0, tag=9, timeout=0.05)  # nothing comes: it spins 2 ms, then sleeps
        monkeypatch.undo()
        assert bool(yields) == spin_yield, len(yields)


def test_a_sender_interrupted_in_the_middle_of_a_message_breaks_its_stream(socket_pair, monkeypatch):
    _, a, b = socket_pair
    write_raw = DataSocketPath.write_raw

    def interrupted(self, header, payload, on_block=None):
        write_raw(self, header, payload[: len(payload) // 2], on_block)  # half of it is on the wire
        raise KeyboardInterrupt

    monkeypatch.setattr(DataSocketPath, "write_raw", interrupted)
    with pytest.raises(KeyboardInterrupt):
        a.isend(np.ones(1000), dst=1, tag=7)
    monkeypatch.undo()
    with pytest.raises(PeerFailureError, match="interrupted in the middle of a message"):
        a.isend(np.ones(10), dst=1, tag=8)  # not written after half a message
    with pytest.raises((PeerFailureError, CollectiveTimeoutError)):
        b.recv(0, tag=7, timeout=5)  # the half message never completes a receive
