"""Whether every worker holds the same variables: one digest of their description, one all-gather.

Used when variables are created (every worker must create the same one at
the same point) and before an elastic state is synced (every worker must
hold the same state variables).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, List

import numpy as np


def describe(variables: Iterable) -> str:
    """What must match on every worker: each variable's path (or name), shape and dtype."""
    return "|".join(
        f"{getattr(v, 'path', None) or v.name}:{v.shape}:{getattr(v.dtype, 'name', v.dtype)}" for v in variables
    )


def ranks_that_differ(communicator, description: str, root: int = 0) -> List[int]:
    """The ranks whose ``description`` differs from ``root``'s (all-gathers a 32-byte digest per rank)."""
    mine = np.frombuffer(hashlib.sha256(description.encode()).digest(), np.uint8)[None, :]
    digests = communicator.allgather(mine)
    return [r for r in range(communicator.size) if not np.array_equal(digests[r], digests[root])]
