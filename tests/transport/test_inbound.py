"""The receive routine over its two frame sources: every payload form, the move to the data
socket, and the frames out of place that end a stream."""

import select
import socket
import struct
import threading
import time
from typing import List, Optional

import numpy as np
import pytest

from elasticdl_strategy.errors import DataSocketClosed, IncompleteStream
from elasticdl_strategy.transport import frames, inbound
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.inbound import (
    WAITING_THREAD_READS_AT_MOST,
    GrpcFrames,
    SocketFrames,
    receive_messages,
)
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import ReceiveArena, SendArena
from tests.conditions import wait_for

MAX_FRAME = 1 << 20


class Writer:
    def __init__(self, nbytes: int, offer_target: bool):
        self.data = bytearray(nbytes)
        self.offer_target = offer_target
        self.finished = False
        self.targets = 0

    def write(self, offset, data, borrowed=False):
        self.data[offset : offset + len(data)] = data

    def target(self, offset, nbytes):
        if not self.offer_target:
            return None
        self.targets += 1
        return memoryview(self.data)[offset : offset + nbytes]

    def target_done(self):
        pass

    def finish(self):
        self.finished = True


class Receiver:
    def __init__(self, offer_target: bool = False):
        self.messages: List[Writer] = []
        self.offer_target = offer_target
        self.delivered_by: List[str] = []  # the thread that read each message
        self.socket: Optional[SocketFrames] = None
        self.attached = threading.Event()

    def on_header(self, header):
        self.messages.append(Writer(header.nbytes, self.offer_target))
        self.delivered_by.append(threading.current_thread().name)
        return self.messages[-1]

    def attach_socket(self, source):
        self.socket = source
        self.attached.set()

    def on_closed(self, error, goodbye):
        pass

    def payloads(self) -> List[bytes]:
        assert all(m.finished for m in self.messages)
        return [bytes(m.data) for m in self.messages]


def _header(sequence: int, nbytes: int, **fields) -> peer_pb2.MessageHeader:
    return peer_pb2.MessageHeader(sequence=sequence, nbytes=nbytes, **fields)


def _no_socket():
    raise ValueError("data_socket_attached on a stream that was not given a data socket")


def _receive(stream: List[bytes], receiver: Receiver, arena: Optional[ReceiveArena] = None, attach=_no_socket):
    """Runs the routine to its end; returns (goodbye, replies)."""
    replies = []
    routine = receive_messages(GrpcFrames(iter(stream), attach), receiver, arena)
    try:
        while True:
            replies.append(next(routine))
    except StopIteration as end:
        return end.value, replies


GOODBYE = frames.encode_goodbye(peer_pb2.Goodbye(reason="done"))


def test_every_payload_form_on_grpc_arrives_whole_and_in_order():
    chunked = bytes(range(256)) * 5
    stream = [
        frames.encode_whole_message(b"whole", _header(0, 5)),
        frames.encode_header(_header(1, 6, inline_data=b"inline")),
        frames.encode_header(_header(2, 0)),
        frames.encode_header(_header(3, len(chunked))),
        *(frames.encode_chunk(chunked[i : i + 500]) for i in range(0, len(chunked), 500)),
        GOODBYE,
    ]
    receiver = Receiver()
    goodbye, replies = _receive(stream, receiver)
    assert goodbye.reason == "done" and replies == []
    assert receiver.payloads() == [b"whole", b"inline", b"", chunked]


def test_payloads_through_shared_memory_arrive_and_their_slots_go_back(tmp_path):
    slot = 4096
    sender = SendArena(str(tmp_path), slots=2, slot_size=slot)
    arena, refusal = ReceiveArena.open(str(tmp_path), sender.offer())
    assert arena is not None, refusal
    payload = np.random.default_rng(0).integers(0, 255, 2 * slot - 100, dtype=np.uint8).tobytes()
    header = _header(0, len(payload))
    sender.fill(0, memoryview(payload)[:slot])
    header.shared_chunk.slot, header.shared_chunk.nbytes = 0, slot
    sender.fill(1, memoryview(payload)[slot:])
    stream = [frames.encode_header(header), frames.encode_shared_chunk(1, len(payload) - slot), GOODBYE]
    receiver = Receiver()
    _, replies = _receive(stream, receiver, arena)
    assert receiver.payloads() == [payload]
    assert sorted(s for reply in replies for s in reply.released_slots) == [0, 1]
    arena.close()


