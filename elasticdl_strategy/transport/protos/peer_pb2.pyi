from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamHello(_message.Message):
    __slots__ = ("src_rank", "membership_version", "worker_id", "shared_memory", "data_socket")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    membership_version: int
    worker_id: str
    shared_memory: SharedMemoryOffer
    data_socket: bool
    def __init__(self, src_rank: _Optional[int] = ..., membership_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemoryOffer, _Mapping]] = ..., data_socket: _Optional[bool] = ...) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("name", "nonce", "slots", "slot_size", "lane_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    nonce: bytes
    slots: int
    slot_size: int
    lane_bytes: int
    def __init__(self, name: _Optional[str] = ..., nonce: _Optional[bytes] = ..., slots: _Optional[int] = ..., slot_size: _Optional[int] = ..., lane_bytes: _Optional[int] = ...) -> None: ...

class SharedChunk(_message.Message):
    __slots__ = ("slot", "nbytes")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    nbytes: int
    def __init__(self, slot: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CollectiveDescriptor(_message.Message):
    __slots__ = ("sequence", "op", "dtype", "shape", "reduce_op", "root", "compression")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    op: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    reduce_op: str
    root: int
    compression: str
    def __init__(self, sequence: _Optional[int] = ..., op: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., reduce_op: _Optional[str] = ..., root: _Optional[int] = ..., compression: _Optional[str] = ...) -> None: ...

class MessageHeader(_message.Message):
    __slots__ = ("channel", "tag", "sequence", "nbytes", "chunk_size", "dtype", "shape", "inline_data", "collective", "shared_chunk")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    SHARED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    channel: int
    tag: int
    sequence: int
    nbytes: int
    chunk_size: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    inline_data: bytes
    collective: CollectiveDescriptor
    shared_chunk: SharedChunk
    def __init__(self, channel: _Optional[int] = ..., tag: _Optional[int] = ..., sequence: _Optional[int] = ..., nbytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., inline_data: _Optional[bytes] = ..., collective: _Optional[_Union[CollectiveDescriptor, _Mapping]] = ..., shared_chunk: _Optional[_Union[SharedChunk, _Mapping]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("hello", "header", "chunk", "goodbye", "shared_chunk", "data_socket_attached")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    SHARED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    hello: StreamHello
    header: MessageHeader
    chunk: bytes
    goodbye: Goodbye
    shared_chunk: SharedChunk
    data_socket_attached: bool
    def __init__(self, hello: _Optional[_Union[StreamHello, _Mapping]] = ..., header: _Optional[_Union[MessageHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., shared_chunk: _Optional[_Union[SharedChunk, _Mapping]] = ..., data_socket_attached: _Optional[bool] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason", "abort")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    abort: AbortRequest
    def __init__(self, reason: _Optional[str] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("shared_memory_accepted", "shared_memory_refusal", "released_slots", "data_socket_port", "data_socket_ticket")
    SHARED_MEMORY_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_TICKET_FIELD_NUMBER: _ClassVar[int]
    shared_memory_accepted: bool
    shared_memory_refusal: str
    released_slots: _containers.RepeatedScalarFieldContainer[int]
    data_socket_port: int
    data_socket_ticket: bytes
    def __init__(self, shared_memory_accepted: _Optional[bool] = ..., shared_memory_refusal: _Optional[str] = ..., released_slots: _Optional[_Iterable[int]] = ..., data_socket_port: _Optional[int] = ..., data_socket_ticket: _Optional[bytes] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("src_rank", "membership_version", "kind", "reason", "ranks")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    membership_version: int
    kind: str
    reason: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_rank: _Optional[int] = ..., membership_version: _Optional[int] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
