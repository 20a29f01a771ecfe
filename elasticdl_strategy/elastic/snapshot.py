"""A committed state: what a rollback restores, a sync sends and a checkpoint holds."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import numpy as np

from elasticdl_strategy.data.records import Position


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The values of a state's variables and Python values, and the data position, at one commit."""

    arrays: List[np.ndarray]
    values: Dict[str, Any]
    position: Position
    commit_id: int
