"""The pod manager's policy, driven by watch events built with the official client's models."""

import datetime
import json
import types

import pytest
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1ListMeta,
    V1ObjectMeta,
    V1Pod,
    V1PodList,
    V1PodStatus,
)

from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from elasticdl_strategy.launcher.k8s.pod_manager import PodManager, WorkerPod, decide


class FakeCoreApi:
    """Records what the manager asks of the API."""

    def __init__(self):
        self.created, self.deleted, self.status = [], [], {}
        self.status_writes = 0

    def create_namespaced_pod(self, namespace, body, **kwargs):
        self.created.append(body["metadata"]["name"])

    def delete_namespaced_pod(self, name, namespace, **kwargs):
        self.deleted.append(name)

    def list_namespaced_pod(self, namespace, label_selector=None, **kwargs):
        return V1PodList(items=[], metadata=V1ListMeta(resource_version="1"))

    def patch_namespaced_config_map(self, name, namespace, body):
        self.status = body["data"]
        self.status_writes += 1

    def read_namespaced_config_map(self, name, namespace):
        if not self.status:
            raise LookupError("no status yet")
        return types.SimpleNamespace(data=self.status)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def pod(name, rv, phase, exit_code=None, reason=None, status_reason=None, deleting=False, uid=None):
    index = name.rsplit("-", 1)[1]
    statuses = None
    if exit_code is not None:
        terminated = V1ContainerStateTerminated(exit_code=exit_code, reason=reason)
        statuses = [
            V1ContainerStatus(
                name="worker",
                image="i",
                image_id="",
                ready=False,
                restart_count=0,
                state=V1ContainerState(terminated=terminated),
            )
        ]
    return V1Pod(
        metadata=V1ObjectMeta(
            name=name,
            uid=uid or f"uid-{name}",
            resource_version=str(rv),
            labels={"elasticdl-strategy/worker-id": index},
            deletion_timestamp=datetime.datetime.now(datetime.timezone.utc) if deleting else None,
        ),
        status=V1PodStatus(phase=phase, container_statuses=statuses, reason=status_reason),
    )


def manager(workers=3, min_workers=2, max_restarts=2, **kwargs):
    config = K8sJobConfig(
        name="job", image="edl", command=("python", "t.py"), workers=workers, min_workers=min_workers,
        max_restarts=max_restarts, **kwargs,
    )  # fmt: skip
    api, clock = FakeCoreApi(), Clock()
    m = PodManager(api, config, {"name": "job-master", "uid": "u"}, "10.0.0.1:50051", clock=clock)
    m.start()
    return m, api, clock


@pytest.mark.parametrize(
    "state, action",
    [
        (dict(phase="Succeeded", exit_code=0), "finished"),
        (dict(phase="Failed", exit_code=137, reason="OOMKilled"), "failed"),
        (dict(phase="Failed", exit_code=1), "failed"),
        (dict(phase="Failed", exit_code=127), "failed"),
        (dict(phase="Failed", exit_code=137), "relaunch"),  # SIGKILL
        (dict(phase="Failed", exit_code=143), "relaunch"),  # SIGTERM
        (dict(phase="Failed", reason="Evicted"), "relaunch"),
        (dict(phase="Running", deleted=True), "relaunch"),
    ],
)
def test_decide(state, action):
    assert decide(WorkerPod(0, "job-worker-0", **state), relaunch_on_error=False) == action


def test_relaunch_on_error_relaunches_program_errors_too():
    assert decide(WorkerPod(0, "w", phase="Failed", exit_code=1), relaunch_on_error=True) == "relaunch"
    assert (
        decide(WorkerPod(0, "w", phase="Failed", exit_code=137, reason="OOMKilled"), relaunch_on_error=True)
        == "relaunch"
    )


def test_a_deleted_worker_is_relaunched_under_a_new_id_after_a_backoff():
    m, api, clock = manager()
    assert api.created == ["job-worker-0", "job-worker-1", "job-worker-2"]
    m.apply("ADDED", pod("job-worker-1", 5, "Running"))
    m.apply("DELETED", pod("job-worker-1", 9, "Running"))
    m.relaunch_due()
    assert len(api.created) == 3  # the backoff has not passed
    clock.now += 1.5
    m.relaunch_due()
    assert api.created[-1] == "job-worker-3" and m.restarts == 1
    assert m.check_outcome() is None