def test_the_stream_moves_to_its_data_socket_and_payloads_land_in_the_receive_buffer():
    sending, receiving = (FrameSocket(s, MAX_FRAME) for s in socket.socketpair())
    big = np.arange(300_000, dtype=np.uint8).tobytes()  # more than the socket buffers: written while read

    def send():
        sending.send_frame(frames.encode_header(_header(0, len(big))), memoryview(big))
        sending.send_frame(frames.encode_header(_header(1, 2, inline_data=b"ok")))
        sending.send_frame(GOODBYE)

    writer = threading.Thread(target=send, daemon=True)
    writer.start()
    receiver = Receiver(offer_target=True)
    try:
        goodbye, _ = _receive([frames.encode_data_socket_attached()], receiver, attach=lambda: receiving)
    finally:
        writer.join(timeout=20)
        sending.close()
    assert goodbye.reason == "done"
    assert receiver.payloads() == [big, b"ok"] and receiver.messages[0].targets >= 1


class ServerThread:
    """``receive_messages`` over a data socket in a thread of its own, as the stream's server thread."""

    def __init__(self, receiver: Receiver):
        self.sending, receiving = (FrameSocket(s, MAX_FRAME) for s in socket.socketpair())
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._run, args=(receiver, receiving), name="stream-server", daemon=True)
        self.thread.start()
        assert receiver.attached.wait(10)

    def _run(self, receiver, receiving):
        try:
            stream = [frames.encode_data_socket_attached()]
            self.outcome["goodbye"], _ = _receive(stream, receiver, attach=lambda: receiving)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.outcome["error"] = e

    def send(self, sequence: int, payload: bytes) -> None:
        self.sending.send_frame(frames.encode_header(_header(sequence, len(payload))), memoryview(payload))

    def finish(self) -> dict:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.sending.close()
        return self.outcome


def test_a_thread_waiting_for_messages_reads_them_itself_and_leaves_the_goodbye_to_the_server_thread():
    receiver = Receiver()
    server = ServerThread(receiver)
    sent = []

    def waiting():  # first called with the socket held: the messages come while this thread reads
        if not sent:
            sent.extend([b"first", b"x" * 100_000, b"third", bytes(range(256)) * (3 << 12)])  # 3 MiB too
            sending = threading.Thread(
                target=lambda: [server.send(sequence, payload) for sequence, payload in enumerate(sent)]
            )
            sending.start()  # the socket's buffers hold less than 3 MiB: written while this thread reads
            threads.append(sending)
        return len(receiver.messages) < len(sent)

    threads: List[threading.Thread] = []
    assert receiver.socket.read_while(receiver, waiting, time.monotonic() + 10)
    threads[0].join(timeout=10)
    server.sending.send_frame(GOODBYE)
    assert not receiver.socket.read_while(receiver, lambda: True, time.monotonic() + 10)  # left to the server thread
    outcome = server.finish()
    assert outcome["goodbye"].reason == "done", outcome
    assert receiver.payloads() == sent
    assert receiver.delivered_by == [threading.current_thread().name] * 4


def _first_of(receiver: Receiver, sent_before_reading):
    """A ``waiting()`` for the first message, which calls ``sent_before_reading`` once, with the socket held."""
    sent: list = []

    def waiting():
        if not sent:
            sent.append(sent_before_reading())
        return not (receiver.messages and receiver.messages[0].finished)

    return waiting


