"""The Kubernetes objects of a job, as plain dicts (what ``submit`` creates and ``manifest`` prints).

Objects of job ``J`` in namespace ``N``:

* ServiceAccount, Role and RoleBinding ``J-master``: the master may
  get/list/watch/create/delete pods and get/update/patch its status ConfigMap,
  nothing else.
* Secret ``J-token``: the job token, given to pods by ``secretKeyRef``.
* ConfigMap ``J-status``: the job's status, written by the master
  (``kubectl get configmap J-status -o yaml``).
* Service ``J-master``: headless, a stable DNS name for the coordinator.
* Pod ``J-master``: the coordinator and the pod manager.
* Pods ``J-worker-<i>``: created by the master, owned by it (deleting the
  master deletes the job).
"""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Optional

from elasticdl_strategy import environment
from elasticdl_strategy.launcher.k8s.job_config import (
    COORDINATOR_PORT,
    DATA_PORT,
    JOB_CONFIG_VARIABLE,
    WORKER_PORT,
    K8sJobConfig,
)

Manifest = Dict[str, Any]

APP = "elasticdl-strategy"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "app.kubernetes.io/component"
WORKER_ID_LABEL = "elasticdl-strategy/worker-id"
TOKEN_KEY = "token"
RUN_AS_USER = 10001  # the Dockerfile's non-root user
SHARED_MEMORY_MOUNT = "/edl-shm"  # where --shared-memory-host-path appears in worker pods


def labels(config: K8sJobConfig, role: Optional[str] = None, **extra: str) -> Dict[str, str]:
    result = {NAME_LABEL: APP, INSTANCE_LABEL: config.name, "app.kubernetes.io/managed-by": APP}
    if role:
        result[ROLE_LABEL] = role
    result.update(extra)
    return result


def selector(config: K8sJobConfig, role: Optional[str] = None) -> str:
    """A label selector for the job's objects (of one role)."""
    parts = [f"{NAME_LABEL}={APP}", f"{INSTANCE_LABEL}={config.name}"]
    if role:
        parts.append(f"{ROLE_LABEL}={role}")
    return ",".join(parts)


def _metadata(config: K8sJobConfig, name: str, role: Optional[str] = None, **extra_labels: str) -> Manifest:
    return {"name": name, "namespace": config.namespace, "labels": labels(config, role, **extra_labels)}


def _field_env(name: str, path: str) -> Manifest:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _token_env(config: K8sJobConfig) -> Manifest:
    return {"name": "EDL_JOB_TOKEN", "valueFrom": {"secretKeyRef": {"name": config.secret_name, "key": TOKEN_KEY}}}


def _security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _grpc_probes(port: int, startup_seconds: int) -> Manifest:
    """Native gRPC probes (grpc.health.v1): generous at startup (image pull, TensorFlow import)."""
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": max(1, startup_seconds // 5)},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def service_account(config: K8sJobConfig) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(config, config.master_name, "master")}


def role(config: K8sJobConfig) -> Manifest:
    """Least privilege for the master: its worker pods and its status ConfigMap."""
    return {
        "apiVersion": RBAC_V1,
        "kind": "Role",
        "metadata": _metadata(config, config.master_name, "master"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [config.status_name],
                "verbs": ["get", "update", "patch"],
            },
        ],
    }


def role_binding(config: K8sJobConfig) -> Manifest:
    return {
        "apiVersion": RBAC_V1,
        "kind": "RoleBinding",
        "metadata": _metadata(config, config.master_name, "master"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": config.master_name},
        "subjects": [{"kind": "ServiceAccount", "name": config.master_name, "namespace": config.namespace}],
    }


def token_secret(config: K8sJobConfig, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(config, config.secret_name),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def status_config_map(config: K8sJobConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(config, config.status_name),
        "data": {"phase": "Pending", "message": "submitted", "workers": "{}", "membership_version": "0"},
    }


def master_service(config: K8sJobConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, config.master_name, "master"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {INSTANCE_LABEL: config.name, ROLE_LABEL: "master"},
            "ports": [{"name": "grpc-coordinator", "port": COORDINATOR_PORT, "targetPort": COORDINATOR_PORT}],
        },
    }


def master_pod(config: K8sJobConfig) -> Manifest:
    """The master: ``elasticdl-strategy k8s master``, its job's configuration in ``EDL_JOB_CONFIG``
    (as data: nothing is turned back into flags); restarted in place on failure."""
    container = {
        "name": "master",
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["elasticdl-strategy", "k8s", "master"],
        "env": [
            {"name": JOB_CONFIG_VARIABLE, "value": config.to_json()},
            _token_env(config),
            _field_env("EDL_POD_NAME", "metadata.name"),
            _field_env("EDL_POD_UID", "metadata.uid"),
            _field_env("EDL_POD_IP", "status.podIP"),
        ],
        "ports": [{"name": "grpc", "containerPort": COORDINATOR_PORT}],
        "resources": {
            "requests": {"cpu": config.master_cpu, "memory": config.master_memory},
            "limits": {"cpu": config.master_cpu, "memory": config.master_memory},
        },
        "securityContext": _security_context(),
        **_grpc_probes(COORDINATOR_PORT, startup_seconds=120),
    }
    spec: Manifest = {
        "serviceAccountName": config.master_name,
        "restartPolicy": "OnFailure",
        "containers": [container],
        "terminationGracePeriodSeconds": 30,
    }
    if config.priority_class:
        spec["priorityClassName"] = config.priority_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(config, config.master_name, "master"),
        "spec": spec,
    }


