"""Optional TLS: a ring over mutually authenticated TLS works, data sockets included; a plaintext
client, or one without a certificate, cannot connect."""

import socket
import ssl
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticdl_strategy.errors import ConfigError, DataSocketClosed
from elasticdl_strategy.transport import frames, inbound
from elasticdl_strategy.transport.data_socket import DataSocketListener, connect
from elasticdl_strategy.transport.options import TLSConfig, TransportOptions
from tests.cluster import ThreadCluster
from tests.conditions import wait_for
from tests.transport.test_inbound import GOODBYE, Receiver, _first_of, _framed, _hold_server_before_its_poll, _receive


def test_ring_over_mutual_tls(tls_files):
    options = TransportOptions(tls=tls_files, timeout_s=20)
    with ThreadCluster(3, options) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(100_000, c.rank, np.float32)))
        for r in results:
            np.testing.assert_array_equal(r, np.full(100_000, 3, np.float32))
        for c in cluster.communicators:  # the payloads went over TLS data sockets (to every peer: direct)
            assert c.p2p.data_socket_peers == [r for r in range(3) if r != c.rank]
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)


def test_a_data_socket_without_tls_or_without_a_client_certificate_is_refused(tls_files):
    listener = DataSocketListener(
        "127.0.0.1", 0, 2.0, 1 << 20, ticket_timeout_s=2.0, tls=tls_files.server_ssl_context()
    )
    try:
        ticket = listener.expect()
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5.0) as plain:
            plain.sendall(ticket)  # the right ticket, but in the clear
            plain.settimeout(5.0)
            try:  # at most a TLS alert, then the server closes (a timeout here fails the test)
                while plain.recv(1024):
                    pass
            except ConnectionResetError:
                pass
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.load_verify_locations(tls_files.ca_file)
        with pytest.raises((OSError, DataSocketClosed)):  # TLS 1.3: the refusal shows on the first read
            connect("127.0.0.1", listener.port, ticket, 5.0, 2.0, 1 << 20, tls=anonymous).recv_frame()
        with pytest.raises(TimeoutError):
            listener.claim(ticket, timeout=0.5)  # neither got through
        ticket = listener.expect()  # the claim above used up the first one
        mutual = connect("127.0.0.1", listener.port, ticket, 5.0, 2.0, 1 << 20, tls=tls_files.client_ssl_context())
        received = listener.claim(ticket, timeout=5.0)
        mutual.send_frame(b"over tls")
        assert received.recv_frame() == b"over tls"
        mutual.close()
        received.close()
    finally:
        listener.close()


def test_missing_tls_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TLSConfig(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))


def _tls_data_socket(tls_files):
    """(sender, receiver): the two ends of a data socket under TLS, set up as a stream sets one up."""
    listener = DataSocketListener(
        "127.0.0.1", 0, 2.0, 1 << 20, ticket_timeout_s=2.0, tls=tls_files.server_ssl_context()
    )
    try:
        ticket = listener.expect()
        sender = connect("127.0.0.1", listener.port, ticket, 5.0, 2.0, 1 << 20, tls=tls_files.client_ssl_context())
        return sender, listener.claim(ticket, timeout=5.0)
    finally:
        listener.close()


def test_a_tls_data_socket_shut_down_mid_message_never_reads_raw_bytes_as_payload(tls_files):
    sender, receiver = _tls_data_socket(tls_files)
    try:
        payload = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)  # 1 MiB, then more queued behind it
        sender.send_frame(b"first", memoryview(payload))
        sender.send_frame(b"second", memoryview(payload[: 512 << 10]))
        assert receiver.recv_frame() == b"first"
        out = np.zeros(len(payload), np.uint8)
        receiver.recv_into(memoryview(out)[: len(out) - (60 << 10)])
        receiver.shutdown()  # what the end of the gRPC call does, mid-message
        try:
            receiver.recv_into(memoryview(out)[len(out) - (60 << 10) :])
        except DataSocketClosed:
            pass  # refused: fine
        else:  # or the rest of what was already decrypted or queued: then it must be the real bytes
            np.testing.assert_array_equal(out, payload)
    finally:
        sender.close()
        receiver.close()


def test_bytes_a_waiting_thread_leaves_decrypted_in_tls_reach_the_server_thread_polling_the_socket(
    monkeypatch, tls_files
):
    # Left in OpenSSL's decrypted record (pending), not in the read-ahead buffer: the socket's poll
    # does not see them either, so the waiting thread that leaves them wakes the server thread.
    monkeypatch.setattr(inbound, "_SERVER_WAIT_SLICE_S", 60.0)
    looked, go_on = _hold_server_before_its_poll(monkeypatch)
    sender, receiving = _tls_data_socket(tls_files)
    receiver = Receiver(offer_target=True)
    outcome: dict = {}

    def serve():
        try:
            outcome["goodbye"], _ = _receive([frames.encode_data_socket_attached()], receiver, attach=lambda: receiving)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    server = threading.Thread(target=serve, name="stream-server", daemon=True)
    server.start()
    try:
        assert receiver.attached.wait(10) and looked.wait(10)
        big = bytes(range(256)) * 80  # 20 KiB: a TLS record of 16 KiB, the rest in one with the next message
        sent = _framed(0, big) + _framed(1, b"nobody waits for this one yet")
        assert receiver.socket.read_while(
            receiver, _first_of(receiver, lambda: sender._sock.sendall(sent)), time.monotonic() + 10
        )
        assert receiver.socket._socket.buffered()
        go_on.set()
        wait_for(lambda: len(receiver.messages) == 2 and receiver.messages[1].finished, "the second delivered")
        assert receiver.delivered_by == [threading.current_thread().name, "stream-server"]
        sender.send_frame(GOODBYE)
    finally:
        go_on.set()
        server.join(10)
        sender.close()
    assert outcome.get("goodbye") is not None and outcome["goodbye"].reason == "done", outcome