def _server_thread_keeps_off(receiver: Receiver, monkeypatch) -> None:
    """Makes the readers' grace a minute long and waits until the server thread sleeps through it
    (not watching the socket, as after a waiting thread read it): from then on only the test's
    threads read, however slowly this runs."""
    monkeypatch.setattr(inbound, "_READERS_GRACE_S", 60.0)
    sleeping = _sleeping_through_the_grace(monkeypatch)
    wait_for(lambda: receiver.socket._server_polls, "the server thread polling the quiet socket")
    receiver.socket._last_read = time.monotonic()  # as if a waiting thread had just read here
    receiver.socket._wake(server=True)  # out of its poll of the quiet socket, to look again
    assert sleeping.wait(10), "the server thread did not go to sleep for the readers' grace"


def _sleeping_through_the_grace(monkeypatch) -> threading.Event:
    """Set once the server thread sleeps through the readers' grace with nothing to wake it at once."""
    sleeping = threading.Event()
    wait_until_woken = FrameSocket.wait_until_woken

    def recorded(timeout, wake_fd):
        if not wait_until_woken(0, wake_fd):  # not woken already: it will sleep, not read
            sleeping.set()
        return wait_until_woken(timeout, wake_fd)

    monkeypatch.setattr(FrameSocket, "wait_until_woken", staticmethod(recorded))
    return sleeping


def test_messages_that_came_with_the_awaited_one_wait_in_the_buffer_for_the_next_waiting_thread(monkeypatch):
    receiver = Receiver()
    server = ServerThread(receiver)
    _server_thread_keeps_off(receiver, monkeypatch)
    payloads = [b"awaited", b"next step's", bytes(range(256)) * 100]

    def send_all():  # in one write: they are all in the socket before the first is read
        server.sending._sock.sendall(b"".join(_framed(sequence, payload) for sequence, payload in enumerate(payloads)))

    assert receiver.socket.read_while(receiver, _first_of(receiver, send_all), time.monotonic() + 10)
    assert receiver.payloads() == payloads[:1] and receiver.socket._socket.buffered()  # the others wait there
    assert receiver.socket.read_while(receiver, lambda: len(receiver.messages) < 3, time.monotonic() + 10)
    assert receiver.payloads() == payloads and receiver.delivered_by == [threading.current_thread().name] * 3
    server.sending.send_frame(GOODBYE)
    receiver.socket.hand_to_server()  # the grace is long here: the server thread reads the goodbye now
    assert server.finish()["goodbye"].reason == "done"


def test_messages_that_came_with_the_awaited_one_go_to_the_server_thread_once_the_readers_grace_passes():
    receiver = Receiver()
    server = ServerThread(receiver)
    third = bytes(range(256)) * 16

    def send_all_but_the_last_byte():
        server.sending._sock.sendall(_framed(0, b"awaited") + _framed(1, b"whole") + _framed(2, third)[:-1])

    waiting = _first_of(receiver, send_all_but_the_last_byte)
    returned: list = []
    reading = threading.Thread(
        target=lambda: returned.append(receiver.socket.read_while(receiver, waiting, time.monotonic() + 10)),
        name="reading",
    )
    reading.start()
    try:  # it returns with its message, not waiting for the rest of the third
        wait_for(lambda: returned, "the waiting thread returns", timeout=5)
    finally:
        server.sending._sock.sendall(third[-1:])
        reading.join(timeout=10)
    wait_for(lambda: len(receiver.messages) == 3, "the server thread reads the others", timeout=5)
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"
    assert returned == [True] and receiver.payloads() == [b"awaited", b"whole", third]
    assert receiver.delivered_by == ["reading", "stream-server", "stream-server"]


def test_a_frame_that_does_not_parse_after_the_awaited_message_ends_the_stream_in_the_server_thread():
    receiver = Receiver()
    server = ServerThread(receiver)
    garbage = b"\xff\xff\xff\xff"
    sent = _framed(0, b"a") + _framed(1, b"b") + struct.pack("<I", len(garbage)) + garbage + _framed(2, b"c")
    assert receiver.socket.read_while(
        receiver, _first_of(receiver, lambda: server.sending._sock.sendall(sent)), time.monotonic() + 10
    )  # the caller gets its message, not the stream's error
    assert server.finish().get("error") is not None
    assert receiver.payloads() == [b"a", b"b"]


