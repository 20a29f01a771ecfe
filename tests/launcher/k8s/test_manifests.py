"""The job's Kubernetes objects: valid against the OpenAPI schemas, least privilege, secrets by reference."""

import base64
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher.arguments import split_command
from elasticdl_strategy.launcher.k8s import manifests
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from tests.launcher.k8s.flags import submit_flags

# Kubernetes versions the manifests are checked against (native gRPC probes need 1.24+).
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]

FULL = K8sJobConfig(
    name="mnist",
    image="registry.example.com/edl:0.1",
    command=("python", "train.py", "--epochs", "3"),
    workers=3,
    min_workers=2,
    max_workers=4,
    namespace="ml",
    cpu="2",
    memory="4Gi",
    gpu=1,
    env=(("LOG_LEVEL", "info"),),
    max_restarts=5,
    priority_class="high-priority",
    shared_memory_host_path="/dev/shm/edl-mnist",
)
MINIMAL = K8sJobConfig(name="a", image="edl", command=("python", "x.py"), workers=1)


def all_objects(config):
    worker = manifests.worker_pod(config, 7, "10.1.2.3:50051", {"name": config.master_name, "uid": "1234-abcd"})
    return manifests.job_objects(config, "t" * 43) + [worker]


@pytest.mark.parametrize("config", [FULL, MINIMAL], ids=["full", "minimal"])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(config, version):
    for obj in all_objects(config):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_printed_manifest_is_what_submit_creates_and_validates():
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl_strategy", "k8s", "manifest", *submit_flags(FULL), "--", *FULL.command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in documents] == [o["kind"] for o in manifests.job_objects(FULL, "x")]
    for document in documents:
        kubernetes_validate.validate(document, VERSIONS[-1], strict=True)


def test_the_master_may_do_only_what_it_needs():
    rules = manifests.role(FULL)["rules"]
    assert rules == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["mnist-status"],
            "verbs": ["get", "update", "patch"],
        },
    ]
    binding = manifests.role_binding(FULL)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mnist-master", "namespace": "ml"}]
    assert manifests.master_pod(FULL)["spec"]["serviceAccountName"] == "mnist-master"


