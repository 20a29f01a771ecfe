"""Layer 3: rendezvous, membership versions and heartbeats."""

from elasticdl_strategy.coordinator.coordinator import Coordinator, CoordinatorParams
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts

__all__ = ["Coordinator", "CoordinatorParams", "Member", "Membership", "WorkerCounts"]
