"""Encoding of the frames that travel on a ``Peer.Transfer`` stream.

Every frame is a serialized ``peer.Frame`` protobuf. Hello and other control
frames go through protobuf; a header frame is the header's own protobuf bytes
behind the field's tag and length, written by hand (one copy of the header less
than serializing a ``Frame``). Chunk frames, which carry the bulk data, are
written by hand too: a 3-byte field tag and a 5-byte (padded) length followed by
the raw bytes. That is valid protobuf for ``Frame.chunk``, costs one copy to
build (``bytes.join`` over a memoryview of the array) and none to read, and puts
the payload at an 8-byte aligned offset so ``np.frombuffer`` views are aligned.
"""

from __future__ import annotations

from typing import Union

from elasticdl_strategy.transport.protos import peer_pb2

_CHUNK_FIELD_NUMBER = 2048
_WIRE_TYPE_LENGTH_DELIMITED = 2
_LENGTH_WIDTH = 5  # the longest varint protobuf accepts for a length

Buffer = Union[bytes, bytearray, memoryview]


def _varint(value: int, width: int = 0) -> bytes:
    """Encodes ``value`` as a varint, padded with continuation bytes to ``width``."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        last = value == 0 and len(out) + 1 >= width
        out.append(byte if last else byte | 0x80)
        if last:
            return bytes(out)


_CHUNK_TAG = _varint((_CHUNK_FIELD_NUMBER << 3) | _WIRE_TYPE_LENGTH_DELIMITED)
_HEADER_TAG = _varint((peer_pb2.Frame.HEADER_FIELD_NUMBER << 3) | _WIRE_TYPE_LENGTH_DELIMITED)
CHUNK_PREFIX_SIZE = len(_CHUNK_TAG) + _LENGTH_WIDTH
MAX_CHUNK_SIZE = (1 << 32) - 1
assert CHUNK_PREFIX_SIZE == 8


def encode_chunk(data: Buffer) -> bytes:
    """Returns the frame for one chunk of raw payload bytes (one copy of ``data``)."""
    return b"".join((_CHUNK_TAG, _varint(len(data), _LENGTH_WIDTH), data))


def is_chunk(frame: bytes) -> bool:
    """Whether ``frame`` was made by :func:`encode_chunk` (rather than being a protobuf-encoded frame)."""
    return frame[: len(_CHUNK_TAG)] == _CHUNK_TAG


def _chunk_length(frame: bytes) -> int:
    length = 0
    for i, byte in enumerate(frame[len(_CHUNK_TAG) : CHUNK_PREFIX_SIZE]):
        length |= (byte & 0x7F) << (7 * i)
    return length


def chunk_payload(frame: bytes) -> memoryview:
    """Returns a zero-copy view of the payload of a frame made by :func:`encode_chunk`.

    Raises:
        ValueError: the frame is not a chunk frame.
    """
    if not is_chunk(frame):
        raise ValueError("expected a chunk frame")
    length = _chunk_length(frame)
    if length != len(frame) - CHUNK_PREFIX_SIZE:
        raise ValueError(f"chunk frame says {length} bytes but holds {len(frame) - CHUNK_PREFIX_SIZE}")
    return memoryview(frame)[CHUNK_PREFIX_SIZE:]


def encode_whole_message(payload: Buffer, header: peer_pb2.MessageHeader) -> bytes:
    """One frame holding a whole message: its payload as a chunk frame, then its header frame.

    Saves the separate header frame (a gRPC message, with its thread
    handoffs) for messages that fit in one chunk. The payload comes first so
    that it stays 8-byte aligned and is found without parsing protobuf.
    """
    return b"".join((_CHUNK_TAG, _varint(len(payload), _LENGTH_WIDTH), payload, encode_header(header)))


def split_whole_message(frame: bytes):
    """Returns ``(payload view, header)`` of a frame made by :func:`encode_whole_message`,
    or ``None`` for a plain chunk frame.

    Raises:
        ValueError: the frame is not a chunk frame.
    """
    if not is_chunk(frame):
        raise ValueError("expected a chunk frame")
    length = _chunk_length(frame)
    end = CHUNK_PREFIX_SIZE + length
    if end == len(frame):
        return None
    if end > len(frame):
        raise ValueError(f"chunk frame says {length} bytes but holds {len(frame) - CHUNK_PREFIX_SIZE}")
    control = decode_control(memoryview(frame)[end:])
    if control.WhichOneof("kind") != "header":
        raise ValueError("a whole-message frame must end with a header")
    return memoryview(frame)[CHUNK_PREFIX_SIZE:end], control.header


def encode_hello(hello: peer_pb2.StreamHello) -> bytes:
    return peer_pb2.Frame(hello=hello).SerializeToString()


def encode_header(header: peer_pb2.MessageHeader) -> bytes:
    """The frame of ``header``: the bytes ``peer_pb2.Frame(header=header)`` serializes to, written
    around the header's own (one copy of the header less, for every message)."""
    body = header.SerializeToString()
    size = len(body)
    return b"".join((_HEADER_TAG, bytes((size,)) if size < 0x80 else _varint(size), body))


def encode_shared_chunk(slot: int, nbytes: int) -> bytes:
    return peer_pb2.Frame(shared_chunk=peer_pb2.SharedChunk(slot=slot, nbytes=nbytes)).SerializeToString()


def encode_data_socket_attached() -> bytes:
    return peer_pb2.Frame(data_socket_attached=True).SerializeToString()


def encode_goodbye(goodbye: peer_pb2.Goodbye) -> bytes:
    return peer_pb2.Frame(goodbye=goodbye).SerializeToString()


def decode_control(frame: Union[bytes, memoryview]) -> peer_pb2.Frame:
    """Parses a hello, header or goodbye frame."""
    return peer_pb2.Frame.FromString(frame)
