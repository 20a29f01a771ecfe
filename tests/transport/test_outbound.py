"""The sending side's life: open, closing, closed, broken; what each means for queued and new
messages, and who is told."""

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from elasticdl_strategy.errors import CommunicatorClosedError, PeerFailureError
from elasticdl_strategy.transport.outbound import OutboundStream, OutgoingMessage
from elasticdl_strategy.transport.peer_link import PeerService
from elasticdl_strategy.transport.protos import peer_pb2

TOKEN = "t" * 32


class Writer:
    def __init__(self, nbytes):
        self.data = bytearray(nbytes)

    def write(self, offset, data, borrowed=False):
        self.data[offset : offset + len(data)] = data

    def target(self, offset, nbytes):
        return None

    def target_done(self):
        pass

    def finish(self):
        pass


class Receiver:
    def __init__(self):
        self.messages = []
        self.closed = threading.Event()
        self.error = self.goodbye = None

    def on_header(self, header):
        self.messages.append(Writer(header.nbytes))
        return self.messages[-1]

    def on_closed(self, error, goodbye):
        self.error, self.goodbye = error, goodbye
        self.closed.set()


class Listener:
    def __init__(self):
        self.receivers = []
        self.admit = threading.Event()  # open_stream waits for it: the stream's hello is not answered until then
        self.admit.set()

    def open_stream(self, hello):
        assert self.admit.wait(30)
        self.receivers.append(Receiver())
        return self.receivers[-1]

    def on_abort(self, request):
        pass


@pytest.fixture
def peer():
    listener = Listener()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((PeerService(listener).generic_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield listener, channel, server
    finally:
        listener.admit.set()
        channel.close()
        server.stop(0)


def _stream(channel, broken, **offers) -> OutboundStream:
    hello = peer_pb2.StreamHello(src_rank=0)
    return OutboundStream(channel, hello, TOKEN, peer_rank=1, on_broken=broken.append, **offers)


def _message(payload: bytes) -> OutgoingMessage:
    header = peer_pb2.MessageHeader(sequence=0, nbytes=len(payload), chunk_size=1 << 16)
    return OutgoingMessage(header, memoryview(payload), 1 << 16)


def test_a_closed_stream_delivers_what_was_queued_then_its_goodbye_and_refuses_more(peer):
    listener, channel, _ = peer
    broken = []
    stream = _stream(channel, broken)
    payloads = [np.full(n, n % 251, np.uint8).tobytes() for n in (10, 200_000)]
    messages = [_message(p) for p in payloads]
    for message in messages:
        stream.submit(message)
    stream.close(timeout=20, goodbye=peer_pb2.Goodbye(reason="done"))
    assert all(m.future.done() and m.future.exception() is None for m in messages)
    receiver = listener.receivers[0]
    assert receiver.closed.wait(20)
    assert (receiver.error, receiver.goodbye.reason) == (None, "done")
    assert [bytes(w.data) for w in receiver.messages] == payloads
    with pytest.raises(CommunicatorClosedError, match="the stream to rank 1 is closed"):
        stream.submit(_message(b"late"))
    assert broken == [] and stream.bytes_sent == sum(map(len, payloads))


def test_a_failed_stream_fails_the_message_waiting_for_the_peers_answer_and_every_later_one(peer):
    listener, channel, _ = peer
    listener.admit.clear()  # the hello offers a data socket; its answer does not come
    broken = []
    stream = _stream(channel, broken, data_host="127.0.0.1")
    waiting = _message(b"x" * 100)
    stream.submit(waiting)
    stream.fail("rank 1 was declared failed")
    with pytest.raises(PeerFailureError, match="rank 0 could not send to rank 1: rank 1 was declared failed"):
        waiting.future.result(timeout=5)  # at once, not after the answer's 10 s
    with pytest.raises(PeerFailureError, match="cannot send to rank 1: rank 1 was declared failed"):
        stream.submit(_message(b"y"))
    stream.fail("a later symptom")
    stream.close(timeout=1)
    assert broken == ["rank 1 was declared failed"]


def test_a_stream_whose_peer_goes_away_reports_it_once_and_refuses_more(peer):
    listener, channel, server = peer
    broken, reported = [], threading.Event()
    hello = peer_pb2.StreamHello(src_rank=0)
    stream = OutboundStream(channel, hello, TOKEN, 1, on_broken=lambda r: (broken.append(r), reported.set()))
    first = _message(b"z" * 10)
    stream.submit(first)
    first.future.result(timeout=20)
    server.stop(0)
    assert reported.wait(20)
    with pytest.raises(PeerFailureError, match="cannot send to rank 1"):
        stream.submit(_message(b"w"))
    stream.close(timeout=1)
    assert len(broken) == 1


def test_a_stream_that_breaks_while_closing_does_not_report_a_failure(peer):
    listener, channel, _ = peer
    listener.admit.clear()  # the peer never answers: close gives up and cancels the call
    broken = []
    stream = _stream(channel, broken, data_host="127.0.0.1")
    queued = _message(b"q")
    stream.submit(queued)
    stream.close(timeout=0.5)
    with pytest.raises(PeerFailureError, match="cancelled"):
        queued.future.result(timeout=5)
    assert broken == []