def test_no_message_is_delivered_from_a_stream_that_already_ended():
    receiver = Receiver()
    server = ServerThread(receiver)
    out_of_place = frames.encode_data_socket_attached()  # ends the stream in the server thread
    later = _framed(0, b"after the end") + _framed(1, b"and this")
    server.sending._sock.sendall(struct.pack("<I", len(out_of_place)) + out_of_place + later)
    assert isinstance(server.finish().get("error"), ValueError)
    receiver.socket.read_while(receiver, lambda: False, time.monotonic() + 1)  # its message had come
    receiver.socket.read_while(receiver, lambda: True, time.monotonic() + 1)
    assert receiver.messages == []


def _hand_over_while_holding(frames_socket: SocketFrames, wake: bool, meanwhile=lambda: None) -> None:
    """As a waiting thread that holds the socket (doing ``meanwhile``), read it just now, and hands it
    to the server thread before it blocks writing (``hand_to_server``, with or without its wake)."""
    assert frames_socket._reading.acquire(blocking=False)
    try:
        meanwhile()
        frames_socket._last_read = time.monotonic()
        frames_socket._hand_over(wake=wake)
    finally:
        frames_socket._reading.release()


def test_a_thread_that_waited_for_nothing_leaves_a_hand_over_as_it_is():
    receiver = Receiver()
    server = ServerThread(receiver)
    frames_socket = receiver.socket

    def both_in_the_read_ahead_buffer():
        server.sending._sock.sendall(_framed(0, b"a") + _framed(1, b"b"))
        wait_for(lambda: frames_socket._socket.wait_readable(0), "the messages in the socket")
        frames_socket._socket._fill()

    _hand_over_while_holding(frames_socket, wake=True, meanwhile=both_in_the_read_ahead_buffer)
    frames_socket.read_while(receiver, lambda: False, time.monotonic() + 1)  # its message had come
    assert frames_socket._handed()
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"
    assert receiver.payloads() == [b"a", b"b"]


def _framed(sequence: int, payload: bytes) -> bytes:
    """A message as ``FrameSocket.send_frame`` writes it: length, header, payload."""
    header = frames.encode_header(_header(sequence, len(payload)))
    return struct.pack("<I", len(header)) + header + payload


def test_a_message_larger_than_a_waiting_thread_reads_is_left_to_the_server_thread():
    receiver = Receiver()
    server = ServerThread(receiver)
    big = bytes(WAITING_THREAD_READS_AT_MOST + 64)

    def waiting():  # first called with the socket held
        if not threads:
            threads.append(threading.Thread(target=server.send, args=(0, big)))
            threads[0].start()
        return True

    threads: List[threading.Thread] = []
    assert not receiver.socket.read_while(receiver, waiting, time.monotonic() + 10)  # left, not read
    threads[0].join(timeout=10)
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"
    assert receiver.payloads() == [big] and receiver.delivered_by == ["stream-server"]


def test_a_waiting_thread_interrupted_in_the_middle_of_a_message_ends_the_stream():
    receiver = Receiver()
    server = ServerThread(receiver)
    on_header = receiver.on_header

    def interrupted(header):
        on_header(header)
        raise KeyboardInterrupt  # Ctrl-C while the payload is still on the socket

    def waiting():  # first called with the socket held
        if not sent:
            sent.append(server.send(0, bytes(1000)))
        return True

    sent: list = []
    receiver.on_header = interrupted
    with pytest.raises(KeyboardInterrupt):
        receiver.socket.read_while(receiver, waiting, time.monotonic() + 10)
    assert isinstance(server.finish().get("error"), DataSocketClosed)  # not the payload read as a frame
    assert receiver.delivered_by == [threading.current_thread().name]


