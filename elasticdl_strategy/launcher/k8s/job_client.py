"""The user's side of a Kubernetes job: submit, status, logs, delete (``elasticdl-strategy k8s ...``)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import List, Optional

from elasticdl_strategy.errors import ConfigError, KubernetesError
from elasticdl_strategy.launcher.k8s import manifests
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig
from elasticdl_strategy.transport.auth import new_token

logger = logging.getLogger(__name__)


def _explain(error, verb: str, what: str, namespace: str) -> KubernetesError:
    status = getattr(error, "status", None)
    try:
        detail = json.loads(error.body).get("message", "") if getattr(error, "body", None) else ""
    except ValueError:
        detail = ""
    detail = detail or getattr(error, "reason", "") or str(error)
    where = f" in namespace {namespace!r}" if namespace else ""
    if status == 403:
        return KubernetesError(
            f"not allowed to {verb} {what}{where}: {detail}. Your Kubernetes user needs "
            f"that permission (`kubectl auth can-i {verb} {what.split()[0]} -n {namespace}`)"
        )
    if status == 401:
        return KubernetesError(f"the Kubernetes API rejected the credentials: {detail} (check your kubeconfig)")
    return KubernetesError(f"could not {verb} {what}{where}: {status} {detail}")


def _discovery_cache_file(host: str) -> Optional[str]:
    """Where the dynamic client caches the cluster's API discovery: a directory only this user can
    write, like kubectl's ``~/.kube/cache`` (the library's default is a shared temporary directory)."""
    directory = os.path.join(os.path.expanduser("~"), ".kube", "cache", "elasticdl-strategy")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError:
        return None  # the library's default
    return os.path.join(directory, f"discovery-{hashlib.sha256(host.encode()).hexdigest()[:16]}.json")


class JobClient:
    """Submits and controls jobs through a ``kubernetes.client.ApiClient``.

    The job's objects are created, patched, listed and deleted through the
    client's ``DynamicClient`` (one code path for every kind, found by
    discovery); status and logs use the typed core API.

    Example::

        client = JobClient(kubernetes.client.ApiClient())
        client.submit(K8sJobConfig(name="mnist", image="registry/edl:0.1", command=("python", "train.py"), workers=3))
        print(client.status("mnist", "default"))
    """

    def __init__(self, api_client):
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)

    @functools.cached_property
    def _dynamic(self):
        from kubernetes.client.exceptions import ApiException
        from kubernetes.dynamic import DynamicClient

        try:
            return DynamicClient(self.api_client, cache_file=_discovery_cache_file(self.api_client.configuration.host))
        except ApiException as e:
            raise _explain(e, "discover", "the API's resources", "") from None

    def _resource(self, api_version: str, kind: str):
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self._dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            raise KubernetesError(f"the cluster does not serve {kind} in {api_version}") from None

    # ---- submit -----------------------------------------------------------------------------

    def check_namespace(self, namespace: str) -> None:
        """Raises ConfigError when ``namespace`` does not exist (unknown if reading namespaces is forbidden)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_namespace(namespace)
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(f"--namespace={namespace!r} does not exist") from None
            if e.status != 403:
                raise _explain(e, "get", "namespaces", namespace) from None

    def submit(self, config: K8sJobConfig) -> List[str]:
        """Creates the job's objects (the master creates the workers); returns ``Kind/name`` of each.

        Nothing is left behind on failure: objects created before it are deleted.

        Raises:
            ConfigError: the namespace does not exist, or a job of that name does.
            KubernetesError: the API refused a request (e.g. RBAC), with what to check.
        """
        from kubernetes.client.exceptions import ApiException

        self.check_namespace(config.namespace)
        objects = manifests.job_objects(config, new_token())
        created: List[dict] = []
        try:
            for obj in objects:
                kind, name = obj["kind"], obj["metadata"]["name"]
                try:
                    result = self._resource(obj["apiVersion"], kind).create(body=obj, namespace=config.namespace)
                except ApiException as e:
                    if e.status == 409:
                        raise ConfigError(
                            f"job {config.name!r} already exists in namespace {config.namespace!r} ({kind} {name}); "
                            f"delete it first: elasticdl-strategy k8s delete {config.name} -n {config.namespace}"
                        ) from None
                    raise _explain(e, "create", f"{kind.lower()}s {name}", config.namespace) from None
                created.append(obj)
            self._adopt(config, result.metadata.uid, created[:-1])
        except BaseException:
            self._delete_objects(config.namespace, reversed(created))
            raise
        return [f"{o['kind']}/{o['metadata']['name']}" for o in created]

    def _adopt(self, config: K8sJobConfig, master_uid: str, objects: List[dict]) -> None:
        """Makes the master pod own the job's other objects, so that deleting it removes the job."""
        from kubernetes.client.exceptions import ApiException

        owner = {"ownerReferences": [manifests.owner_reference({"name": config.master_name, "uid": master_uid})]}
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                self._resource(obj["apiVersion"], kind).patch(
                    name=name,
                    namespace=config.namespace,
                    body={"metadata": owner},
                    content_type="application/merge-patch+json",
                )
            except ApiException as e:
                raise _explain(e, "patch", f"{kind.lower()}s {name}", config.namespace) from None

    def _delete_objects(self, namespace: str, objects) -> None:
        from kubernetes.client.exceptions import ApiException

        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                self._resource(obj["apiVersion"], kind).delete(name=name, namespace=namespace)
            except ApiException as e:
                if e.status != 404:
                    logger.warning("could not delete %s %s: %s", kind, name, e.reason)

    # ---- control ----------------------------------------------------------------------------

    def status(self, name: str, namespace: str) -> dict:
        """The job's phase, message, membership version and workers (name, phase, exit code, restarts).

        Raises:
            ConfigError: no such job.
        """
        from kubernetes.client.exceptions import ApiException

        try:
            data = self.core.read_namespaced_config_map(f"{name}-status", namespace).data or {}
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(f"no job {name!r} in namespace {namespace!r}") from None
            raise _explain(e, "get", "configmaps", namespace) from None
        try:
            pods = self.core.list_namespaced_pod(
                namespace, label_selector=f"{manifests.INSTANCE_LABEL}={name},{manifests.NAME_LABEL}={manifests.APP}"
            )
        except ApiException as e:
            raise _explain(e, "list", "pods", namespace) from None
        live = {
            p.metadata.name: {
                "phase": p.status.phase if p.status else "Unknown",
                "restarts": sum(c.restart_count for c in (p.status.container_statuses or [])) if p.status else 0,
            }
            for p in pods.items
        }
        return {
            "job": name,
            "phase": data.get("phase", "Unknown"),
            "message": data.get("message", ""),
            "membership_version": int(data.get("membership_version", "0") or 0),
            "restarts": int(data.get("restarts", "0") or 0),
            "workers": json.loads(data.get("workers", "{}") or "{}"),
            "workers_not_listed": int(data.get("workers_not_listed", "0") or 0),
            "pods": live,
        }

    def logs(self, name: str, namespace: str, worker: Optional[int] = None, tail: Optional[int] = None) -> str:
        """The log of the master (default) or of worker pod ``worker``."""
        from kubernetes.client.exceptions import ApiException

        pod = f"{name}-master" if worker is None else f"{name}-worker-{worker}"
        kwargs = {"tail_lines": tail} if tail else {}
        try:
            return self.core.read_namespaced_pod_log(pod, namespace, **kwargs)
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(f"no pod {pod!r} in namespace {namespace!r}") from None
            raise _explain(e, "get", "pods/log", namespace) from None

    def delete(self, name: str, namespace: str) -> int:
        """Deletes every object of the job, pods first; returns how many it had (0: no such job).

        All are listed before any is deleted: deleting the master pod makes the cluster's
        garbage collector remove the objects it owns, perhaps before they would be listed.
        """
        from kubernetes.client.exceptions import ApiException

        selector = f"{manifests.INSTANCE_LABEL}={name},{manifests.NAME_LABEL}={manifests.APP}"
        objects = []
        for api_version, kind in reversed(manifests.JOB_KINDS):
            try:
                items = self._resource(api_version, kind).get(namespace=namespace, label_selector=selector).items
            except ApiException as e:
                raise _explain(e, "list", f"{kind.lower()}s", namespace) from None
            objects += [{"apiVersion": api_version, "kind": kind, "metadata": {"name": i.metadata.name}} for i in items]
        self._delete_objects(namespace, objects)
        return len(objects)


def format_status(status: dict) -> str:
    """``k8s status`` output, like kubectl's tables."""
    lines = [
        f"job {status['job']}: {status['phase']} ({status['message']})",
        f"membership version {status['membership_version']}, {status['restarts']} worker restart(s)",
        f"{'POD':<40} {'PHASE':<12} {'RESTARTS':<9} {'EXIT':<5} REASON",
    ]
    if status.get("workers_not_listed"):
        lines.insert(2, f"({status['workers_not_listed']} earlier ended worker pods are counted, not listed)")
    names = sorted(set(status["workers"]) | set(status["pods"]))
    for name in names:
        worker = status["workers"].get(name, {})
        pod = status["pods"].get(name, {})
        phase = pod.get("phase") or worker.get("phase", "Deleted")
        exit_code = worker.get("exit_code")
        lines.append(
            f"{name:<40} {phase:<12} {pod.get('restarts', 0):<9} {'' if exit_code is None else exit_code!s:<5} "
            f"{worker.get('reason', '')}"
        )
    return "\n".join(lines)
