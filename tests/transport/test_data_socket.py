"""Direct data sockets: tickets, framing, moving a stream off gRPC, falling back to it."""

import secrets
import socket
import threading
import time

import numpy as np
import pytest

from elasticdl_strategy.errors import ConfigError, PeerFailureError
from elasticdl_strategy.transport import data_socket, outbound
from elasticdl_strategy.transport.data_socket import TICKET_BYTES, DataSocketListener, FrameSocket, connect, host_of
from elasticdl_strategy.transport.options import TransportOptions
from tests.cluster import ThreadCluster, transport_options

MAX_FRAME = 1 << 20


@pytest.fixture
def listener():
    made = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=MAX_FRAME, ticket_timeout_s=2.0)
    yield made
    made.close()


def _closed_at_once(port: int) -> bool:
    """Whether a new connection to ``port`` is closed by the listener within 5 s, long before
    any ticket timeout of these tests."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        started = time.monotonic()
        return _closed_by_peer(sock) and time.monotonic() - started < 5.0


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (reads EOF or a reset within 5 s)."""
    sock.settimeout(5.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ---- the listener and its tickets -------------------------------------------------------------


def test_a_connection_presenting_its_ticket_is_handed_to_the_stream_and_carries_frames(listener):
    ticket = listener.expect()
    sender = connect("127.0.0.1", listener.port, ticket, timeout=5.0, keepalive_s=2.0, max_frame=MAX_FRAME)
    receiver = listener.claim(ticket, timeout=5.0)
    try:
        payload = np.arange(300_000, dtype=np.float32)  # larger than the inline bound: written separately
        sender.send_frame(b"header-1", memoryview(payload).cast("B"))
        sender.send_frame(b"header-2", memoryview(b"small"))
        assert receiver.recv_frame() == b"header-1"
        got = np.empty_like(payload)
        receiver.recv_into(memoryview(got).cast("B"))
        np.testing.assert_array_equal(got, payload)
        assert receiver.recv_frame() == b"header-2"
        small = bytearray(5)
        receiver.recv_into(memoryview(small))
        assert bytes(small) == b"small"
    finally:
        sender.close()
        receiver.close()


def test_a_write_that_must_wait_for_room_says_so_first_and_one_that_fits_does_not():
    sender, receiver = (data_socket.FrameSocket(s, MAX_FRAME) for s in socket.socketpair())
    calls = []
    try:
        sender.send_frame(b"small", memoryview(b"fits in the buffers"), on_block=lambda: calls.append("small"))
        assert calls == [] and receiver.recv_frame() == b"small"
        receiver.recv_into(memoryview(bytearray(19)))
        payload = np.arange(4 << 20, dtype=np.uint8)  # 4 MiB: more than a socket pair's buffers hold
        got = np.zeros_like(payload)

        def read_once_blocked():  # only once the writer said it waits: nothing reads before
            calls.append("large")
            assert receiver.recv_frame() == b"large"
            reader.start()

        reader = threading.Thread(target=lambda: receiver.recv_into(memoryview(got)), daemon=True)
        sender.send_frame(b"large", memoryview(payload), on_block=read_once_blocked)
        reader.join(timeout=10)
        assert calls == ["large"]
        np.testing.assert_array_equal(got, payload)
    finally:
        sender.close()
        receiver.close()


class _CountingSocket:
    """A socket that counts the writes made through it (each one a system call)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.writes = 0

    def send(self, data, flags=0):
        self.writes += 1
        return self._sock.send(data, flags)

    def sendall(self, data):
        self.writes += 1
        return self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_small_message_that_fits_the_buffers_takes_one_write():
    sender, receiver = (data_socket.FrameSocket(s, MAX_FRAME) for s in socket.socketpair())
    counting = sender._sock = _CountingSocket(sender._sock)
    try:
        sender.send_frame(b"header", memoryview(b"payload"), on_block=lambda: None)
        assert counting.writes == 1
        assert receiver.recv_frame() == b"header"
    finally:
        sender._sock = counting._sock
        sender.close()
        receiver.close()


def test_a_connection_without_a_valid_ticket_is_closed_and_changes_nothing(listener):
    ticket = listener.expect()
    for first_bytes in (secrets.token_bytes(TICKET_BYTES), ticket[:-1]):  # wrong, and too short then EOF
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) as stranger:
            stranger.sendall(first_bytes)
            if len(first_bytes) < TICKET_BYTES:
                stranger.shutdown(socket.SHUT_WR)
            assert _closed_by_peer(stranger)
    # The real ticket is still good.
    sender = connect("127.0.0.1", listener.port, ticket, timeout=5.0, keepalive_s=2.0, max_frame=MAX_FRAME)
    listener.claim(ticket, timeout=5.0).close()
    sender.close()


def test_a_sender_learns_at_once_that_its_ticket_was_refused(listener):
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="refused the data connection"):
        connect("127.0.0.1", listener.port, secrets.token_bytes(TICKET_BYTES), 5.0, 2.0, MAX_FRAME)
    assert time.monotonic() - started < 2.0  # so it stays on gRPC instead of attaching a dead socket


def test_a_ticket_is_good_for_one_connection_only(listener):
    ticket = listener.expect()
    first = connect("127.0.0.1", listener.port, ticket, timeout=5.0, keepalive_s=2.0, max_frame=MAX_FRAME)
    listener.claim(ticket, timeout=5.0).close()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) as again:
        again.sendall(ticket)
        assert _closed_by_peer(again)
    first.close()


def test_a_connection_that_never_arrives_times_out_with_a_typed_error(listener):
    ticket = listener.expect()
    with pytest.raises(TimeoutError, match="within 0.2s"):
        listener.claim(ticket, timeout=0.2)
    listener.discard(ticket)


def test_a_frame_length_beyond_the_limit_is_an_error_not_an_allocation(listener):
    ticket = listener.expect()
    raw = socket.create_connection(("127.0.0.1", listener.port), timeout=5.0)
    raw.sendall(ticket + (MAX_FRAME + 1).to_bytes(4, "little"))
    receiver = listener.claim(ticket, timeout=5.0)
    try:
        with pytest.raises(ValueError, match=f"at most {MAX_FRAME}"):
            receiver.recv_frame()
    finally:
        receiver.close()
        raw.close()


def test_hosts_are_taken_from_peer_addresses():
    assert host_of("10.0.0.3:4000") == "10.0.0.3"
    assert host_of("[::1]:4000") == "::1"
    assert host_of("worker-2.job.svc:50052") == "worker-2.job.svc"


# ---- streams on data sockets ------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_streams_move_to_data_sockets_and_give_the_same_bits_as_grpc(n):
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal(300_001).astype(np.float32) for _ in range(n)]  # several pieces, uneven
    results = {}
    hosts = [f"host-{r}" for r in range(n)]  # no host segment to agree on (a message to every peer)
    for transport in ("data-socket", "grpc"):
        with ThreadCluster(n, transport_options(transport), hosts=hosts) as cluster:
            results[transport] = cluster.run(lambda c: c.allreduce(inputs[c.rank].copy(), op="sum"))
            for comm in cluster.communicators:
                expected = [(comm.rank + 1) % n] if transport == "data-socket" else []  # the ring's right neighbour
                assert comm.p2p.data_socket_peers == expected
    for r in range(n):
        np.testing.assert_array_equal(results["data-socket"][r], results["grpc"][r])
    np.testing.assert_allclose(results["grpc"][0], np.sum(inputs, axis=0), rtol=1e-5, atol=1e-5)


def test_every_message_kind_crosses_a_data_socket_in_order():
    options = transport_options("data-socket", inline_threshold=1024)
    messages = [
        np.zeros(0, np.float32),  # empty
        np.arange(10, dtype=np.int64),  # inline in the header
        np.arange(3 << 20, dtype=np.uint8),  # three pieces
        np.arange((1 << 18) + 3, dtype=np.float64),  # uneven last piece
    ]
    with ThreadCluster(2, options) as cluster:
        sender, receiver = (c.p2p for c in cluster.communicators)
        for tag, m in enumerate(messages):
            sender.isend(m, dst=1, tag=tag).wait(timeout=20)  # arrive before their receives: buffered
        assert sender.data_socket_peers == [1]
        for tag in reversed(range(len(messages))):
            got = receiver.recv(src=0, tag=tag, timeout=20)
            assert got.dtype == messages[tag].dtype
            np.testing.assert_array_equal(got, messages[tag])


def test_a_sender_that_cannot_connect_keeps_the_stream_on_grpc(monkeypatch):
    def refuse(*args, **kwargs):
        raise ConnectionRefusedError("refused for the test")

    monkeypatch.setattr(outbound, "connect", refuse)
    with ThreadCluster(2, transport_options("data-socket")) as cluster:
        data = np.arange(500_000, dtype=np.float32)
        results = cluster.run(lambda c: c.allreduce(data * (c.rank + 1)))
        for c, result in zip(cluster.communicators, results, strict=True):
            np.testing.assert_array_equal(result, data * 3)
            assert c.p2p.data_socket_peers == []


def test_a_receiver_without_data_sockets_keeps_the_stream_on_grpc():
    options = [transport_options("data-socket"), transport_options("grpc")]  # rank 1 accepts none
    with ThreadCluster(2, options) as cluster:
        assert cluster.servers[0].data_sockets is not None and cluster.servers[1].data_sockets is None
        data = np.arange(200_000, dtype=np.float32)
        for result in cluster.run(lambda c: c.allreduce(data * (c.rank + 1))):
            np.testing.assert_array_equal(result, data * 3)
        assert cluster.communicators[0].p2p.data_socket_peers == []  # asked, refused
        assert cluster.communicators[1].p2p.data_socket_peers == []  # never asked


# ---- settings ---------------------------------------------------------------------------------


def test_data_socket_settings_are_validated():
    with pytest.raises(ConfigError, match="EDL_DATA_SOCKET='yes' must be 0 or 1"):
        TransportOptions.from_env({"EDL_DATA_SOCKET": "yes"})
    assert TransportOptions.from_env({"EDL_DATA_SOCKET": "0"}).data_socket is False
    assert TransportOptions.from_env({}).data_socket is True


def test_a_data_port_in_use_is_a_one_line_config_error(listener):
    with pytest.raises(ConfigError, match=f"cannot listen for data sockets on 127.0.0.1:{listener.port}"):
        DataSocketListener("127.0.0.1", listener.port, keepalive_s=2.0, max_frame=MAX_FRAME)


def test_a_receiver_that_stops_its_server_ends_the_streams_on_its_data_sockets():
    with ThreadCluster(2, transport_options("data-socket")) as cluster:
        sender = cluster.communicators[0].p2p
        cluster.run(lambda c: c.allreduce(np.ones(300_000, np.float32)))  # both streams on data sockets
        assert sender.data_socket_peers == [1]
        cluster.servers[1].stop(grace=0.2)  # its handler, blocked reading the socket, must let go
        deadline = time.monotonic() + 5.0
        with pytest.raises(PeerFailureError, match="rank 1"):
            while time.monotonic() < deadline:
                sender.isend(np.ones(1000, np.float32), dst=1).wait(timeout=5.0)


def test_connections_that_never_present_a_ticket_cannot_pile_up(monkeypatch):
    monkeypatch.setattr(data_socket, "MAX_PENDING_CONNECTIONS", 2)
    listener = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=MAX_FRAME, ticket_timeout_s=30.0)
    listener.expect()  # a ticket is out: connections are let in to present it
    silent = [socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) for _ in range(2)]
    try:
        assert _closed_at_once(listener.port)  # the third: not after the 30 s ticket timeout
        for s in silent:
            s.close()  # their admissions end (EOF) and free the slots
        ticket = listener.expect()
        deadline = time.monotonic() + 5.0
        while True:  # the slots free as the silent connections' EOFs are read
            try:
                sender = connect("127.0.0.1", listener.port, ticket, 5.0, 2.0, MAX_FRAME)
                break
            except ConnectionRefusedError:  # turned away, and told so: the stream stays on gRPC
                assert time.monotonic() < deadline, "the admission slots were never freed"
        listener.claim(ticket, timeout=5.0).close()
        sender.close()
    finally:
        for s in silent:
            s.close()
        listener.close()


def test_a_connection_from_an_address_without_a_ticket_is_closed_at_once():
    listener = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=MAX_FRAME, ticket_timeout_s=30.0)
    try:
        for expected in [[], ["10.9.9.9"]]:  # no ticket at all; a ticket for another address only
            for source in expected:
                listener.expect(source)
            assert _closed_at_once(listener.port)  # not after the 30 s ticket timeout
        ticket = listener.expect("127.0.0.1")
        connect("127.0.0.1", listener.port, ticket, 5.0, 2.0, MAX_FRAME).close()
    finally:
        listener.close()


def test_connections_from_one_address_waiting_for_their_ticket_are_bounded(monkeypatch):
    monkeypatch.setattr(data_socket, "MAX_PENDING_PER_SOURCE", 2)
    listener = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=MAX_FRAME, ticket_timeout_s=30.0)
    listener.expect("127.0.0.1")
    silent = [socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) for _ in range(2)]
    try:
        assert _closed_at_once(listener.port)  # the third
    finally:
        for s in silent:
            s.close()
        listener.close()


def test_a_ticket_dripped_byte_by_byte_misses_the_total_deadline():
    # One byte every 0.1 s: each read is well within the 1 s timeout, the whole ticket is not.
    listener = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=MAX_FRAME, ticket_timeout_s=1.0)
    ticket = listener.expect("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) as drip:
            started = time.monotonic()
            try:
                for byte in ticket:
                    drip.sendall(bytes([byte]))
                    time.sleep(0.1)  # the slow client's pace, not a wait for the server
            except OSError:
                pass  # closed under it
            assert _closed_by_peer(drip)  # never accepted
            assert time.monotonic() - started < 3.0  # the whole ticket would have taken 3.2 s
    finally:
        listener.close()


def test_a_read_interrupted_leaves_the_buffer_empty_not_holding_old_bytes(monkeypatch):
    ends = socket.socketpair()
    sending, receiving = (FrameSocket(s, 1 << 20) for s in ends)
    try:
        sending.send_frame(b"first")
        assert receiving.recv_frame() == b"first"  # the read-ahead buffer read to its end, not at its start
        assert not receiving.buffered()

        def interrupted(view, nbytes):
            raise KeyboardInterrupt

        monkeypatch.setattr(receiving, "_sock", type("Interrupted", (), {"recv_into": staticmethod(interrupted)})())
        with pytest.raises(KeyboardInterrupt):
            receiving.recv_frame()  # the buffer is empty: it reads the socket ahead
        assert not receiving.buffered()
    finally:
        for end in ends:
            end.close()