def test_resource_versions_are_opaque_strings_not_numbers():
    # The API documents resourceVersion as opaque: these must not be parsed, compared or dropped.
    m, api, clock = manager()
    m.apply("ADDED", pod("job-worker-1", "Cg8xMjM0NTY3", "Pending"))
    m.apply("MODIFIED", pod("job-worker-1", "opaque-b", "Running"))
    m.apply("MODIFIED", pod("job-worker-1", "a", "Failed", exit_code=2))
    assert m.pods["job-worker-1"].phase == "Failed" and m.pods["job-worker-1"].resource_version == "a"
    assert m.failures and "job-worker-1 exited with code 2" in m.failures[0]


def test_an_event_equal_in_uid_and_resource_version_is_a_duplicate_but_another_uid_is_not():
    m, api, clock = manager()
    m.apply("MODIFIED", pod("job-worker-2", "5", "Running"))
    m.pods["job-worker-2"].reason = "seen"
    m.apply("MODIFIED", pod("job-worker-2", "5", "Running", status_reason="changed"))  # the same event again
    assert m.pods["job-worker-2"].reason == "seen"
    m.apply("MODIFIED", pod("job-worker-2", "5", "Running", status_reason="changed", uid="other"))
    assert m.pods["job-worker-2"].reason == "changed"


def test_duplicate_and_out_of_order_events_change_nothing():
    m, api, clock = manager()
    m.apply("MODIFIED", pod("job-worker-0", 10, "Failed", exit_code=137))
    m.apply("MODIFIED", pod("job-worker-0", 10, "Failed", exit_code=137))  # duplicate
    m.apply("MODIFIED", pod("job-worker-0", 7, "Running"))  # older, arrives late
    m.apply("DELETED", pod("job-worker-0", 11, "Failed", exit_code=137))
    assert len(m.pending_relaunches) == 1 and m.pods["job-worker-0"].phase == "Failed"


def test_pending_then_failed_without_running_is_handled():
    m, api, clock = manager()
    m.apply("ADDED", pod("job-worker-2", 3, "Pending"))
    m.apply("MODIFIED", pod("job-worker-2", 4, "Failed", exit_code=2))
    assert m.failures and "job-worker-2 exited with code 2" in m.failures[0]
    assert not m.pending_relaunches


def test_a_program_error_is_not_relaunched_and_fails_the_job_below_min_workers():
    m, api, clock = manager(workers=2, min_workers=2)
    m.apply("MODIFIED", pod("job-worker-0", 4, "Failed", exit_code=1))
    outcome = m.check_outcome()
    assert outcome.phase == "Failed"
    assert "fewer than --min-workers=2" in outcome.message and "job-worker-0 exited with code 1" in outcome.message
    assert "--relaunch-on-error" in outcome.message


def test_an_oom_kill_says_to_raise_memory():
    m, api, clock = manager(workers=1, min_workers=1)
    m.apply("MODIFIED", pod("job-worker-0", 4, "Failed", exit_code=137, reason="OOMKilled"))
    assert "OOMKilled" in m.failures[0] and "raise --memory" in m.failures[0]


def test_the_restart_budget_is_enforced_with_doubling_backoff():
    m, api, clock = manager(workers=2, min_workers=2, max_restarts=2)
    delays = []
    for rv, name in enumerate(["job-worker-0", "job-worker-2", "job-worker-3"], start=10):
        m.apply("DELETED", pod(name, rv, "Running"))
        if m.pending_relaunches:
            delays.append(m.pending_relaunches[-1][0] - clock.now)
        clock.now += 100
        m.relaunch_due()
    assert delays == [1.0, 2.0]
    assert api.created == ["job-worker-0", "job-worker-1", "job-worker-2", "job-worker-3"]
    outcome = m.check_outcome()
    assert outcome.phase == "Failed" and "restart budget spent" in outcome.message


def test_a_wave_of_evictions_is_replaced_after_the_first_backoff_not_one_after_the_other():
    m, api, clock = manager(workers=20, min_workers=10, max_restarts=20)
    for index in range(20):
        m.apply("MODIFIED", pod(f"job-worker-{index}", 3, "Running"))
    clock.now += 300
    for index in range(20):
        m.apply("MODIFIED", pod(f"job-worker-{index}", 4, "Failed", exit_code=143, status_reason="Evicted"))
    assert {due - clock.now for due, _ in m.pending_relaunches} == {1.0}
    clock.now += 1.0
    m.relaunch_due()
    assert len(api.created) == 40 and m.restarts == 20


