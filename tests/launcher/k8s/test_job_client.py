"""JobClient against the emulated API server: the job's objects through the dynamic client.

The cluster has no capacity for pods, so the master pod stays Pending and nothing runs: these
tests see only what ``submit`` and ``delete`` do to the API objects.
"""

import pytest

from elasticdl_strategy.errors import KubernetesError
from elasticdl_strategy.launcher.k8s import manifests
from elasticdl_strategy.launcher.k8s.job_client import JobClient
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from tests.launcher.k8s.emulator import RESOURCES, KubeEmulator

SELECTOR = "app.kubernetes.io/instance=job"
PLURALS = {rt.kind: rt.plural for rt in RESOURCES.values() if rt.kind in {kind for _, kind in manifests.JOB_KINDS}}


@pytest.fixture
def cluster():
    with KubeEmulator() as emulator:
        emulator.set_capacity(0)
        yield emulator


@pytest.fixture
def client(cluster):
    with cluster.api_client() as api_client:
        yield JobClient(api_client)


def config(**kwargs):
    return K8sJobConfig(name="job", image="edl:test", command=("python", "train.py"), workers=2, **kwargs)


def job_objects(cluster):
    """(kind, name, owner names) of every object of the job on the server."""
    found = []
    for kind, plural in PLURALS.items():
        for obj in cluster.objects(plural, "default", label_selector=SELECTOR):
            owners = [ref["name"] for ref in obj["metadata"].get("ownerReferences", [])]
            found.append((kind, obj["metadata"]["name"], owners))
    return sorted(found)


def test_submit_creates_every_object_owned_by_the_master_and_delete_removes_them(cluster, client):
    created = client.submit(config())
    assert created == [
        "ServiceAccount/job-master", "Role/job-master", "RoleBinding/job-master", "Secret/job-token",
        "ConfigMap/job-status", "Service/job-master", "Pod/job-master",
    ]  # fmt: skip
    objects = job_objects(cluster)
    assert len(objects) == 7
    for kind, name, owners in objects:
        assert owners == ([] if (kind, name) == ("Pod", "job-master") else ["job-master"]), (kind, name)
    assert client.delete("job", "default") == 7
    assert job_objects(cluster) == []
    assert client.delete("job", "default") == 0


def test_a_refused_create_deletes_what_was_created_before(cluster, client):
    cluster.deny("create", "services")
    with pytest.raises(KubernetesError, match=r"not allowed to create services job-master in namespace 'default'"):
        client.submit(config())
    assert job_objects(cluster) == []


def test_the_kinds_delete_looks_for_are_those_submit_creates():
    objects = manifests.job_objects(config(), "token")
    assert [(o["apiVersion"], o["kind"]) for o in objects] == list(manifests.JOB_KINDS)
