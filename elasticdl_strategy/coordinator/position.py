"""Where training stands in the data: what every commit records and every member agrees on."""

from __future__ import annotations

import dataclasses

from elasticdl_strategy.transport.protos import coordinator_pb2


@dataclasses.dataclass(frozen=True)
class Position:
    """The data position of a job; the same on every worker at a commit.

    >>> print(Position(epoch=1, batch=3, cursor=96))
    epoch 1, batch 3, record 96
    >>> Position.from_proto(Position(2, 0, 0).to_proto())
    Position(epoch=2, batch=0, cursor=0)
    """

    epoch: int = 0
    batch: int = 0  # steps taken in this epoch
    cursor: int = 0  # records of this epoch consumed (by all workers together)

    def __str__(self) -> str:
        return f"epoch {self.epoch}, batch {self.batch}, record {self.cursor}"

    def to_proto(self) -> coordinator_pb2.DataPosition:
        return coordinator_pb2.DataPosition(epoch=self.epoch, batch=self.batch, cursor=self.cursor)

    @classmethod
    def from_proto(cls, proto: coordinator_pb2.DataPosition) -> "Position":
        return cls(proto.epoch, proto.batch, proto.cursor)
