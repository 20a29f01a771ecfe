"""Jobs submitted to a Kubernetes API: the emulator of tests/launcher/k8s/emulator.py, which runs
every pod's command as a local process. The package talks to it through the official client,
exactly as to a real cluster.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from elasticdl_strategy.errors import ConfigError, KubernetesError
from elasticdl_strategy.launcher.k8s.job_client import JobClient
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from tests.launch import REPO_ROOT, worker_script
from tests.launcher.k8s.emulator import KubeEmulator
from tests.launcher.k8s.flags import submit_flags

pytestmark = pytest.mark.slow

RECORDS, EPOCHS = 240, 3
BASE = {"records": RECORDS, "batch": 4, "epochs": EPOCHS, "commit_every": 2}


@pytest.fixture
def cluster():
    # The pods' commands are test scripts that import tests.*: the checkout goes on their path
    # (a real image has the package installed; the emulator runs commands on this machine).
    with KubeEmulator(pod_env={"PYTHONPATH": REPO_ROOT}) as emulator:
        yield emulator


def job(tmp_path, name="job", workers=3, config=None, **kwargs):
    command = (
        sys.executable,
        worker_script("elastic_counter.py"),
        str(tmp_path),
        json.dumps({**BASE, **(config or {})}),
    )
    kwargs.setdefault("min_workers", 2)
    kwargs.setdefault("heartbeat_timeout_s", 3.0)
    kwargs.setdefault("rendezvous_timeout_s", 60.0)
    kwargs.setdefault("termination_grace_s", 10)
    return K8sJobConfig(name=name, image="elasticdl-strategy:test", command=command, workers=workers, **kwargs)


def wait_for_phase(client, config, phases, timeout=150):
    def ended():
        status = client.status(config.name, config.namespace)
        return status if status["phase"] in phases else None

    return KubeEmulator.wait_for(ended, timeout=timeout, interval=0.2)


def logs_of_all_pods(cluster):
    """For failure messages: the tail of every pod's log."""
    text = []
    for pod in cluster.pods(label_selector="app.kubernetes.io/name=elasticdl-strategy"):
        name = pod["metadata"]["name"]
        lines = [line for line in cluster.pod_log(name).splitlines() if "I0000" not in line and "^^^" not in line]
        text.append(f"===== {name}\n" + "\n".join(lines[-40:]))
        if pod["status"].get("containerStatuses", [{}])[0].get("restartCount"):
            api = JobClient(cluster.api_client()).core
            previous = api.read_namespaced_pod_log(name, "default", previous=True).splitlines()
            text.append(f"===== {name} (before its restart)\n" + "\n".join(previous[-60:]))
    return "\n".join(text)


def reports(tmp_path):
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")}


def assert_exactly_once(found):
    assert found
    first = next(iter(found.values()))
    for report in found.values():
        assert np.all(np.array(report["counts"]) == EPOCHS)
        assert report["counts"] == first["counts"] and report["seen"] == first["seen"]
    assert first["seen"][0] == RECORDS * EPOCHS


def test_a_submitted_job_trains_to_completion(cluster, tmp_path):
    client = JobClient(cluster.api_client())
    config = job(tmp_path)
    created = client.submit(config)
    assert created[-1] == "Pod/job-master"
    status = wait_for_phase(client, config, ("Succeeded", "Failed"))
    assert status["phase"] == "Succeeded", (status, cluster.pod_log("job-master")[-3000:])
    assert sorted(status["workers"]) == ["job-worker-0", "job-worker-1", "job-worker-2"]
    assert_exactly_once(reports(tmp_path))
    assert len(reports(tmp_path)) == 3
    # The master exits 0 once the job is done, and says so in its log.
    KubeEmulator.wait_for(lambda: cluster.pod("job-master")["status"]["phase"] == "Succeeded", timeout=30)
    assert "job job succeeded: training finished" in client.logs("job", "default")


