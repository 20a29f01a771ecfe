"""Lanes: the ring of messages in an arena, written and read by the callers' threads."""

import contextlib
import multiprocessing
import threading
import time

import numpy as np
import pytest

from elasticdl_strategy.transport import futex, lanes
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import ReceiveArena, SendArena

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="lanes need Linux on x86-64")

LANE = 64 << 10


@pytest.fixture
def lane_pair(tmp_path):
    sender = SendArena(str(tmp_path), 2, 64 << 10, lane_bytes=LANE)
    receiver, refusal = ReceiveArena.open(str(tmp_path), sender.offer())
    assert receiver is not None, refusal
    yield sender.lane, receiver.lane
    receiver.close()


def read_all(lane):
    """Every message in the lane: (header, payload), a message in pieces put together."""
    messages = []
    while (record := lane.next_record()) is not None:
        header, payload, end = record
        if header is None:  # a piece of the message before
            messages[-1] = (messages[-1][0], messages[-1][1] + bytes(payload))
        else:
            messages.append((bytes(header), bytes(payload)))
        lane.release(end)
    return messages


def test_records_arrive_whole_and_in_order_across_many_wraps(lane_pair):
    send, receive = lane_pair
    rng = np.random.default_rng(0)
    sent = []
    for i in range(2000):  # about 30 times round the ring: the reader reads only when the lane is full
        payload = rng.bytes(int(rng.integers(0, 2000)))
        header = f"message {i}".encode()
        if not send.try_send(header, memoryview(payload)):
            assert read_all(receive) == sent
            sent.clear()
            assert send.try_send(header, memoryview(payload))
        sent.append((header, payload))
    assert read_all(receive) == sent
    assert int(send._written[0]) > 25 * LANE


def test_an_empty_lane_starts_over_at_its_beginning(lane_pair):
    send, receive = lane_pair
    for i in range(100):  # a sender and a reader taking turns: every record at 0
        payload = bytes([i]) * 3000
        assert send.try_send(b"turn", memoryview(payload))
        header, received, end = receive.next_record()
        assert (bytes(header), bytes(received)) == (b"turn", payload)
        assert _offset(received, receive) < 64
        receive.release(end)


