"""WorkerCounts: the one place the worker-count rules of both launchers and the coordinator live."""

import pytest

from elasticdl_strategy.coordinator import CoordinatorParams, WorkerCounts
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from elasticdl_strategy.launcher.local import LaunchConfig


@pytest.mark.parametrize(
    "workers, min_workers, max_workers, max_restarts, message",
    [
        (0, 1, 1, 0, "--workers=0 must be at least 1"),
        (2, 0, 2, 0, "--min-workers=0 must be between 1 and --workers=2"),
        (2, 3, 3, 0, "--min-workers=3 must be between 1 and --workers=2"),
        (4, 3, 2, 0, "--max-workers=2 must be at least --min-workers=3"),
        (2, 2, 2, -1, "--max-restarts=-1 must not be negative"),
    ],
)
def test_both_launchers_refuse_the_same_counts_with_the_same_line(
    workers, min_workers, max_workers, max_restarts, message
):
    counts = dict(workers=workers, min_workers=min_workers, max_workers=max_workers, max_restarts=max_restarts)
    for make in (
        WorkerCounts.of,
        lambda **c: K8sJobConfig(name="job", image="registry/edl:1", command=("python3", "train.py"), **c),
        lambda **c: LaunchConfig(["python3", "train.py"], **c),
    ):
        with pytest.raises(ConfigError, match=f"^{message}$"):
            make(**counts)


@pytest.mark.parametrize(
    "counts, target, elastic",
    [
        (WorkerCounts.of(3), 3, False),
        (WorkerCounts.of(3, min_workers=2), 3, True),
        (WorkerCounts.of(3, max_restarts=1), 3, True),
        (WorkerCounts.of(4, max_workers=3), 3, True),  # one standby
        (WorkerCounts.of(2, min_workers=1, max_workers=4), 2, True),
    ],
)
def test_target_and_elastic(counts, target, elastic):
    assert counts.target == target
    assert counts.elastic is elastic


def test_the_flag_defaults_of_both_launchers_and_the_coordinator_agree():
    k8s = K8sJobConfig(name="job", image="registry/edl:1", command=("python3",), workers=4, max_workers=3)
    assert k8s.counts == WorkerCounts.of(4, max_workers=3, max_restarts=3) == WorkerCounts(4, 3, 3, 3)
    assert CoordinatorParams(k8s.counts).counts.target == 3