def test_a_waiting_thread_reading_a_message_its_sender_stopped_in_the_middle_of_returns_at_shutdown():
    receiver = Receiver()
    server = ServerThread(receiver)
    reading = threading.Thread(
        target=lambda: receiver.socket.read_while(receiver, lambda: True, time.monotonic() + 30), name="reading"
    )
    reading.start()
    try:
        wait_for(lambda: receiver.socket._reader is not None, "the waiting thread holding the socket")
        header = frames.encode_header(_header(0, 4 << 20))
        server.sending._sock.sendall(struct.pack("<I", len(header)) + header + bytes(1 << 20))  # a quarter, no more
        wait_for(lambda: receiver.delivered_by == ["reading"], "the waiting thread reads the message")
        receiver.socket.shutdown()  # as when the sender is declared failed
        reading.join(timeout=5)
        assert not reading.is_alive(), "the reading thread is still in the message"
        assert isinstance(server.finish().get("error"), DataSocketClosed)
        assert not receiver.messages[0].finished
    finally:
        server.sending.close()
        reading.join(timeout=10)


def test_a_broken_connection_a_waiting_thread_finds_ends_the_stream_in_the_server_thread():
    receiver = Receiver()
    server = ServerThread(receiver)
    cut = []

    def waiting():
        if not cut:  # once, with the socket held: half a frame, then the connection ends
            cut.append(server.sending._sock.sendall(b"\x64\x00\x00\x00half"))
            server.sending.shutdown()
        return True

    assert not receiver.socket.read_while(receiver, waiting, time.monotonic() + 10)
    outcome = server.finish()
    assert isinstance(outcome.get("error"), DataSocketClosed), outcome
    assert receiver.messages == []


def test_a_waiting_thread_lets_go_of_the_socket_at_its_deadline_and_the_server_thread_reads_what_comes_later():
    receiver = Receiver()
    server = ServerThread(receiver)
    started = time.monotonic()
    assert receiver.socket.read_while(receiver, lambda: True, started + 0.2)  # nothing came: the deadline
    assert 0.2 <= time.monotonic() - started < 5
    server.send(0, b"later")
    server.sending.send_frame(GOODBYE)
    outcome = server.finish()
    assert outcome["goodbye"].reason == "done"
    assert receiver.payloads() == [b"later"] and receiver.delivered_by == ["stream-server"]


def test_a_frame_on_grpc_after_the_move_to_the_data_socket_ends_the_stream():
    sending, receiving = (FrameSocket(s, MAX_FRAME) for s in socket.socketpair())
    sending.send_frame(GOODBYE)
    stream = [frames.encode_data_socket_attached(), frames.encode_header(_header(0, 0))]
    with pytest.raises(ValueError, match="a frame on gRPC after the stream moved"):
        _receive(stream, Receiver(), attach=lambda: receiving)
    sending.close()


@pytest.mark.parametrize(
    "stream, error, match",
    [
        ([frames.encode_header(_header(0, 0))], IncompleteStream, "without a goodbye"),
        ([frames.encode_header(_header(0, 10)), frames.encode_chunk(b"12345")], IncompleteStream, "middle"),
        ([frames.encode_shared_chunk(0, 8), GOODBYE], ValueError, "a shared_chunk frame between messages"),
        ([frames.encode_hello(peer_pb2.StreamHello()), GOODBYE], ValueError, "a hello frame between messages"),
        ([frames.encode_header(_header(0, 4)), GOODBYE], ValueError, "a goodbye frame inside a message's payload"),
        ([frames.encode_chunk(b"1234"), GOODBYE], ValueError, "a chunk frame without a message header"),
        ([frames.encode_data_socket_attached(), GOODBYE], ValueError, "not given a data socket"),
        ([frames.encode_header(_header(0, 8, shared_chunk={"slot": 0, "nbytes": 8}))], ValueError, "without an arena"),
    ],
    ids=["no-goodbye", "cut-mid-message", "stray-slot", "second-hello", "goodbye-in-payload", "bare-chunk",
         "no-socket", "no-arena"],
)  # fmt: skip
def test_a_frame_out_of_place_or_a_stream_cut_short_ends_the_stream_with_why(stream, error, match):
    with pytest.raises(error, match=match):
        _receive(stream, Receiver())