def worker_pod(
    config: K8sJobConfig, index: int, coordinator_address: str, owner: Optional[Manifest] = None
) -> Manifest:
    """Worker ``index`` (worker id ``worker-<index>``), owned by the master pod ``owner``
    (``{"name": ..., "uid": ...}``; omitted in printed manifests, where the master does not exist yet)."""
    resources: Manifest = {
        "requests": {"cpu": config.cpu, "memory": config.memory},
        "limits": {"cpu": config.cpu, "memory": config.memory},
    }
    if config.gpu:
        resources["limits"]["nvidia.com/gpu"] = str(config.gpu)
    env: List[Manifest] = [
        {"name": "EDL_COORDINATOR_ADDR", "value": coordinator_address},
        {"name": "EDL_WORKER_ID", "value": f"worker-{index}"},
        _token_env(config),
        _field_env("EDL_POD_IP", "status.podIP"),
        {"name": "EDL_BIND_HOST", "value": "$(EDL_POD_IP)"},
        {"name": "EDL_ADVERTISE_HOST", "value": "$(EDL_POD_IP)"},
        # Pods of one node are one host to the hierarchical all-reduce (with --shared-memory-host-path
        # they share its memory too).
        _field_env(environment.HOST_ID, "spec.nodeName"),
        {"name": "EDL_PEER_PORT", "value": str(WORKER_PORT)},
        {"name": "EDL_DATA_PORT", "value": str(DATA_PORT)},
        {"name": "EDL_RENDEZVOUS_TIMEOUT", "value": f"{config.rendezvous_timeout_s:g}"},
        # One worker process per pod: with --gpu 1 it uses the pod's one GPU, which the device
        # plugin already isolates (the container sees only it), so nothing else is set for it.
        {"name": environment.LOCAL_RANK, "value": "0"},
        {"name": environment.LOCAL_SIZE, "value": "1"},
        *({"name": key, "value": value} for key, value in config.env),
    ]
    container = {
        "name": "worker",
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": list(config.command),
        "env": env,
        "ports": [
            {"name": "grpc-peer", "containerPort": WORKER_PORT},
            {"name": "data-peer", "containerPort": DATA_PORT},
        ],
        "resources": resources,
        "securityContext": _security_context(),
        **_grpc_probes(WORKER_PORT, startup_seconds=600),
    }
    spec: Manifest = {
        "restartPolicy": "Never",  # the master relaunches failed workers as new pods
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": config.termination_grace_s,  # time to commit and leave on SIGTERM
        "containers": [container],
    }
    if config.shared_memory_host_path:
        # Workers on one node see each other's arenas here; elsewhere offers are refused and gRPC carries the data.
        env.append({"name": "EDL_SHM_DIR", "value": SHARED_MEMORY_MOUNT})
        container["volumeMounts"] = [{"name": "edl-shared-memory", "mountPath": SHARED_MEMORY_MOUNT}]
        spec["volumes"] = [
            {
                "name": "edl-shared-memory",
                "hostPath": {"path": config.shared_memory_host_path, "type": "DirectoryOrCreate"},
            }
        ]
    if config.priority_class:
        spec["priorityClassName"] = config.priority_class
    metadata = _metadata(config, config.worker_name(index), "worker", **{WORKER_ID_LABEL: str(index)})
    if owner is not None:
        metadata["ownerReferences"] = [owner_reference(owner)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def owner_reference(owner: Manifest) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": owner["name"],
        "uid": owner["uid"],
        "controller": True,
        # True would need update on pods/finalizers where OwnerReferencesPermissionEnforcement is on.
        "blockOwnerDeletion": False,
    }


RBAC_V1 = "rbac.authorization.k8s.io/v1"
# (apiVersion, kind) of the objects of a job, in the order job_objects creates them (worker pods are Pods).
JOB_KINDS = (
    ("v1", "ServiceAccount"),
    (RBAC_V1, "Role"),
    (RBAC_V1, "RoleBinding"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "Pod"),
)


def job_objects(config: K8sJobConfig, token: str) -> List[Manifest]:
    """Everything ``submit`` creates, in creation order (the master pod last)."""
    return [
        service_account(config),
        role(config),
        role_binding(config),
        token_secret(config, token),
        status_config_map(config),
        master_service(config),
        master_pod(config),
    ]


def render_yaml(config: K8sJobConfig, token: Optional[str] = None) -> str:
    """The YAML ``kubectl apply -f`` takes: every object of :func:`job_objects` (with a fresh token).

    Worker pods are not included: the master creates them.
    """
    import yaml

    from elasticdl_strategy.transport.auth import new_token

    documents = job_objects(config, token or new_token())
    header = (
        f"# elasticdl_strategy job {config.name!r}: the master pod creates {config.workers} worker pod(s)\n"
        "# ({name}-worker-<i>) and relaunches them; kubectl delete pod {name}-master removes the job.\n"
    ).format(name=config.name)
    return header + yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