def test_a_slot_that_keeps_crashing_backs_off_longer_until_one_of_its_pods_runs_stably():
    m, api, clock = manager(workers=2, min_workers=1, max_restarts=10)
    delays = []

    def end(name, rv, ran_s):
        m.apply("MODIFIED", pod(name, rv, "Running"))
        clock.now += ran_s
        m.apply("MODIFIED", pod(name, rv + 1, "Failed", exit_code=137))
        delays.append(m.pending_relaunches[-1][0] - clock.now)
        clock.now += 100
        m.relaunch_due()
        return api.created[-1]

    name = "job-worker-0"
    for ran_s in (5, 5, 5, 120, 5):
        name = end(name, 10 * len(delays), ran_s)
    assert delays == [1.0, 2.0, 4.0, 1.0, 1.0]


def test_the_status_is_written_at_most_once_a_second_and_at_the_end():
    m, api, clock = manager(workers=3, min_workers=1)
    m.write_status()
    for rv, phase in enumerate(["Pending", "Running"] * 3, start=1):
        m.apply("MODIFIED", pod(f"job-worker-{rv % 3}", rv, phase))
        clock.now += 0.1
        m.write_status()
    assert api.status_writes == 1
    clock.now += 1.0
    m.write_status()
    assert api.status_writes == 2 and json.loads(api.status["workers"])["job-worker-1"]["phase"] == "Running"
    m.apply("MODIFIED", pod("job-worker-0", 20, "Succeeded", exit_code=0))
    m.apply("MODIFIED", pod("job-worker-1", 21, "Succeeded", exit_code=0))
    m.apply("MODIFIED", pod("job-worker-2", 22, "Succeeded", exit_code=0))
    assert m._step() and api.status_writes == 3 and api.status["phase"] == "Succeeded"  # at once


def test_the_job_succeeds_when_training_finished_and_every_worker_ended():
    m, api, clock = manager()
    m.apply("MODIFIED", pod("job-worker-0", 20, "Succeeded", exit_code=0))
    assert m.check_outcome() is None  # others still running
    m.apply("DELETED", pod("job-worker-1", 21, "Running"))  # not replaced once training is done
    m.apply("MODIFIED", pod("job-worker-2", 22, "Succeeded", exit_code=0))
    assert not m.pending_relaunches
    m.outcome = m.check_outcome()
    assert m.outcome.phase == "Succeeded"
    m.write_status()
    assert api.status["phase"] == "Succeeded"
    assert json.loads(api.status["workers"])["job-worker-0"]["exit_code"] == 0


def test_a_deleted_worker_that_leaves_gracefully_with_exit_0_is_replaced_not_taken_for_the_end():
    m, api, clock = manager()
    m.apply("MODIFIED", pod("job-worker-1", 5, "Running", deleting=True))  # kubectl delete: SIGTERM
    assert not m.pending_relaunches  # still leaving
    m.apply("MODIFIED", pod("job-worker-1", 6, "Succeeded", exit_code=0, deleting=True))
    m.apply("DELETED", pod("job-worker-1", 7, "Succeeded", exit_code=0, deleting=True))
    assert not m.finished and len(m.pending_relaunches) == 1


def test_exit_0_before_the_coordinator_heard_training_finish_is_a_graceful_leave():
    m, api, clock = manager()
    m.training_finished = lambda: False  # an evicted worker left gracefully: not the end of training
    m.apply("MODIFIED", pod("job-worker-0", 8, "Failed", exit_code=0, status_reason="Evicted"))
    m.apply("MODIFIED", pod("job-worker-1", 9, "Succeeded", exit_code=0))
    assert not m.finished and len(m.pending_relaunches) == 2


def test_a_refused_relaunch_counts_against_the_budget_instead_of_crashing():
    from kubernetes.client.exceptions import ApiException

    m, api, clock = manager(workers=2, min_workers=2, max_restarts=1)

    def refuse(namespace, body, **kwargs):
        raise ApiException(status=403, reason="Forbidden")

    api.create_namespaced_pod = refuse
    m.apply("DELETED", pod("job-worker-0", 10, "Running"))
    clock.now += 5
    m.relaunch_due()
    assert "job-worker-2" not in m.pods and "refused by the API: 403" in m.failures[0]
    assert m.check_outcome().phase == "Failed"


