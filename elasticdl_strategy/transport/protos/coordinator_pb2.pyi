from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("worker_id", "address", "host")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    host: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class Membership(_message.Message):
    __slots__ = ("version", "members", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    reason: str
    def __init__(self, version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "membership", "last_commit", "incarnation", "host")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    membership: Membership
    last_commit: CommitRecord
    incarnation: str
    host: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., membership: _Optional[_Union[Membership, _Mapping]] = ..., last_commit: _Optional[_Union[CommitRecord, _Mapping]] = ..., incarnation: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("join_order", "heartbeat_interval_s", "joins_running_job")
    JOIN_ORDER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    JOINS_RUNNING_JOB_FIELD_NUMBER: _ClassVar[int]
    join_order: int
    heartbeat_interval_s: float
    joins_running_job: bool
    def __init__(self, join_order: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., joins_running_job: _Optional[bool] = ...) -> None: ...

class DataPosition(_message.Message):
    __slots__ = ("epoch", "batch", "cursor")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batch: int
    cursor: int
    def __init__(self, epoch: _Optional[int] = ..., batch: _Optional[int] = ..., cursor: _Optional[int] = ...) -> None: ...

class CommitRecord(_message.Message):
    __slots__ = ("commit_id", "membership_version", "position")
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    commit_id: int
    membership_version: int
    position: DataPosition
    def __init__(self, commit_id: _Optional[int] = ..., membership_version: _Optional[int] = ..., position: _Optional[_Union[DataPosition, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("worker_id", "membership_version", "commit_id", "position", "incarnation", "leaving_workers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEAVING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    membership_version: int
    commit_id: int
    position: DataPosition
    incarnation: str
    leaving_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., membership_version: _Optional[int] = ..., commit_id: _Optional[int] = ..., position: _Optional[_Union[DataPosition, _Mapping]] = ..., incarnation: _Optional[str] = ..., leaving_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("recorded", "membership_version", "reason")
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    recorded: bool
    membership_version: int
    reason: str
    def __init__(self, recorded: _Optional[bool] = ..., membership_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("worker_id", "membership_version", "suspects", "reason", "incarnation", "dead")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    membership_version: int
    suspects: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    incarnation: str
    dead: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., membership_version: _Optional[int] = ..., suspects: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., incarnation: _Optional[str] = ..., dead: _Optional[_Iterable[str]] = ...) -> None: ...

class FailureReportResponse(_message.Message):
    __slots__ = ("membership_version",)
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    def __init__(self, membership_version: _Optional[int] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("num_records", "shard_size", "seed", "shuffle", "fingerprint")
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_records: int
    shard_size: int
    seed: int
    shuffle: bool
    fingerprint: str
    def __init__(self, num_records: _Optional[int] = ..., shard_size: _Optional[int] = ..., seed: _Optional[int] = ..., shuffle: _Optional[bool] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class GetShardsRequest(_message.Message):
    __slots__ = ("worker_id", "spec", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    spec: DatasetSpec
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetShardsResponse(_message.Message):
    __slots__ = ("starts", "ends")
    STARTS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, starts: _Optional[_Iterable[int]] = ..., ends: _Optional[_Iterable[int]] = ...) -> None: ...

class GetMembershipRequest(_message.Message):
    __slots__ = ("worker_id", "after_version", "wait_s", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_version: int
    wait_s: float
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., after_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class GetMembershipResponse(_message.Message):
    __slots__ = ("membership", "registered", "min_workers", "max_workers", "last_commit", "job_finished", "replaced")
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    membership: Membership
    registered: int
    min_workers: int
    max_workers: int
    last_commit: CommitRecord
    job_finished: bool
    replaced: bool
    def __init__(self, membership: _Optional[_Union[Membership, _Mapping]] = ..., registered: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., last_commit: _Optional[_Union[CommitRecord, _Mapping]] = ..., job_finished: _Optional[bool] = ..., replaced: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "membership_version", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    membership_version: int
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., membership_version: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("membership_version", "known", "replaced")
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    known: bool
    replaced: bool
    def __init__(self, membership_version: _Optional[int] = ..., known: _Optional[bool] = ..., replaced: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "finished", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    finished: bool
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., finished: _Optional[bool] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("membership_version",)
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    def __init__(self, membership_version: _Optional[int] = ...) -> None: ...