def test_records_written_before_the_reader_reaches_a_restart_may_fill_the_ring(lane_pair):
    send, receive = lane_pair
    quarter = bytes(LANE // 4 - 64)  # a record of just under a quarter of the ring
    assert send.try_send(b"q", memoryview(quarter)) and send.try_send(b"q", memoryview(quarter))
    read_all(receive)  # the reader is past the middle of the ring: the next record starts over at 0
    sent = [(b"h", bytes(100))]
    assert send.try_send(sent[0][0], memoryview(sent[0][1]))
    while send.try_send(b"q", memoryview(quarter)):  # over the place of the restart: nothing to read there
        sent.append((b"q", quarter))
    assert len(sent) == 5  # the whole ring
    assert read_all(receive) == sent
    assert send.try_send(b"again", memoryview(quarter))
    assert read_all(receive) == [(b"again", quarter)]


def _offset(view: memoryview, lane) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data - lane._ring.ctypes.data


def test_a_full_lane_or_a_large_message_is_refused_and_nothing_is_written(lane_pair):
    send, receive = lane_pair
    assert not send.try_send(b"h", memoryview(bytes(LANE * 3 // 4 + 8)))  # more than three quarters of the ring
    chunk = bytes(LANE // 4 - 64)
    accepted = 0
    while send.try_send(b"h", memoryview(chunk)):
        accepted += 1
    assert accepted == 4  # no more fits until the reader releases
    records = read_all(receive)
    assert len(records) == 4 and all(p == chunk for _, p in records)
    assert send.try_send(b"again", memoryview(chunk))  # the space came back
    assert read_all(receive) == [(b"again", chunk)]


def test_a_message_larger_than_a_record_goes_in_pieces_each_readable_alone(lane_pair):
    send, receive = lane_pair
    payload = np.random.default_rng(2).bytes(LANE // 2 - 100)
    assert send.try_send(b"large", memoryview(payload))
    records = []
    while (record := receive.next_record()) is not None:
        header, piece, end = record
        records.append((None if header is None else bytes(header), bytes(piece)))
        receive.release(end)
    piece = lanes.piece_bytes(LANE)
    assert [h for h, _ in records] == [b"large"] + [None] * (len(payload) // piece)
    assert all(len(p) == piece for _, p in records[:-1])
    assert b"".join(p for _, p in records) == payload
    assert send.try_send(b"small", memoryview(b"after"))
    assert read_all(receive) == [(b"small", b"after")]


def test_a_message_in_pieces_that_does_not_fit_at_once_is_refused_whole(lane_pair):
    send, receive = lane_pair
    assert send.try_send(b"q", memoryview(bytes(LANE // 4 - 32)))  # unread: a quarter of the ring
    written = int(send._written[0])
    assert not send.try_send(b"large", memoryview(bytes(LANE * 3 // 4)))  # 3/4 of the ring and its records' prefixes
    assert int(send._written[0]) == written  # no piece of it
    assert [h for h, _ in read_all(receive)] == [b"q"]
    assert send.try_send(b"large", memoryview(bytes(LANE * 3 // 4)))
    assert read_all(receive) == [(b"large", bytes(LANE * 3 // 4))]


def test_a_record_that_does_not_fit_the_lane_is_reported(lane_pair):
    send, receive = lane_pair
    assert send.try_send(b"header", memoryview(b"payload"))
    np.frombuffer(receive._ring.data, np.uint32)[0] = LANE  # a size larger than any record
    with pytest.raises(ValueError, match="does not fit the lane"):
        receive.next_record()


def _asleep_in_futex(native_id: int) -> bool:
    with open(f"/proc/self/task/{native_id}/wchan") as f:
        return "futex" in f.read()


def _count_wakes(monkeypatch) -> list:
    wakes = []
    real = futex.wake
    monkeypatch.setattr(lanes.futex, "wake", lambda address: (wakes.append(address), real(address)))
    return wakes


def test_a_ring_with_nobody_asleep_makes_no_system_call(lane_pair, monkeypatch):
    send, receive = lane_pair
    wakes = _count_wakes(monkeypatch)
    assert send.try_send(b"h", memoryview(b"x"))
    receive.ring()
    assert wakes == []
    assert read_all(receive) == [(b"h", b"x")]


def test_a_sleeping_reader_wakes_when_a_record_is_written(lane_pair, monkeypatch):
    send, receive = lane_pair
    wakes = _count_wakes(monkeypatch)
    seen = receive.doorbell
    woke, ids = [], []
    reader = threading.Thread(
        target=lambda: (ids.append(threading.get_native_id()), receive.wait(seen, 10.0), woke.append(time.monotonic()))
    )
    reader.start()
    deadline = time.monotonic() + 5
    while not (ids and _asleep_in_futex(ids[0])):  # the reader sleeps in the kernel, on the doorbell
        assert time.monotonic() < deadline, "the reader did not go to sleep"
        time.sleep(0.01)
    sent = time.monotonic()
    assert send.try_send(b"h", memoryview(b"x"))
    reader.join(timeout=5)
    assert woke and woke[0] - sent < 1.0
    assert len(wakes) == 1  # the sender saw the sleeper
    assert read_all(receive) == [(b"h", b"x")]


def test_a_ring_between_looking_and_sleeping_is_not_lost(lane_pair):
    _, receive = lane_pair
    seen = receive.doorbell
    receive.ring()  # as a completion on another thread would, after the look and before the sleep
    started = time.monotonic()
    receive.wait(seen, 5.0)
    assert time.monotonic() - started < 0.5


ROUND_TRIPS = 3000


def _next_record_or_sleep(lane) -> bytes:
    """The next record's header, sleeping on the doorbell (no spinning) until it comes.

    Raises:
        AssertionError: a sleep lasted a second (a lost wake-up sleeps out the timeout).
    """
    while True:
        seen = lane.doorbell
        record = lane.next_record()
        if record is not None:
            header, _, end = record
            lane.release(end)
            return bytes(header)
        started = time.monotonic()
        lane.wait(seen, 1.0)
        assert time.monotonic() - started < 1.0, "a wake-up was lost"


@contextlib.contextmanager
def _peer_process(tmp_path, target, *args):
    """Runs ``target(directory, *args, pipe)`` in a forked process, which sends the offer of an arena
    it writes first; yields ``(pipe, that arena mapped here)``. At the end tells it "done" and
    checks that it exited cleanly; the process is killed (by pid) whatever happened."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=target, args=(str(tmp_path), *args, theirs))
    process.start()
    try:
        assert ours.poll(30), "the other process did not start"
        inbound, refusal = ReceiveArena.open(str(tmp_path), peer_pb2.SharedMemoryOffer.FromString(ours.recv()))
        assert inbound is not None, refusal
        yield ours, inbound
        ours.send("done")
        process.join(timeout=30)
        assert process.exitcode == 0
        inbound.close()
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def _echo(directory: str, offer: bytes, pipe) -> None:
    """The other process of the ping-pong: echoes every record back on its own arena's lane."""
    inbound, refusal = ReceiveArena.open(directory, peer_pb2.SharedMemoryOffer.FromString(offer))
    outbound = SendArena(directory, 2, 64 << 10, lane_bytes=LANE)
    pipe.send(outbound.offer().SerializeToString())
    for _ in range(ROUND_TRIPS):
        assert outbound.lane.try_send(_next_record_or_sleep(inbound.lane), memoryview(b""))
    pipe.send("echoed")
    pipe.recv()  # the test has read the last echo: the arena may go
    inbound.close()


def test_ping_pong_between_processes_loses_no_wake_up(tmp_path):
    # Both sides sleep for every record (no spinning): each of the 6000 records races a ring
    # against a sleep across two processes; a lost wake-up would sleep out its timeout.
    outbound = SendArena(str(tmp_path), 2, 64 << 10, lane_bytes=LANE)
    with _peer_process(tmp_path, _echo, outbound.offer().SerializeToString()) as (pipe, inbound):
        for i in range(ROUND_TRIPS):
            assert outbound.lane.try_send(str(i).encode(), memoryview(b""))
            assert _next_record_or_sleep(inbound.lane) == str(i).encode()
        assert pipe.poll(30) and pipe.recv() == "echoed"


STREAMED_RECORDS = 4000


def _record(i: int) -> bytes:
    """Message ``i`` of the stream: sizes from empty to 3/4 of the ring (in pieces from a quarter on),
    bytes that tell messages apart."""
    size = (i * 7919) % (LANE * 3 // 4) if i % 5 == 0 else (i * 131) % 3000
    return bytes([i % 251]) * size


def _write_stream(directory: str, pipe) -> None:
    """Writes every record, waiting (polling, with a deadline) while the lane is full."""
    outbound = SendArena(directory, 2, 64 << 10, lane_bytes=LANE)
    pipe.send(outbound.offer().SerializeToString())
    deadline = time.monotonic() + 60
    for i in range(STREAMED_RECORDS):
        while not outbound.lane.try_send(str(i).encode(), memoryview(_record(i))):
            assert time.monotonic() < deadline, "the reader stopped reading"
    pipe.recv()  # the reader has read the last record: the arena may go


def test_messages_of_every_size_stream_between_processes_whole_and_in_order(tmp_path):
    # Both processes run at once on their own cores: the writer fills the ring, restarts at 0
    # whenever it finds it empty and wraps at its end, while the reader reads in bursts.
    with _peer_process(tmp_path, _write_stream) as (_, inbound):
        rng = np.random.default_rng(1)
        received, message = 0, b""
        deadline = time.monotonic() + 60
        while received < STREAMED_RECORDS:
            assert time.monotonic() < deadline, f"message {received} never came whole"
            for _ in range(int(rng.integers(1, 8))):  # reads in bursts, a message's pieces as they come
                record = inbound.lane.next_record()
                if record is None:
                    break
                header, payload, end = record
                if header is not None:
                    assert bytes(header) == str(received).encode() and message == b""
                message += bytes(payload)
                inbound.lane.release(end)
                if len(message) == len(_record(received)):
                    assert message == _record(received)
                    received, message = received + 1, b""