def test_a_restarted_master_keeps_the_budget_and_does_not_replace_a_pod_twice():
    m, api, clock = manager(workers=2, min_workers=1, max_restarts=3)
    m.apply("MODIFIED", pod("job-worker-0", 10, "Failed", exit_code=137))
    clock.now += 5
    m.relaunch_due()  # job-worker-2 replaces job-worker-0
    m.write_status()
    created = list(api.created)

    class Listed(FakeCoreApi):
        def list_namespaced_pod(self, namespace, label_selector=None, **kwargs):
            items = [pod("job-worker-0", 10, "Failed", exit_code=137), pod("job-worker-1", 11, "Running")]
            return V1PodList(items=items, metadata=V1ListMeta(resource_version="12"))

    api2 = Listed()
    api2.status = api.status
    restarted = PodManager(api2, m.config, m.owner, m.coordinator_address, clock=clock)
    restarted.start()
    assert restarted.restarts == 1 and not restarted.pending_relaunches and api2.created == []
    assert created[-1] == "job-worker-2"


def test_the_status_of_a_thousand_workers_stays_far_below_the_config_map_limit():
    name = "a-job-name-as-long-as-names-may-be"  # 34 characters: pod names of 50
    config = K8sJobConfig(name=name, image="edl", command=("python", "t.py"), workers=1000, max_restarts=1000)
    api, clock = FakeCoreApi(), Clock()
    m = PodManager(api, config, {"name": f"{name}-master", "uid": "u"}, "10.0.0.1:50051", clock=clock)
    m.start()
    for index in range(1000):  # every worker is killed once and relaunched, then 500 fail for good
        m.apply("MODIFIED", pod(f"{name}-worker-{index}", "1", "Failed", exit_code=137))
        clock.now += 120.0
        m.relaunch_due()
    for index in range(1000, 1500):
        m.apply("MODIFIED", pod(f"{name}-worker-{index}", "1", "Failed", exit_code=3, reason="Error"))
    status = m.status()
    size = sum(len(k) + len(v) for k, v in status.items())
    assert len(m.pods) == 2000 and m.restarts == 1000 and len(m.failures) == 500
    assert size < 256 << 10, size  # Kubernetes refuses objects over 1 MiB
    assert status["settled"] == "0-1499" and status["failures_total"] == "500"
    assert len(json.loads(status["workers"])) == 500 + 100 and status["workers_not_listed"] == "1400"
    outcome = m.check_outcome()  # 500 alive, fewer than --min-workers (1000), no restarts left
    assert outcome.phase == "Failed" and outcome.message.endswith("(and 495 earlier)") and len(outcome.message) < 2000


def test_a_restarted_master_reads_back_the_settled_pods_and_the_failure_count():
    m, api, clock = manager(workers=3, max_restarts=0)
    m.apply("MODIFIED", pod("job-worker-1", "2", "Failed", exit_code=3))
    api.status = m.status()
    again = PodManager(api, m.config, {"name": "job-master", "uid": "u"}, "10.0.0.1:50051", clock=clock)
    again._read_previous_status()
    assert again.settled == {1} and again.failures == m.failures and again.earlier_failures == 0


def test_a_restarted_master_skips_pods_without_a_worker_index_when_it_adopts_the_job():
    m, api, clock = manager(workers=2, max_restarts=0)
    m.apply("MODIFIED", pod("job-worker-1", "2", "Failed", exit_code=3))
    api.status = m.status()
    stranger = pod("job-worker-9", "3", "Running")
    stranger.metadata.labels = {"app.kubernetes.io/instance": "job"}  # matches the selector, no worker id
    listed = [pod("job-worker-0", "4", "Running"), pod("job-worker-1", "5", "Failed", exit_code=3), stranger]
    api.list_namespaced_pod = lambda *a, **k: V1PodList(items=listed, metadata=V1ListMeta(resource_version="5"))
    again = PodManager(api, m.config, {"name": "job-master", "uid": "u"}, "10.0.0.1:50051", clock=clock)
    again.start()
    assert sorted(again.pods) == ["job-worker-0", "job-worker-1"] and again.pods["job-worker-1"].handled
    assert api.created.count("job-worker-2") == 0  # adopted, nothing created