def test_a_deleted_worker_pod_is_relaunched_and_no_record_is_lost(cluster, tmp_path):
    client = JobClient(cluster.api_client())
    # The workers wait at step 30 until the job has 3 workers again in a third membership (formed,
    # worker gone, replacement joined): the deletion below always happens mid-training.
    config = job(tmp_path, config={"hold": {"at_step": 30, "size": 3, "version": 3}})
    client.submit(config)
    progress = tmp_path / "progress"
    KubeEmulator.wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 10, timeout=120)
    assert "worker-1: starting" in client.logs("job", "default", worker=1)  # a worker's log, while it runs
    client.core.delete_namespaced_pod("job-worker-1", "default")
    status = wait_for_phase(client, config, ("Succeeded", "Failed"))
    # A string, not a tuple: pytest shortens the repr of a tuple and would cut the logs.
    assert status["phase"] == "Succeeded", f"{status}\n{logs_of_all_pods(cluster)}"
    assert "job-worker-3" in status["workers"] and status["restarts"] == 1
    found = reports(tmp_path)
    assert "worker-3" in found and "worker-1" not in found
    assert_exactly_once(found)


def test_a_worker_exiting_1_is_not_relaunched_and_the_job_fails_with_the_reason(cluster, tmp_path):
    client = JobClient(cluster.api_client())
    config = job(tmp_path, config={"exit": {"rank:1": 5}}, min_workers=3)
    client.submit(config)
    status = wait_for_phase(client, config, ("Failed",))
    assert "exited with code 1" in status["message"] and "--relaunch-on-error" in status["message"]
    assert status["restarts"] == 0 and "job-worker-3" not in status["workers"]


def test_rbac_denied_is_a_clear_error_and_leaves_nothing_behind(cluster, tmp_path):
    cluster.deny("create", "pods")
    client = JobClient(cluster.api_client())
    with pytest.raises(
        KubernetesError, match=r"not allowed to create pods job-master in namespace 'default'.*forbidden"
    ):
        client.submit(job(tmp_path))
    assert client.core.list_namespaced_secret("default", label_selector="app.kubernetes.io/instance=job").items == []
    assert (
        client.core.list_namespaced_config_map("default", label_selector="app.kubernetes.io/instance=job").items == []
    )


def test_an_unknown_namespace_is_refused_before_anything_is_created(cluster, tmp_path):
    client = JobClient(cluster.api_client())
    with pytest.raises(ConfigError, match="--namespace='nowhere' does not exist"):
        client.submit(job(tmp_path, namespace="nowhere"))


def k8s_cli(kubeconfig, command, *args):
    return subprocess.run(
        [sys.executable, "-m", "elasticdl_strategy", "k8s", command, "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_command_line_submits_shows_logs_and_deletes_and_refuses_a_second_job(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    cluster.write_kubeconfig(kubeconfig)
    config = job(tmp_path, workers=1, min_workers=1)
    result = k8s_cli(kubeconfig, "submit", *submit_flags(config), "--", *config.command)
    assert result.returncode == 0, result.stderr
    assert "created Pod/job-master" in result.stdout and "job job submitted" in result.stdout
    again = k8s_cli(kubeconfig, "submit", *submit_flags(config), "--", *config.command)
    assert again.returncode == 2 and "already exists" in again.stderr
    KubeEmulator.wait_for(lambda: cluster.pod("job-worker-0"), timeout=60)
    status = k8s_cli(kubeconfig, "status", "job")
    assert status.returncode == 0 and "job job:" in status.stdout and "job-worker-0" in status.stdout
    logs = k8s_cli(kubeconfig, "logs", "job")
    assert logs.returncode == 0 and "coordinator serving on" in logs.stdout
    deleted = k8s_cli(kubeconfig, "delete", "job")
    assert deleted.returncode == 0 and "deleted" in deleted.stdout
    KubeEmulator.wait_for(lambda: not cluster.pods(label_selector="app.kubernetes.io/instance=job"), timeout=60)
    gone = k8s_cli(kubeconfig, "status", "job")
    assert gone.returncode == 2 and "no job 'job'" in gone.stderr


def test_pending_pods_do_not_block_the_others_and_duplicate_events_are_harmless(cluster, tmp_path):
    cluster.set_capacity(3)  # the master and two workers: the third worker stays Pending
    cluster.inject_duplicate_events(True)
    client = JobClient(cluster.api_client())
    config = job(tmp_path, workers=3, min_workers=2)
    client.submit(config)
    status = wait_for_phase(client, config, ("Succeeded", "Failed"))
    assert status["phase"] == "Succeeded", (status, cluster.pod_log("job-master")[-3000:])
    found = reports(tmp_path)
    assert len(found) == 2 and all(r["size"] == 2 for r in found.values())
    assert_exactly_once(found)
    assert status["restarts"] == 0