def test_the_token_lives_in_a_secret_and_pods_reference_it():
    secret = manifests.token_secret(FULL, "s3cret-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"
    for pod in (manifests.master_pod(FULL), manifests.worker_pod(FULL, 0, "h:1", {"name": "m", "uid": "u"})):
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["EDL_JOB_TOKEN"] == {
            "name": "EDL_JOB_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "mnist-token", "key": "token"}},
        }
        assert "s3cret-token" not in yaml.safe_dump(pod)


def test_worker_pods_are_labelled_owned_probed_and_sized():
    pod = manifests.worker_pod(FULL, 7, "10.1.2.3:50051", {"name": "mnist-master", "uid": "1234-abcd"})
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "mnist-worker-7"
    assert meta["labels"]["app.kubernetes.io/name"] == "elasticdl-strategy"
    assert meta["labels"]["app.kubernetes.io/instance"] == "mnist"
    assert meta["labels"]["app.kubernetes.io/component"] == "worker"
    assert meta["labels"]["elasticdl-strategy/worker-id"] == "7"
    assert meta["ownerReferences"][0]["uid"] == "1234-abcd" and meta["ownerReferences"][0]["controller"]
    container = spec["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["EDL_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # downward API
    assert env["EDL_ADVERTISE_HOST"]["value"] == "$(EDL_POD_IP)"
    assert env["EDL_HOST_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}  # pods of a node: one host
    assert env["EDL_WORKER_ID"]["value"] == "worker-7" and env["LOG_LEVEL"]["value"] == "info"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50052}
    # Fixed ports, declared: the peer server and the direct data sockets beside it.
    assert (env["EDL_PEER_PORT"]["value"], env["EDL_DATA_PORT"]["value"]) == ("50052", "50053")
    assert {p["containerPort"] for p in container["ports"]} == {50052, 50053}
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert spec["terminationGracePeriodSeconds"] == 60 and spec["restartPolicy"] == "Never"
    assert spec["priorityClassName"] == "high-priority"
    assert container["securityContext"]["runAsNonRoot"] and spec["automountServiceAccountToken"] is False


def test_a_worker_pod_with_a_gpu_gives_it_to_its_one_worker_process():
    pod = manifests.worker_pod(FULL, 0, "10.1.2.3:50051")
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in container["resources"]["requests"]  # extended resources: the limit is the request
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["EDL_LOCAL_RANK"], env["EDL_LOCAL_SIZE"]) == ("0", "1")
    # The device plugin isolates the pod's GPU: nothing narrows the GPUs the worker sees.
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env
    assert master_config(FULL).gpu == 1  # the master recreates the same pods

    plain = manifests.worker_pod(MINIMAL, 0, "10.1.2.3:50051")["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in plain["resources"]["limits"]


def test_more_than_one_gpu_per_worker_pod_is_refused_with_what_to_do_instead():
    with pytest.raises(ConfigError) as refused:
        dataclasses.replace(FULL, gpu=4)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("--gpu=4: each worker pod runs one worker process, which uses one GPU")
    assert "(e.g. --workers 12 --gpu 1)" in message


def test_workers_share_a_node_directory_for_shared_memory_only_when_asked():
    pod = manifests.worker_pod(FULL, 0, "10.1.2.3:50051")
    container, spec = pod["spec"]["containers"][0], pod["spec"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EDL_SHM_DIR"] == "/edl-shm"
    assert container["volumeMounts"] == [{"name": "edl-shared-memory", "mountPath": "/edl-shm"}]
    assert spec["volumes"][0]["hostPath"] == {"path": "/dev/shm/edl-mnist", "type": "DirectoryOrCreate"}
    assert master_config(FULL).shared_memory_host_path == FULL.shared_memory_host_path  # so does the master

    plain = manifests.worker_pod(MINIMAL, 0, "10.1.2.3:50051")
    assert "volumes" not in plain["spec"] and "volumeMounts" not in plain["spec"]["containers"][0]
    assert "EDL_SHM_DIR" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}
    with pytest.raises(ConfigError, match="shared-memory-host-path='shm'"):
        K8sJobConfig(name="a", image="edl", command=("x",), workers=1, shared_memory_host_path="shm")


def test_the_master_service_is_headless_and_selects_the_master():
    service = manifests.master_service(FULL)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/instance": "mnist",
        "app.kubernetes.io/component": "master",
    }


def test_the_rendered_example_in_examples_k8s_validates():
    import glob
    import os

    from tests.launch import REPO_ROOT

    paths = glob.glob(os.path.join(REPO_ROOT, "examples", "k8s", "*.yaml"))
    assert paths
    for path in paths:
        with open(path) as f:
            documents = list(yaml.safe_load_all(f))
        assert {d["kind"] for d in documents} >= {"Pod", "Secret", "Service", "Role", "RoleBinding", "ServiceAccount"}
        for document in documents:
            kubernetes_validate.validate(document, VERSIONS[-1], strict=True)


def test_the_example_in_examples_k8s_is_what_k8s_manifest_renders_today():
    from tests.launch import REPO_ROOT

    path = Path(REPO_ROOT, "examples", "k8s", "mnist.yaml")
    flags = shlex.split(" ".join(line.lstrip("#").strip().rstrip("\\") for line in path.read_text().splitlines()[:3]))
    assert flags[:3] == ["Rendered", "by:", "elasticdl-strategy"], flags[:3]
    options, command = split_command(flags[5:])  # after "elasticdl-strategy k8s manifest"
    from elasticdl_strategy.launcher.k8s import cli

    config, _ = cli._config(cli._job_parser("manifest"), [*options, "--", *command])
    rendered = list(yaml.safe_load_all(manifests.render_yaml(config, token="x")))
    example = list(yaml.safe_load_all(path.read_text()))
    for document in rendered + example:
        if document["kind"] == "Secret":
            document["data"] = {}  # the example's token is left empty on purpose
    assert example == rendered


def master_config(config):
    """The configuration the master pod of ``config`` reads (its EDL_JOB_CONFIG)."""
    container = manifests.master_pod(config)["spec"]["containers"][0]
    assert container["command"] == ["elasticdl-strategy", "k8s", "master"]  # no flags: the config is data
    env = {e["name"]: e.get("value") for e in container["env"]}
    return K8sJobConfig.from_json(env["EDL_JOB_CONFIG"])


@pytest.mark.parametrize("config", [FULL, MINIMAL], ids=["full", "minimal"])
def test_the_master_reads_the_submitted_config_as_data(config):
    assert master_config(config) == config


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "Expecting value"),
        ("{}", "'command'"),
        (MINIMAL.to_json().replace('"workers": 1', '"workers": 0'), "--workers=0"),
    ],
)
def test_a_master_config_that_is_not_one_is_a_one_line_error(text, says):
    with pytest.raises(ConfigError, match="EDL_JOB_CONFIG|--workers=0") as refused:
        K8sJobConfig.from_json(text)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_master_command_refuses_flags_and_a_missing_config_in_one_line():
    for argv, env, says in [
        (["--name", "x"], {"EDL_JOB_CONFIG": MINIMAL.to_json()}, "the master takes no arguments"),
        ([], {}, "EDL_JOB_CONFIG is not set"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "elasticdl_strategy", "k8s", "master", *argv],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if k != "EDL_JOB_CONFIG"} | env,
        )  # fmt: skip
        assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr
