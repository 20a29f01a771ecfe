"""Layer 3: rendezvous, membership versions and heartbeats."""

from elasticdl_strategy.coordinator import events
from elasticdl_strategy.coordinator.coordinator import Coordinator
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts

__all__ = ["Coordinator", "CoordinatorParams", "Member", "Membership", "WorkerCounts", "events"]