def test_the_server_thread_woken_with_nothing_to_read_sleeps_again():
    receiver = Receiver()
    server = ServerThread(receiver)
    frames_socket = receiver.socket._socket
    waits = []
    wait_readable, wait_until_woken = frames_socket.wait_readable, frames_socket.wait_until_woken
    frames_socket.wait_readable = lambda *args: (waits.append(args), wait_readable(*args))[1]
    frames_socket.wait_until_woken = lambda *args: (waits.append(args), wait_until_woken(*args))[1]
    receiver.socket.hand_to_server()  # woken, with nothing to read
    threading.Event().wait(0.3)  # an observation window: the thread must sleep through it, not spin
    assert len(waits) <= 3, f"{len(waits)} waits in 0.3 s"
    server.send(0, b"still read")
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"
    assert receiver.payloads() == [b"still read"]


# ---- read_while with place: the awaited message read the short way ----------------------------


class Place:
    """A ``place`` for ``read_while``: message ``sequence`` goes to a writer of its own."""

    def __init__(self, sequence: int, offer_target: bool = True):
        self.sequence = sequence
        self.offer_target = offer_target
        self.placed: List[Writer] = []
        self.asked: List[int] = []  # the sequence numbers of the headers it was shown

    def __call__(self, header):
        self.asked.append(header.sequence)
        if header.sequence != self.sequence:
            return None
        self.placed.append(Writer(header.nbytes, self.offer_target))
        return self.placed[-1]

    def came(self) -> bool:
        return bool(self.placed) and self.placed[0].finished


def _read_placed(receiver: Receiver, place: Place, send_when_held, seconds: float = 10.0) -> bool:
    """``read_while`` for ``place``'s message (the first one, however it comes), calling
    ``send_when_held()`` once with the socket held."""
    sent: list = []

    def waiting():
        if not sent:
            sent.append(send_when_held())
        return not (place.came() or (receiver.messages and receiver.messages[0].finished))

    return receiver.socket.read_while(receiver, waiting, time.monotonic() + seconds, seconds, False, place)


def _inline(sequence: int, data: bytes) -> bytes:
    header = frames.encode_header(_header(sequence, len(data), inline_data=data))
    return struct.pack("<I", len(header)) + header


def test_the_awaited_message_is_read_into_its_place_and_so_is_the_next_one_that_came_with_it(monkeypatch):
    receiver = Receiver()
    server = ServerThread(receiver)
    _server_thread_keeps_off(receiver, monkeypatch)
    place = Place(0)
    sent = _framed(0, b"awaited") + _framed(1, b"next step's")  # in one write
    assert _read_placed(receiver, place, lambda: server.sending._sock.sendall(sent))
    assert place.came() and bytes(place.placed[0].data) == b"awaited" and place.placed[0].targets == 1
    following = Place(1)  # the next receive finds it in the buffer
    assert _read_placed(receiver, following, lambda: None)
    assert following.came() and bytes(following.placed[0].data) == b"next step's"
    assert receiver.messages == []  # neither handed to the receiver (nor read by the server thread)
    server.sending.send_frame(GOODBYE)
    receiver.socket.hand_to_server()  # the grace is long here: the server thread reads the goodbye now
    assert server.finish()["goodbye"].reason == "done"


@pytest.mark.parametrize(
    "sent, usual_way, short_way, asked",
    [
        (_framed(1, b"another") + _framed(0, b"awaited"), [b"another"], [b"awaited"], [1, 0]),  # another first
        (_inline(0, b"awaited"), [], [b"awaited"], [0]),  # the awaited one inline: its payload in its header
    ],
    ids=["another message first", "inline"],
)
def test_place_takes_the_awaited_message_and_the_receiver_gets_the_others(sent, usual_way, short_way, asked):
    receiver = Receiver()
    server = ServerThread(receiver)
    place = Place(0)
    held: list = []

    def waiting():
        if not held:
            held.append(server.sending._sock.sendall(sent))
        return len(receiver.messages) + sum(w.finished for w in place.placed) < len(usual_way) + len(short_way)

    assert receiver.socket.read_while(receiver, waiting, time.monotonic() + 10, 10, False, place)
    assert receiver.payloads() == usual_way and [bytes(w.data) for w in place.placed] == short_way
    assert receiver.delivered_by == [threading.current_thread().name] * len(usual_way) and place.asked == asked
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


