"""The pod manager with hundreds of worker pods on the emulator: creation, a wave of evictions and
their relaunches, completion, and how many API requests it makes per pod event.

The workers are stand-ins: ``head -c 1 FIFO`` exits 0 once it has read one byte of a FIFO the test
holds open, so the test ends them when it chooses, and a pod costs the machine one tiny process.
"""

import os
import threading

import pytest
from kubernetes.client import CoreV1Api

from elasticdl_strategy.launcher.k8s import manifests
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from elasticdl_strategy.launcher.k8s.pod_manager import PodManager
from tests.launcher.k8s.emulator import KubeEmulator

pytestmark = pytest.mark.slow

WORKERS, EVICTED = 200, 20


def _running(cluster, selector):
    return [p for p in cluster.pods(label_selector=selector) if p["status"].get("phase") == "Running"]


def test_two_hundred_workers_through_a_wave_of_evictions_to_completion(tmp_path):
    fifo = tmp_path / "finish"
    os.mkfifo(fifo)
    config = K8sJobConfig(
        name="big", image="edl", command=("head", "-c", "1", str(fifo)), workers=WORKERS,
        min_workers=WORKERS - EVICTED, max_restarts=EVICTED, termination_grace_s=5,
    )  # fmt: skip
    selector = manifests.selector(config, "worker")
    with KubeEmulator(history_limit=10_000) as cluster:
        api = CoreV1Api(cluster.api_client())
        api.create_namespaced_secret("default", manifests.token_secret(config, "t" * 64))
        api.create_namespaced_config_map("default", manifests.status_config_map(config))
        stand_in = {"name": "master", "image": "edl", "command": ["sleep", "600"]}
        master = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": config.master_name},
            "spec": {"containers": [stand_in]},
        }
        owner = api.create_namespaced_pod("default", master).metadata
        made_by_the_test = sum(cluster.requests.values())
        manager = PodManager(api, config, {"name": owner.name, "uid": owner.uid}, "127.0.0.1:50051")
        events = []
        apply = manager.apply
        manager.apply = lambda kind, obj: (events.append(kind), apply(kind, obj))[1]
        stop = threading.Event()
        outcome = []
        runner = threading.Thread(target=lambda: outcome.append(manager.run(stop.is_set)), daemon=True)
        # Held open for reading and writing: never blocks, and a stand-in that opens the FIFO later
        # still finds its byte there (no end of file while the test holds it).
        finish = os.open(fifo, os.O_RDWR)
        runner.start()
        try:
            KubeEmulator.wait_for(lambda: len(_running(cluster, selector)) == WORKERS, timeout=240, interval=0.5)
            for index in range(0, WORKERS, WORKERS // EVICTED):
                cluster.evict(config.worker_name(index))
            KubeEmulator.wait_for(lambda: manager.restarts == EVICTED, timeout=60, interval=0.2)
            KubeEmulator.wait_for(lambda: len(_running(cluster, selector)) == WORKERS, timeout=120, interval=0.5)
            os.write(finish, b"x" * WORKERS)  # one byte for every worker alive: each exits 0
            runner.join(timeout=120)
        finally:
            stop.set()
            runner.join(timeout=30)
            os.close(finish)
        by_manager = sum(cluster.requests.values()) - made_by_the_test
        requests = dict(cluster.requests)
        assert outcome and outcome[0].phase == "Succeeded", outcome
        status = api.read_namespaced_config_map(config.status_name, "default").data
        assert status["phase"] == "Succeeded" and status["restarts"] == str(EVICTED)
        print(f"{len(events)} pod events; {by_manager} requests by the manager: {requests}")
        assert requests[("create", "pods")] == 1 + WORKERS + EVICTED  # the master, then each worker once
        assert len(events) >= 3 * (WORKERS + EVICTED)  # at least added, running and ended per pod
        # One create per pod, the watches and lists, and the status at most about once a second: well
        # under half a request per pod event (writing the status at every event made it over one).
        assert by_manager <= 0.5 * len(events), (by_manager, len(events))
        assert requests[("patch", "configmaps")] <= 0.1 * len(events), (requests, len(events))
