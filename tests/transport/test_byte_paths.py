"""The three byte paths of a sender: what goes on the gRPC call, what goes elsewhere."""

import socket
import threading

import numpy as np

from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.byte_paths import RAW_ON_SOCKET_MAX_BYTES, DataSocketPath, GrpcPath, SharedMemoryPath
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import SendArena

SLOT = 4096


def _header(nbytes: int) -> peer_pb2.MessageHeader:
    return peer_pb2.MessageHeader(sequence=7, nbytes=nbytes)


def test_grpc_chunks_carry_the_payload_in_order():
    payload = np.arange(10_000, dtype=np.uint8).tobytes()
    sent = list(GrpcPath().frames(_header(len(payload)), memoryview(payload), chunk_size=3000))
    assert frames.decode_control(sent[0]).header.nbytes == len(payload)
    assert b"".join(bytes(frames.chunk_payload(f)) for f in sent[1:]) == payload
    assert len(sent) == 1 + 4


def test_a_writer_waits_for_a_slot_the_peer_hands_back_and_gives_up_when_stopped(tmp_path):
    shared = SharedMemoryPath(SendArena(str(tmp_path), slots=1, slot_size=SLOT))
    payload = memoryview(np.arange(3 * SLOT, dtype=np.uint8).tobytes())
    sent = shared.frames(_header(len(payload)), payload)
    first = frames.decode_control(next(sent)).header.shared_chunk
    assert first.nbytes == SLOT
    handed_back = threading.Timer(0.05, shared.release, args=([0],))
    handed_back.start()
    assert frames.decode_control(next(sent)).shared_chunk.slot == 0  # waited for the release
    handed_back.join()
    threading.Timer(0.05, shared.stop).start()
    assert list(sent) == []  # stopped while waiting for the third slot: the message ends there
    assert shared.bytes_sent == 2 * SLOT


def test_the_slot_handed_back_last_is_filled_next(tmp_path):
    # A fresh arena's pages cost a page fault on first touch (and are cold in the caches): a
    # sender whose peer keeps up touches one slot, not each slot in turn.
    shared = SharedMemoryPath(SendArena(str(tmp_path), slots=4, slot_size=SLOT))
    used = []
    for _ in range(6):
        (frame,) = shared.frames(_header(SLOT), memoryview(bytes(SLOT)))
        slot = frames.decode_control(frame).header.shared_chunk.slot
        used.append(slot)
        shared.release([slot])
    assert len(set(used)) == 1, used


def test_a_data_socket_path_says_attached_once_then_writes_everything_on_its_socket(tmp_path):
    near, far = (FrameSocket(s, 1 << 22) for s in socket.socketpair())
    shared = SharedMemoryPath(SendArena(str(tmp_path), slots=2, slot_size=RAW_ON_SOCKET_MAX_BYTES))
    path = DataSocketPath(near, shared)
    assert list(path.goodbye(peer_pb2.Goodbye(reason="early"))) != []  # not attached yet: on gRPC
    small = memoryview(b"s" * 100)
    on_grpc = list(path.frames(_header(100), small, 1 << 16))
    assert [frames.decode_control(f).WhichOneof("kind") for f in on_grpc] == ["data_socket_attached"]
    assert frames.decode_control(far.recv_frame()).header.nbytes == 100
    received = bytearray(100)
    far.recv_into(memoryview(received))
    assert received == small  # raw after its header
    large = memoryview(bytes(RAW_ON_SOCKET_MAX_BYTES + 1))
    assert list(path.frames(_header(len(large)), large, 1 << 16)) == []
    assert frames.decode_control(far.recv_frame()).header.HasField("shared_chunk")  # through the arena
    assert frames.decode_control(far.recv_frame()).shared_chunk.nbytes == 1
    assert list(path.goodbye(peer_pb2.Goodbye(reason="late"))) == []
    assert frames.decode_control(far.recv_frame()).goodbye.reason == "late"
    near.close()
    far.close()