def test_a_message_whose_frame_comes_in_pieces_is_read_the_short_way_too(monkeypatch):
    receiver = Receiver()
    server = ServerThread(receiver)
    message = _framed(0, b"awaited")
    socket_ = receiver.socket._socket
    recv = socket_._recv
    rest_sent: list = []

    def recv_then_send_the_rest(view):  # the rest comes once the first 3 bytes were read
        n = recv(view)
        if not rest_sent:
            rest_sent.append(server.sending._sock.sendall(message[3:]))
        return n

    monkeypatch.setattr(socket_, "_recv", recv_then_send_the_rest)
    place = Place(0)
    assert _read_placed(receiver, place, lambda: server.sending._sock.sendall(message[:3]))
    assert rest_sent and place.came() and bytes(place.placed[0].data) == b"awaited" and receiver.messages == []
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


def test_a_placed_message_whose_writer_offers_no_target_gets_its_bytes_through_write():
    receiver = Receiver()
    server = ServerThread(receiver)
    place = Place(0, offer_target=False)  # a reduction: every byte through write
    payload = bytes(range(256)) * 40
    assert _read_placed(receiver, place, lambda: server.send(0, payload))
    assert place.came() and bytes(place.placed[0].data) == payload and place.placed[0].targets == 0
    assert receiver.messages == []
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


@pytest.mark.parametrize("offer_target", [True, False], ids=["into its target", "through write"])
@pytest.mark.parametrize("sent", [b"", _framed(0, bytes(1000))[:-500]], ids=["nothing", "half a payload"])
def test_a_connection_that_ends_under_the_short_way_ends_the_stream_in_the_server_thread(sent, offer_target):
    receiver = Receiver()
    server = ServerThread(receiver)
    place = Place(0, offer_target)
    assert not _read_placed(receiver, place, lambda: (server.sending._sock.sendall(sent), server.sending.shutdown()))
    assert isinstance(server.finish().get("error"), DataSocketClosed)
    assert not place.came() and receiver.messages == []  # a placed one never finishes: its receive fails


def test_a_thread_interrupted_in_the_middle_of_a_placed_payload_ends_the_stream(monkeypatch):
    receiver = Receiver()
    server = ServerThread(receiver)
    socket_ = receiver.socket._socket

    def interrupted(view):
        raise KeyboardInterrupt  # Ctrl-C while the payload is still on the socket

    monkeypatch.setattr(socket_, "recv_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _read_placed(receiver, Place(0), lambda: server.sending._sock.sendall(_framed(0, bytes(100_000))))
    assert isinstance(server.finish().get("error"), DataSocketClosed)  # not the payload read as a frame


def test_a_thread_that_reads_its_message_the_short_way_ends_a_hand_over_made_before_it_took_the_socket():
    receiver = Receiver()
    server = ServerThread(receiver)
    frames_socket = receiver.socket
    _hand_over_while_holding(frames_socket, wake=False)  # not waking the server thread to take it
    assert frames_socket._handed()
    place = Place(0)
    assert _read_placed(receiver, place, lambda: server.send(0, b"awaited"))
    assert place.came() and not frames_socket._handed()  # the socket is the waiting threads' again
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


def test_a_place_that_fails_ends_the_stream_in_the_server_thread_not_in_the_waiting_thread():
    receiver = Receiver()
    server = ServerThread(receiver)

    def failing(header):
        raise RuntimeError("a bug in place")

    waiting_calls: list = []

    def waiting():
        if not waiting_calls:
            server.send(0, b"awaited")
        waiting_calls.append(1)
        return True

    assert not receiver.socket.read_while(receiver, waiting, time.monotonic() + 10, 10, False, failing)
    error = server.finish().get("error")
    assert isinstance(error, RuntimeError) and "a bug in place" in str(error)


def test_an_empty_placed_message_whose_writer_offers_no_target_is_read():
    receiver = Receiver()
    server = ServerThread(receiver)
    place = Place(0, offer_target=False)  # a reduction's empty segment, the first payload on this socket
    assert _read_placed(receiver, place, lambda: server.send(0, b""))
    assert place.came() and receiver.messages == []
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


def test_a_thread_interrupted_just_as_its_read_of_a_frame_returns_ends_the_stream():
    receiver = Receiver()
    server = ServerThread(receiver)
    frame_socket = receiver.socket._socket
    real_recv = frame_socket._recv
    interrupted: list = []

    def recv_then_interrupted(view):
        n = real_recv(view)  # the bytes are out of the kernel...
        if not interrupted:
            interrupted.append(n)
            raise KeyboardInterrupt  # ...and Ctrl-C's handler runs before they are kept
        return n

    frame_socket._recv = recv_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        _read_placed(receiver, Place(0), lambda: server.send(0, b"lost"))
    assert isinstance(server.finish().get("error"), DataSocketClosed)  # not a clean end with the message lost


def _hold_server_before_its_poll(monkeypatch):
    """Stops the server thread after it found the read-ahead buffer empty and before it polls the
    socket (``looked``) until ``go_on``: bytes a waiting thread drains from the kernel meanwhile
    cannot wake that poll, only a waiting thread's wake can."""
    looked, go_on = threading.Event(), threading.Event()
    wait_readable = FrameSocket.wait_readable

    def held(self, timeout, wake_fd=None):
        if threading.current_thread().name != "stream-server" or timeout != inbound._SERVER_WAIT_SLICE_S:
            return wait_readable(self, timeout, wake_fd)
        if self.buffered():
            return True
        looked.set()
        assert go_on.wait(10)
        poller = select.poll()  # the poll itself, as wait_readable does it, without its look at the buffer
        poller.register(self._fd, select.POLLIN | select.POLLPRI)
        poller.register(wake_fd, select.POLLIN)
        return any(fd == self._fd for fd, _ in poller.poll(int(timeout * 1000)))

    monkeypatch.setattr(FrameSocket, "wait_readable", held)
    return looked, go_on


def _read_one_leaving_the_next(monkeypatch, grace: float):
    """A server thread polling the quiet socket (held before its poll); a waiting thread reads the
    first of two messages that came together, leaving the second in the buffer."""
    monkeypatch.setattr(inbound, "_SERVER_WAIT_SLICE_S", 60.0)  # not looking again by itself
    monkeypatch.setattr(inbound, "_READERS_GRACE_S", grace)
    looked, go_on = _hold_server_before_its_poll(monkeypatch)
    receiver = Receiver()
    server = ServerThread(receiver)
    assert looked.wait(10) and receiver.socket._server_polls
    sent = _framed(0, b"awaited") + _framed(1, b"the next")
    assert receiver.socket.read_while(
        receiver, _first_of(receiver, lambda: server.sending._sock.sendall(sent)), time.monotonic() + 10
    )
    assert receiver.socket._socket.buffered()
    go_on.set()
    return receiver, server


def test_a_server_thread_polling_the_socket_is_woken_for_a_message_left_in_the_buffer(monkeypatch):
    receiver, server = _read_one_leaving_the_next(monkeypatch, grace=0.005)
    wait_for(lambda: len(receiver.messages) == 2 and receiver.messages[1].finished, "the second delivered", timeout=10)
    assert receiver.delivered_by == [threading.current_thread().name, "stream-server"]  # after the grace
    server.sending.send_frame(GOODBYE)
    assert server.finish()["goodbye"].reason == "done"


def test_a_server_thread_woken_to_look_again_leaves_the_buffer_to_waiting_threads_during_their_grace(monkeypatch):
    sleeping = _sleeping_through_the_grace(monkeypatch)
    receiver, server = _read_one_leaving_the_next(monkeypatch, grace=60.0)
    assert sleeping.wait(10)  # woken, it went to sleep for the readers' grace, not reading
    assert receiver.socket.read_while(receiver, lambda: len(receiver.messages) < 2, time.monotonic() + 10)
    assert receiver.payloads() == [b"awaited", b"the next"]
    assert receiver.delivered_by == [threading.current_thread().name] * 2
    server.sending.send_frame(GOODBYE)
    receiver.socket.hand_to_server()  # the grace is long here: the server thread reads the goodbye now
    assert server.finish()["goodbye"].reason == "done"
