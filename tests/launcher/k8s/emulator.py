"""A test-only Kubernetes API server and kubelet that the official ``kubernetes`` client talks to, unchanged.

``KubeEmulator`` serves the Kubernetes REST and watch protocol over plain HTTP on 127.0.0.1 (bearer token
authentication, HTTP/1.1 keep-alive, chunked watch streams) and plays the kubelet on the local machine:
the first container of every pod runs as a local process (``command + args``) in its own session, with
its own loopback IP (127.0.0.2, 127.0.0.3, ...) and its output kept as the pod's log.

    with KubeEmulator() as emu, emu.api_client() as api_client:
        core = kubernetes.client.CoreV1Api(api_client)
        core.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {...}})
        emu.wait_for(lambda: emu.pod("p")["status"]["phase"] == "Succeeded")

What is emulated, as a real cluster does it:

* core/v1 pods (with ``/status``, ``/log`` and ``/eviction``), services, secrets, configmaps,
  serviceaccounts and namespaces; rbac.authorization.k8s.io/v1 roles and rolebindings; the discovery
  documents that list them (``/api``, ``/api/v1``, ``/apis``, ...), which the dynamic client reads. Create, get, list
  (label and field selectors, ``limit``/``continue``), watch, replace, patch (JSON merge patch, strategic
  merge patch taken as a JSON merge patch, JSON patch), delete and deletecollection, with the server's
  Status errors (NotFound, AlreadyExists, Conflict, Forbidden, Expired, Invalid, Unauthorized).
* One global resourceVersion, a bounded watch history (``history_limit``, ``compact()``): a watch from a
  version older than the history gets one ERROR event with a 410 Expired Status.
* Pods: scheduling against ``set_capacity``, the downward API, Secret and ConfigMap env, ``$(VAR)``
  expansion, restart policies with a back-off, graceful deletion (SIGTERM, SIGKILL after the grace
  period), OOM kills and evictions, owner-reference garbage collection.
* ``requests``: how many requests were served, by verb and resource (``("patch", "configmaps")``), to
  count what a controller costs the API server.

What is not: admission beyond the ServiceAccount check, RBAC evaluation (``deny``/``allow`` stand in for
it), server-side apply, finalizers, volumes, probes, init and sidecar containers (only the first container
runs), DNS for services, log timestamps.
"""

from __future__ import annotations

import base64
import collections
import copy
import datetime
import http.server
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    import kubernetes.client

logger = logging.getLogger(__name__)

T = TypeVar("T")
Obj = dict[str, Any]
Key = tuple[str, str, str]  # (resource plural, namespace ("" when cluster-scoped), name)

RBAC = "rbac.authorization.k8s.io"
NODE_NAME = "emulator-node"
HOST_IP = "127.0.0.1"
BOOKMARK_INTERVAL_S = 1.0
_POLL_S = 0.02
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the API server draws generateName suffixes from
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_ALNUM_ENDS = "and must start and end with an alphanumeric character"
_RBAC_NAME = re.compile(r"[^/%]+")
_NAME_RULES: dict[str, tuple[re.Pattern[str], int, str]] = {
    "namespaces": (
        _DNS_LABEL,
        63,
        f"a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', {_ALNUM_ENDS}",
    ),
    "services": (
        _DNS_1035_LABEL,
        63,
        "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
        "character, and end with an alphanumeric character",
    ),
    "roles": (_RBAC_NAME, 253, "may not contain '/' or '%'"),
    "rolebindings": (_RBAC_NAME, 253, "may not contain '/' or '%'"),
    "*": (
        _DNS_SUBDOMAIN,
        253,
        f"a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', {_ALNUM_ENDS}",
    ),
}
_MSG_LABEL_KEY = f"name part must consist of alphanumeric characters, '-', '_' or '.', {_ALNUM_ENDS}"
_MSG_LABEL_VALUE = (
    f"a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', {_ALNUM_ENDS}"
)
_MSG_UNSCHEDULABLE = (
    "0/1 nodes are available: 1 Too many pods. "
    "preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod."
)
_MSG_POD_UPDATE = (
    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing "
    "tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)
_MSG_CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results."
)
_MSG_NO_RESOURCE = "the server could not find the requested resource"
_POD_SPEC_DEFAULTS: Obj = {
    "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
    "schedulerName": "default-scheduler", "securityContext": {}, "enableServiceLinks": True, "priority": 0,
    "preemptionPolicy": "PreemptLowerPriority",
}  # fmt: skip
_SERVICE_SPEC_DEFAULTS: Obj = {
    "type": "ClusterIP", "sessionAffinity": "None", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
    "internalTrafficPolicy": "Cluster",
}  # fmt: skip
_VERSION: Obj = {
    "major": "1", "minor": "33", "gitVersion": "v1.33.0-emulator", "gitCommit": "emulator", "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64",
}  # fmt: skip
_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)


def _now(offset: float = 0.0) -> str:
    """An RFC 3339 timestamp (second precision, UTC) as the API server writes them."""
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("true", "1")


# --------------------------------------------------------------------------------------------------------------
# Resources and errors


@dataclass(frozen=True)
class ResourceType:
    """A kind the emulator serves, with what differs between kinds on the real server."""

    plural: str
    kind: str
    group: str = ""
    namespaced: bool = True
    delete_returns_object: bool = False  # else a Status
    has_status: bool = False  # status is only written through /status (or by the emulator)

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"

    @property
    def qualified(self) -> str:
        """The resource as error messages name it: ``pods``, ``roles.rbac.authorization.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES: dict[str, ResourceType] = {
    rt.plural: rt
    for rt in (
        ResourceType("pods", "Pod", delete_returns_object=True, has_status=True),
        ResourceType("services", "Service", delete_returns_object=True, has_status=True),
        ResourceType("serviceaccounts", "ServiceAccount", delete_returns_object=True),
        ResourceType("secrets", "Secret"),
        ResourceType("configmaps", "ConfigMap"),
        ResourceType("namespaces", "Namespace", namespaced=False, delete_returns_object=True, has_status=True),
        ResourceType("roles", "Role", RBAC),
        ResourceType("rolebindings", "RoleBinding", RBAC),
    )
}
PODS, NAMESPACES = RESOURCES["pods"], RESOURCES["namespaces"]
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def _api_group(group: str) -> Obj:
    """Discovery: an API group with its one version, v1 (``/apis``, ``/apis/GROUP``)."""
    version = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [version], "preferredVersion": version}


def _api_resources(group: str) -> Obj:
    """Discovery: the APIResourceList of ``group``'s v1 (``/api/v1``, ``/apis/GROUP/v1``), subresources included."""
    resources: list[Obj] = []
    for rt in RESOURCES.values():
        if rt.group != group:
            continue
        resources.append(
            {"name": rt.plural, "singularName": rt.kind.lower(), "namespaced": rt.namespaced, "kind": rt.kind,
             "verbs": _VERBS}
        )  # fmt: skip
        if rt.has_status:
            resources.append(
                {"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced, "kind": rt.kind,
                 "verbs": ["get", "patch", "update"]}
            )  # fmt: skip
    if group == "":
        resources += [
            {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get"]},
            {"name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy", "version": "v1",
             "kind": "Eviction", "verbs": ["create"]},
        ]  # fmt: skip
    group_version = f"{group}/v1" if group else "v1"
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


_FIELDS: dict[str, frozenset[str]] = {
    "pods": frozenset(
        ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName")
        + ("status.phase", "status.podIP", "status.nominatedNodeName")
    ),
    "secrets": frozenset(("type",)),
    "namespaces": frozenset(("status.phase",)),
}


class ApiError(Exception):
    """An error answered as a ``Status`` object, as the API server does."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body.update(message=self.message, reason=self.reason, code=self.code)
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> Obj:
    return {"name": name, "group": rt.group, "kind": rt.plural}


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(rt: ResourceType, name: str, path: str, detail: str, cause: str = "FieldValueInvalid") -> ApiError:
    kind = rt.kind if not rt.group else f"{rt.kind}.{rt.group}"
    details = {
        "name": name,
        "group": rt.group,
        "kind": rt.kind,
        "causes": [{"reason": cause, "message": detail, "field": path}],
    }
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {path}: {detail}', details)


def required(rt: ResourceType, name: str, path: str, what: str = "Required value") -> ApiError:
    return invalid(rt, name, path, what, "FieldValueRequired")


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}', _details(rt, name)
    )


class ContainerConfigError(Exception):
    """The container cannot be created yet (a missing Secret or key): the kubelet retries."""

    def __init__(self, message: str, reason: str = "CreateContainerConfigError") -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------------------------------------------
# Selectors, patches, expansion


def _split_requirements(text: str) -> list[str]:
    """Splits a label selector at the commas outside parentheses."""
    parts, depth, current = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def parse_label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A predicate on labels for ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``, ``k`` and ``!k``."""
    reqs: list[Callable[[Mapping[str, str]], bool]] = []
    for raw in _split_requirements(text or ""):
        part = raw.strip()
        if not part:
            continue
        if m := re.fullmatch(rf"({_LABEL_KEY})\s+(in|notin)\s*\(([^()]*)\)", part):
            key, values = m[1], frozenset(v.strip() for v in m[3].split(","))
            if m[2] == "in":
                reqs.append(lambda labels, k=key, vs=values: k in labels and labels[k] in vs)
            else:
                reqs.append(lambda labels, k=key, vs=values: k not in labels or labels[k] not in vs)
        elif m := re.fullmatch(rf"({_LABEL_KEY})\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)", part):
            key, value, negate = m[1], m[3], m[2] == "!="
            reqs.append(lambda labels, k=key, v=value, n=negate: (labels.get(k) == v) != n)
        elif m := re.fullmatch(rf"(!?)\s*({_LABEL_KEY})", part):
            key, negate = m[2], m[1] == "!"
            reqs.append(lambda labels, k=key, n=negate: (k in labels) != n)
        else:
            raise bad_request(f'unable to parse requirement: found "{part}", expected a label selector')
    return lambda labels: all(req(labels) for req in reqs)


def _field_value(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def parse_field_selector(text: str | None, rt: ResourceType) -> Callable[[Obj], bool]:
    """A predicate on objects for ``field=value``/``==``/``!=``, on the fields the server supports for ``rt``."""
    reqs: list[Callable[[Obj], bool]] = []
    allowed = {"metadata.name", "metadata.namespace"} | _FIELDS.get(rt.plural, frozenset())
    for raw in (text or "").split(","):
        if not raw.strip():
            continue
        m = re.fullmatch(r"\s*([A-Za-z.]+)\s*(==|!=|=)\s*(.*?)\s*", raw)
        if not m:
            raise bad_request(f"invalid field selector: {raw!r}")
        if m[1] not in allowed:
            raise bad_request(f"field label not supported: {m[1]}")
        path, value, negate = m[1], m[3], m[2] == "!="
        reqs.append(lambda obj, p=path, v=value, n=negate: (_field_value(obj, p) == v) != n)
    return lambda obj: all(req(obj) for req in reqs)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise ValueError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")] if path else []


def _pointer_get(doc: Any, tokens: list[str]) -> Any:
    for token in tokens:
        doc = doc[int(token)] if isinstance(doc, list) else doc[token]
    return doc


def _pointer_add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent, last = _pointer_get(doc, tokens[:-1]), tokens[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise IndexError(f"index {index} out of range")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise TypeError(f"cannot add to {type(parent).__name__}")
    return doc


def _pointer_remove(doc: Any, tokens: list[str]) -> Any:
    if not tokens:
        raise ValueError("cannot remove the whole document")
    parent, last = _pointer_get(doc, tokens[:-1]), tokens[-1]
    if isinstance(parent, list):
        del parent[int(last)]
    else:
        del parent[last]
    return doc


def json_patch(doc: Any, operations: list[Any]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    doc = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict):
            raise ValueError("a JSON patch operation must be an object")
        kind, path = op.get("op"), _pointer(op.get("path"))
        if kind == "add":
            doc = _pointer_add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _pointer_remove(doc, path)
        elif kind == "replace":
            _pointer_get(doc, path)  # must exist
            doc = _pointer_add(_pointer_remove(doc, path), path, copy.deepcopy(op["value"])) if path else op["value"]
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from"))
            value = copy.deepcopy(_pointer_get(doc, source))
            if kind == "move":
                doc = _pointer_remove(doc, source)
            doc = _pointer_add(doc, path, value)
        elif kind == "test":
            if _pointer_get(doc, path) != op.get("value"):
                raise ValueError(f"test failed at {op.get('path')}")
        else:
            raise ValueError(f"unknown JSON patch operation {kind!r}")
    return doc


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, others kept; ``$$`` is a literal ``$``."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == "$" and i + 1 < n:
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(mapping[name] if name in mapping else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------------------------------------------
# Store


@dataclass(frozen=True)
class WatchEvent:
    """One change: the object after it (for DELETED, as last seen) and before it (None when added)."""

    rv: int
    type: str
    key: Key
    obj: Obj
    old: Obj | None


class Store:
    """Objects by key, the global resourceVersion and a bounded history of changes for watches.

    Stored dicts are never mutated in place (a change stores a new dict), so history entries can share them.
    ``cond`` is notified on every change; the emulator's threads use ``lock`` for every read-modify-write.
    """

    def __init__(self, history_limit: int) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.objects: dict[Key, Obj] = {}
        self.uids: dict[str, Key] = {}
        self.rv = 0
        self.floor = 0  # the oldest resourceVersion a watch can start from
        self.history: deque[WatchEvent] = deque()
        self.history_limit = max(1, history_limit)
        self.listeners: list[Callable[[WatchEvent], None]] = []

    def get(self, key: Key) -> Obj | None:
        with self.lock:
            obj = self.objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def write(self, key: Key, obj: Obj) -> Obj:
        """Stores ``obj`` (taken over) under a new resourceVersion; returns a copy."""
        with self.lock:
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            old = self.objects.get(key)
            self.objects[key] = obj
            self.uids[obj["metadata"]["uid"]] = key
            self._record(WatchEvent(self.rv, "MODIFIED" if old is not None else "ADDED", key, obj, old))
            return copy.deepcopy(obj)

    def remove(self, key: Key) -> Obj:
        """Removes the object; returns it, with the resourceVersion of its deletion."""
        with self.lock:
            old = self.objects.pop(key)
            self.uids.pop(old["metadata"]["uid"], None)
            self.rv += 1
            obj = copy.deepcopy(old)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self._record(WatchEvent(self.rv, "DELETED", key, obj, old))
            return copy.deepcopy(obj)

    def _record(self, event: WatchEvent) -> None:
        self.history.append(event)
        while len(self.history) > self.history_limit:
            self.floor = self.history.popleft().rv
        for listener in self.listeners:
            listener(event)
        self.cond.notify_all()

    def compact(self) -> None:
        """Forgets the history: watches can then start only from the current resourceVersion."""
        with self.lock:
            self.history.clear()
            self.floor = self.rv

    def events_after(self, rv: int) -> list[WatchEvent] | None:
        """The changes after ``rv``, oldest first; None when ``rv`` is older than the history."""
        with self.lock:
            if rv < self.floor:
                return None
            newer: list[WatchEvent] = []
            for event in reversed(self.history):
                if event.rv <= rv:
                    break
                newer.append(event)
            newer.reverse()
            return newer

    def select(self, plural: str, namespace: str | None, match: Callable[[Obj], bool]) -> list[tuple[Key, Obj]]:
        """The matching objects (not copies), in (namespace, name) order."""
        with self.lock:
            return sorted(
                (key, obj)
                for key, obj in self.objects.items()
                if key[0] == plural and (namespace is None or key[1] == namespace) and match(obj)
            )


# --------------------------------------------------------------------------------------------------------------
# Pods as processes


def _set_condition(status: Obj, kind: str, ok: bool, reason: str | None = None, message: str | None = None) -> None:
    """Sets a pod condition, keeping its lastTransitionTime when its status does not change."""
    order = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled", "DisruptionTarget")
    conditions = status.setdefault("conditions", [])
    value = "True" if ok else "False"
    for cond in conditions:
        if cond["type"] == kind:
            break
    else:
        cond = {"type": kind, "lastProbeTime": None}
        conditions.append(cond)
    if cond.get("status") != value:
        cond["lastTransitionTime"] = _now()
    cond["status"] = value
    for attr, text in (("reason", reason), ("message", message)):
        if text is None:
            cond.pop(attr, None)
        else:
            cond[attr] = text
    conditions.sort(key=lambda c: order.index(c["type"]) if c["type"] in order else len(order))


class _Attempt:
    """One run of a container: its output so far and whether it has ended."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.done = False


class PodRunner:
    """Plays the kubelet (and the scheduler) for one pod, on a thread of its own.

    Schedules the pod (``set_capacity``), gives it a loopback IP, resolves its first container's env, runs
    ``command + args`` with ``subprocess.Popen`` in a new session, reports its status, restarts it per
    ``restartPolicy``, and carries out deletion (SIGTERM, SIGKILL after the grace period, then removal).
    """

    def __init__(self, emulator: KubeEmulator, pod: Obj) -> None:
        meta = pod["metadata"]
        self.emu = emulator
        self.store = emulator.store
        self.key: Key = ("pods", meta["namespace"], meta["name"])
        self.uid: str = meta["uid"]
        self.attempts: list[_Attempt] = []
        self.log_cond = threading.Condition()
        self.proc_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.delete_grace: int | None = None
        self.delete_deadline = 0.0
        self.oom = False
        self.evicted = False
        self.restarts = 0
        self.last_term: Obj | None = None
        self.container_id: str | None = None
        self.removed: Obj | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pod {self.key[1]}/{self.key[2]}", daemon=True)

    # -- requests from the API side (any thread)

    def request_delete(self, grace: int) -> None:
        """Starts (or shortens) the graceful deletion: SIGTERM now, SIGKILL ``grace`` seconds later."""
        deadline = time.monotonic() + grace
        if self.delete_grace is None or deadline < self.delete_deadline:
            self.delete_deadline = deadline
            self.delete_grace = grace if self.delete_grace is None else min(grace, self.delete_grace)
        self._notify()

    def simulate_oom(self) -> None:
        """SIGKILLs the running container, to be reported as OOMKilled."""
        with self.proc_lock:
            if self.proc is None or self.proc.poll() is not None:
                raise LookupError(f"pod {self.key[1]}/{self.key[2]} has no running container")
            self.oom = True
        self._kill(signal.SIGKILL)
        self._notify()

    def evict(self) -> None:
        """Kills the container (if any) for good: the pod ends Failed, reason Evicted."""
        self.evicted = True
        self._kill(signal.SIGKILL)
        self._notify()

    def pid(self) -> int | None:
        """The pid of the running container process, if any."""
        with self.proc_lock:
            return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def kill_now(self) -> None:
        """SIGKILLs the container's process group and process, and reaps it (bounded)."""
        with self.proc_lock:
            proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.kill()
        except OSError:
            pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            logger.warning("pod %s/%s: process %d did not die", self.key[1], self.key[2], proc.pid)
            return
        with self.proc_lock:
            if self.proc is proc:
                self.proc = None

    # -- the thread

    def _notify(self) -> None:
        with self.store.lock:
            self.store.cond.notify_all()
        with self.log_cond:
            self.log_cond.notify_all()

    def _stopped(self) -> bool:
        return self.emu.closed or self.delete_grace is not None or self.evicted

    def _pod(self) -> Obj | None:
        """The stored pod if it is still this one (the store lock must be held)."""
        obj = self.store.objects.get(self.key)
        return obj if obj is not None and obj["metadata"]["uid"] == self.uid else None

    def _mutate(self, change: Callable[[Obj], None]) -> Obj | None:
        with self.store.lock:
            pod = self._pod()
            if pod is None:
                return None
            new = copy.deepcopy(pod)
            change(new)
            return pod if new == pod else self.store.write(self.key, new)

    def _container_status(self, pod: Obj, state: Obj, ready: bool = False, started: bool = False) -> Obj:
        container = pod["spec"]["containers"][0]
        status: Obj = {
            "name": container["name"],
            "image": container.get("image") or "",
            "imageID": f"emulator://{container.get('image') or ''}",
            "ready": ready,
            "started": started,
            "restartCount": self.restarts,
            "state": state,
            "lastState": {"terminated": self.last_term} if self.last_term else {},
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status

    def _set_waiting(self, pod: Obj, reason: str, message: str | None = None) -> None:
        waiting = {"reason": reason} if message is None else {"reason": reason, "message": message}
        status = pod.setdefault("status", {})
        status["containerStatuses"] = [self._container_status(pod, {"waiting": waiting})]
        not_ready = f"containers with unready status: [{pod['spec']['containers'][0]['name']}]"
        _set_condition(status, "Ready", False, "ContainersNotReady", not_ready)
        _set_condition(status, "ContainersReady", False, "ContainersNotReady", not_ready)

    def _run(self) -> None:
        try:
            self._lifecycle()
        except Exception:
            logger.exception("pod %s/%s: the emulated kubelet failed", self.key[1], self.key[2])
        finally:
            self._kill(signal.SIGKILL)
            self.emu._release(self.uid)
            with self.log_cond:
                for attempt in self.attempts:
                    attempt.done = True
                self.log_cond.notify_all()
            self.done.set()
            self.emu._runner_finished(self)

    def _lifecycle(self) -> None:
        term: Obj | None = None
        if self._schedule():
            while True:
                config = self._prepare()
                if config is None:
                    break
                result = self._run_container(*config)
                if result is None:
                    break
                term = result
                if self._stopped():
                    break
                with self.store.lock:
                    pod = self._pod()
                    policy = pod["spec"].get("restartPolicy", "Always") if pod else "Never"
                if not (policy == "Always" or (policy == "OnFailure" and term["exitCode"] != 0)):
                    break
                self.last_term = term
                backoff = self.emu.restart_backoff
                message = f"back-off {int(backoff * 1000)}ms restarting failed container"
                self._mutate(lambda pod, m=message: self._set_waiting(pod, "CrashLoopBackOff", m))
                if not self._sleep(backoff):
                    break
                self.restarts += 1
        if self.emu.closed:
            return
        self._finish(term)
        self._await_deletion()

    def _sleep(self, seconds: float) -> bool:
        """Waits ``seconds`` unless stopped first; True when the time ran out."""
        deadline = time.monotonic() + seconds
        with self.store.lock:
            while not self._stopped():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                self.store.cond.wait(remaining)
        return False

    def _schedule(self) -> bool:
        """Waits for a free slot (Unschedulable meanwhile), then binds the pod and gives it its IP."""
        marked = False
        with self.store.lock:
            while True:
                if self._stopped() or self._pod() is None:
                    return False
                if self.emu._try_bind(self.uid):
                    ip = self.emu._allocate_ip()
                    self._mutate(lambda pod, ip=ip: self._bind(pod, ip))
                    return True
                if not marked:
                    self._mutate(self._unschedulable)
                    marked = True
                self.store.cond.wait(0.1)

    @staticmethod
    def _unschedulable(pod: Obj) -> None:
        _set_condition(pod.setdefault("status", {}), "PodScheduled", False, "Unschedulable", _MSG_UNSCHEDULABLE)

    def _bind(self, pod: Obj, ip: str) -> None:
        """What the scheduler and the kubelet write once the pod has a node and a sandbox (with its IP)."""
        pod["spec"]["nodeName"] = NODE_NAME
        status = pod.setdefault("status", {})
        status.update(phase="Pending", hostIP=HOST_IP, hostIPs=[{"ip": HOST_IP}], podIP=ip, podIPs=[{"ip": ip}])
        status["startTime"] = _now()
        _set_condition(status, "PodScheduled", True)
        _set_condition(status, "PodReadyToStartContainers", True)
        _set_condition(status, "Initialized", True)
        self._set_waiting(pod, "ContainerCreating")

    def _prepare(self) -> tuple[list[str], dict[str, str], str | None] | None:
        """The container's argv, env and working directory, once its config resolves; None when stopped."""
        with self.store.lock:
            while True:
                pod = self._pod()
                if self._stopped() or pod is None:
                    return None
                try:
                    return self.emu._container_config(pod)
                except ContainerConfigError as e:
                    reason, message = e.reason, str(e)
                self._mutate(lambda p, r=reason, m=message: self._set_waiting(p, r, m))
                self.store.cond.wait(0.1)

    def _run_container(self, argv: list[str], env: dict[str, str], cwd: str | None) -> Obj | None:
        """Runs one attempt to its end; returns its ``terminated`` state, None when stopped before it started."""
        attempt = _Attempt()
        with self.emu._proc_lock:
            if self._stopped():
                return None
            with self.log_cond:
                self.attempts.append(attempt)
            self.oom = False
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                with self.log_cond:
                    attempt.done = True
                    self.log_cond.notify_all()
                now = _now()
                return {"exitCode": 128, "reason": "StartError", "message": str(e), "startedAt": now, "finishedAt": now}
            with self.proc_lock:
                self.proc = proc
        reader = threading.Thread(target=self._read_output, args=(proc, attempt), daemon=True)
        reader.start()
        started = _now()
        self.container_id = f"emulator://{self.uid}/{proc.pid}"

        def running(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            status["phase"] = "Running"
            status["containerStatuses"] = [self._container_status(pod, {"running": {"startedAt": started}}, True, True)]
            for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled"):
                _set_condition(status, kind, True)

        self._mutate(running)
        signalled = False
        while True:
            try:
                proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.emu.closed:
                self.kill_now()
                return None
            if self.evicted:
                self._kill(signal.SIGKILL)
            if self.delete_grace is not None:
                if not signalled:
                    signalled = True
                    self._kill(signal.SIGTERM if self.delete_grace > 0 else signal.SIGKILL)
                if time.monotonic() >= self.delete_deadline:
                    self._kill(signal.SIGKILL)
        returncode = proc.returncode
        self._kill(signal.SIGKILL)  # the container's other processes end with it
        reader.join(timeout=2)
        with self.proc_lock:
            self.proc = None
        with self.log_cond:
            attempt.done = True
            self.log_cond.notify_all()
        exit_code = returncode if returncode >= 0 else 128 - returncode
        reason = "OOMKilled" if self.oom else ("Completed" if exit_code == 0 else "Error")
        return {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": started,
            "finishedAt": _now(),
            "containerID": self.container_id,
        }

    def _read_output(self, proc: subprocess.Popen[bytes], attempt: _Attempt) -> None:
        stream = proc.stdout
        assert stream is not None
        try:
            while chunk := stream.read1(65536):
                with self.log_cond:
                    attempt.data.extend(chunk)
                    self.log_cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def _kill(self, sig: int) -> None:
        with self.proc_lock:
            proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        if sig == signal.SIGKILL:
            try:
                proc.kill()
            except OSError:
                pass

    def _finish(self, term: Obj | None) -> None:
        """Writes the final status (Succeeded/Failed, or Evicted) and frees the pod's slot."""

        def final(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            if term is not None:
                status["containerStatuses"] = [self._container_status(pod, {"terminated": term})]
                status["phase"] = "Succeeded" if term["exitCode"] == 0 else "Failed"
            if self.evicted:
                status.update(phase="Failed", reason="Evicted")
                status["message"] = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 0Ki. "
                _set_condition(
                    status, "DisruptionTarget", True, "TerminationByKubelet", "The node was low on resource: memory. "
                )
            if status.get("phase") in ("Succeeded", "Failed"):
                reason = "PodCompleted" if status["phase"] == "Succeeded" else "PodFailed"
                for kind in ("Ready", "ContainersReady"):
                    _set_condition(status, kind, False, reason)
                _set_condition(status, "PodReadyToStartContainers", False)

        self._mutate(final)
        self.emu._release(self.uid)

    def _await_deletion(self) -> None:
        """Once the pod is being deleted (and its container has stopped), removes it from the store."""
        with self.store.lock:
            while not self.emu.closed:
                pod = self._pod()
                if pod is None:
                    return
                if self.delete_grace is not None or pod["metadata"].get("deletionTimestamp"):
                    self.removed = self.store.remove(self.key)
                    return
                self.store.cond.wait(0.5)


# --------------------------------------------------------------------------------------------------------------
# HTTP


@dataclass
class _WatchPlan:
    """A validated watch request: what to replay, from where, and which events the watcher sees."""

    rt: ResourceType
    namespace: str | None
    match: Callable[[Obj], bool]
    initial: list[Obj]
    position: int
    expired: str | None
    timeout: float | None
    bookmarks: bool

    def translate(self, event: WatchEvent) -> tuple[str, Obj] | None:
        """The event as this watcher sees it: an object leaving the selector is DELETED, entering it ADDED."""
        if event.key[0] != self.rt.plural or (self.namespace is not None and event.key[1] != self.namespace):
            return None
        was = event.old is not None and self.match(event.old)
        now = event.type != "DELETED" and self.match(event.obj)
        if now:
            return ("MODIFIED" if was else "ADDED", event.obj)
        return ("DELETED", event.obj) if was else None


@dataclass
class _LogPlan:
    """A validated ``follow`` log request."""

    runner: PodRunner
    attempt: _Attempt
    start: int
    limit: int | None = None
    sent: int = field(default=0)


class _Server(http.server.ThreadingHTTPServer):
    """The threaded HTTP server; it keeps its connections so that ``close()`` can end them."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, emulator: KubeEmulator) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.emulator = emulator
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def drop_connections(self) -> None:
        with self.connections_lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(http.server.BaseHTTPRequestHandler):
    """Parses requests, authenticates and authorizes them, routes them to the emulator, streams watches/logs."""

    protocol_version = "HTTP/1.1"
    server_version = "kube-emulator"
    server: _Server

    def setup(self) -> None:
        """Sets TCP_NODELAY (without it each keep-alive request waits ~40 ms for a delayed ACK)."""
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            with self.server.connections_lock:
                self.server.connections.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # -- plumbing

    def _send(self, code: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, content_type = payload.encode(), "text/plain"
        else:
            data, content_type = json.dumps(payload, separators=(",", ":")).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._streaming = True

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _serve(self, method: str) -> None:
        emu = self.server.emulator
        self._streaming = False
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
            split = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
            if emu.closed:
                raise ApiError(503, "ServiceUnavailable", "the emulated API server is shutting down")
            expected = f"Bearer {emu.token}".encode()
            if not secrets.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                raise bad_request(
                    "the body of the request was in an unknown format - accepted media types include: application/json"
                ) from None
            result = emu._route(method, split.path, query, body, self.headers.get("Content-Type") or "")
            if isinstance(result, _WatchPlan):
                self._stream_watch(emu, result)
            elif isinstance(result, _LogPlan):
                self._stream_log(emu, result)
            else:
                self._send(*result)
        except ApiError as e:
            if self._streaming:
                self.close_connection = True
            else:
                self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception as e:
            logger.exception("kube emulator: %s %s failed", method, self.path)
            if self._streaming:
                self.close_connection = True
            else:
                self._send(
                    500,
                    ApiError(
                        500, "InternalError", f"an error on the server ({e}) has prevented the request from succeeding"
                    ).status(),
                )

    def _stream_watch(self, emu: KubeEmulator, plan: _WatchPlan) -> None:
        self._start_chunked("application/json")
        duplicate = plan.rt.plural == "pods"

        def send(kind: str, obj: Obj) -> None:
            line = json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"
            twice = duplicate and emu._duplicate_events and kind in ("ADDED", "MODIFIED", "DELETED")
            self._chunk(line + line if twice else line)

        if plan.expired is not None:
            send("ERROR", ApiError(410, "Expired", plan.expired).status())
            self._end_chunked()
            return
        for obj in plan.initial:
            send("ADDED", obj)
        position = plan.position
        deadline = time.monotonic() + plan.timeout if plan.timeout is not None else None
        last_activity = time.monotonic()
        while not emu.closed:
            wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if wait <= 0:
                break
            with emu.store.lock:
                events = emu.store.events_after(position)
                if events == []:
                    emu.store.cond.wait(wait)
                    events = emu.store.events_after(position)
                floor, current = emu.store.floor, emu.store.rv
            if events is None:
                send("ERROR", ApiError(410, "Expired", f"too old resource version: {position} ({floor})").status())
                break
            if events:
                position = events[-1].rv
                for event in events:
                    seen = plan.translate(event)
                    if seen is not None:
                        send(*seen)
                last_activity = time.monotonic()
            elif self._client_gone():
                self.close_connection = True
                return
            elif plan.bookmarks and time.monotonic() - last_activity >= BOOKMARK_INTERVAL_S:
                bookmark = {
                    "kind": plan.rt.kind,
                    "apiVersion": plan.rt.api_version,
                    "metadata": {"resourceVersion": str(current)},
                }
                send("BOOKMARK", bookmark)
                last_activity = time.monotonic()
        self._end_chunked()

    def _stream_log(self, emu: KubeEmulator, plan: _LogPlan) -> None:
        self._start_chunked("text/plain")
        runner, attempt, offset = plan.runner, plan.attempt, plan.start
        while True:
            with runner.log_cond:
                if len(attempt.data) <= offset and not attempt.done and not emu.closed:
                    runner.log_cond.wait(0.25)
                data, done = bytes(attempt.data[offset:]), attempt.done or emu.closed
            if data:
                if plan.limit is not None:
                    data = data[: plan.limit - plan.sent]
                self._chunk(data)
                offset += len(data)
                plan.sent += len(data)
                if plan.limit is not None and plan.sent >= plan.limit:
                    break
            elif done:
                break
            elif self._client_gone():
                self.close_connection = True
                return
        self._end_chunked()


# --------------------------------------------------------------------------------------------------------------
# The emulator


class KubeEmulator:
    """A Kubernetes API server and kubelet for tests; see the module docstring.

    Args:
        history_limit: how many changes watches can replay; older resourceVersions get 410 Expired.
        user: the user named in Forbidden messages.
        pod_env: extra environment for every pod process (after the emulator's, before the container's).
        restart_backoff: seconds between a container's exit and its restart (OnFailure/Always).
        strict_namespaces: list/watch in an unknown namespace answer 404 instead of an empty list.
    """

    def __init__(
        self,
        *,
        history_limit: int = 1000,
        user: str = "system:serviceaccount:default:default",
        pod_env: Mapping[str, str] | None = None,
        restart_backoff: float = 0.2,
        strict_namespaces: bool = False,
    ) -> None:
        self.store = Store(history_limit)
        self.user = user
        self.pod_env = dict(pod_env or {})
        self.restart_backoff = restart_backoff
        self.strict_namespaces = strict_namespaces
        self.token = secrets.token_hex(16)
        self.closed = False
        self._dir = tempfile.mkdtemp(prefix="kube-emulator-")
        self.kubeconfig = os.path.join(self._dir, "kubeconfig")
        self._denied: set[tuple[str, str]] = set()
        # Resource requests served, by (verb, resource): e.g. ("patch", "configmaps"), ("create", "pods/eviction").
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self._requests_lock = threading.Lock()
        self._duplicate_events = False
        self._capacity: int | None = None
        self._bound: set[str] = set()
        self._queue: list[str] = []
        self._runners: dict[str, PodRunner] = {}
        self._ip_counter = 0
        self._cluster_ip_counter = 9
        self._proc_lock = threading.Lock()
        self._gc_wake = threading.Event()
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self.store.listeners.append(self._on_event)
        for namespace in ("default", "kube-system", "kube-public"):
            self.add_namespace(namespace)

    # -- lifecycle

    def start(self) -> KubeEmulator:
        """Starts serving (on 127.0.0.1, a free port) and writes ``self.kubeconfig``."""
        if self._server is not None:
            return self
        self._server = _Server(self)
        self._threads = [
            threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="kube-emulator http",
                daemon=True,
            ),
            threading.Thread(target=self._gc_loop, name="kube-emulator gc", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.write_kubeconfig(self.kubeconfig)
        return self

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops the server and the pods; every pod process (and its process group) is SIGKILLed."""
        with self._proc_lock:
            already, self.closed = self.closed, True
        if already:
            return
        with self.store.lock:
            runners = list(self._runners.values())
        try:
            self._gc_wake.set()
            for runner in runners:
                runner._notify()
            if self._server is not None:
                if self._threads[0].is_alive():
                    self._server.shutdown()
                self._server.drop_connections()
                self._server.server_close()
            for thread in [*self._threads, *(r.thread for r in runners)]:
                thread.join(timeout=2)
        finally:
            for runner in runners:
                runner.kill_now()
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
        if self._server is None:
            raise RuntimeError("the emulator is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    # -- clients

    def client_configuration(self) -> kubernetes.client.Configuration:
        """A client configuration for this server (bearer token, no proxy)."""
        from kubernetes import client

        cfg = client.Configuration(
            host=self.url, api_key={"BearerToken": self.token}, api_key_prefix={"BearerToken": "Bearer"}
        )
        cfg.no_proxy = "127.0.0.1,localhost"
        return cfg

    def api_client(self) -> kubernetes.client.ApiClient:
        """An ApiClient for this server (close it, or use it as a context manager)."""
        from kubernetes import client

        return client.ApiClient(self.client_configuration())

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default") -> None:
        """Writes a kubeconfig (JSON, which is YAML) for this server and token."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": self.token}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
            ],
            "current-context": "emulator",
            "preferences": {},
        }
        with open(path, "w") as f:
            json.dump(config, f, indent=2)

    # -- test controls

    def add_namespace(self, name: str) -> None:
        """Creates the namespace (if absent) and its ``default`` ServiceAccount."""
        with self.store.lock:
            if ("namespaces", "", name) not in self.store.objects:
                self._create(NAMESPACES, "", {"metadata": {"name": name}})

    def add_service_account(self, ns: str, name: str) -> None:
        """Creates the ServiceAccount (if absent), e.g. one a pod's ``serviceAccountName`` names."""
        with self.store.lock:
            if ("serviceaccounts", ns, name) not in self.store.objects:
                self._create(RESOURCES["serviceaccounts"], ns, {"metadata": {"name": name}})

    def deny(self, verb: str, resource: str) -> None:
        """Answers 403 Forbidden to ``verb`` (or any, ``"*"``) on ``resource`` (e.g. ``pods``, ``pods/log``)."""
        self._denied.add((verb, resource))

    def allow(self, verb: str, resource: str) -> None:
        """Undoes ``deny(verb, resource)``."""
        self._denied.discard((verb, resource))

    def compact(self) -> None:
        """Drops the watch history: watches from an older resourceVersion then get 410 Expired."""
        self.store.compact()

    def inject_duplicate_events(self, on: bool = True) -> None:
        """Sends every pod watch event twice."""
        self._duplicate_events = on

    def set_capacity(self, n: int | None) -> None:
        """At most ``n`` pods hold a slot (scheduled and not finished); others stay Pending, Unschedulable."""
        with self.store.lock:
            self._capacity = n
            self.store.cond.notify_all()

    def simulate_oom(self, name: str, namespace: str = "default") -> None:
        """Kills the pod's container as the OOM killer would: exit code 137, reason OOMKilled."""
        self._runner_for(name, namespace).simulate_oom()

    def evict(self, name: str, namespace: str = "default") -> None:
        """Evicts the pod as a kubelet under node pressure: killed, phase Failed, reason Evicted."""
        self._runner_for(name, namespace).evict()

    # -- inspection

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        return str(self.store.rv)

    def objects(self, plural: str, namespace: str | None = "default", label_selector: str | None = None) -> list[Obj]:
        """The objects (copies) of a resource (``"pods"``, ``"roles"``, ...) in ``namespace`` (None: all),
        in (namespace, name) order."""
        labels = parse_label_selector(label_selector)
        selected = self.store.select(plural, namespace, lambda o: labels(o["metadata"].get("labels") or {}))
        return [copy.deepcopy(obj) for _, obj in selected]

    def pods(self, namespace: str | None = "default", label_selector: str | None = None) -> list[Obj]:
        """The pods (copies) in ``namespace`` (None: all), in (namespace, name) order."""
        return self.objects("pods", namespace, label_selector)

    def pod(self, name: str, namespace: str = "default") -> Obj | None:
        """The pod (a copy), or None."""
        return self.store.get(("pods", namespace, name))

    def pod_log(self, name: str, namespace: str = "default") -> str:
        """The output of the pod's current (or last) container run; empty when none started."""
        runner = self._find_runner(name, namespace)
        if runner is None:
            return ""
        with runner.log_cond:
            return runner.attempts[-1].data.decode(errors="replace") if runner.attempts else ""

    def pod_pid(self, name: str, namespace: str = "default") -> int | None:
        """The pid of the pod's running container process, if any."""
        runner = self._find_runner(name, namespace)
        return runner.pid() if runner is not None else None

    @staticmethod
    def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
        """Polls ``predicate`` until it returns a truthy value, which is returned; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"not true after {timeout} s: {getattr(predicate, '__qualname__', predicate)}")
            time.sleep(interval)

    # -- internals: pods and scheduling

    def _find_runner(self, name: str, namespace: str) -> PodRunner | None:
        with self.store.lock:
            pod = self.store.objects.get(("pods", namespace, name))
            return self._runners.get(pod["metadata"]["uid"]) if pod is not None else None

    def _runner_for(self, name: str, namespace: str) -> PodRunner:
        runner = self._find_runner(name, namespace)
        if runner is None:
            raise LookupError(f"no pod {namespace}/{name}")
        return runner

    def _runner_finished(self, runner: PodRunner) -> None:
        with self.store.lock:
            if self._runners.get(runner.uid) is runner:
                del self._runners[runner.uid]

    def _try_bind(self, uid: str) -> bool:
        """Gives the pod a slot if one is free and it is among the first waiting (store lock held)."""
        if uid in self._bound:
            return True
        free = len(self._queue) if self._capacity is None else self._capacity - len(self._bound)
        if free > 0 and uid in self._queue[:free]:
            self._queue.remove(uid)
            self._bound.add(uid)
            return True
        return False

    def _release(self, uid: str) -> None:
        with self.store.lock:
            self._bound.discard(uid)
            if uid in self._queue:
                self._queue.remove(uid)
            self.store.cond.notify_all()

    def _allocate_ip(self) -> str:
        with self.store.lock:
            while True:
                self._ip_counter += 1
                third, fourth = divmod(self._ip_counter + 1, 256)
                if fourth not in (0, 255):
                    return f"127.0.{third}.{fourth}"

    def _container_config(self, pod: Obj) -> tuple[list[str], dict[str, str], str | None]:
        """argv, env and cwd of the pod's first container; ContainerConfigError while a reference is missing."""
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        ns = meta["namespace"]
        env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
        service = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}
        env.update(HOSTNAME=meta["name"], KUBECONFIG=self.kubeconfig, **service)
        env.update(self.pod_env)
        mapping = {**service, **self.pod_env}  # what $(VAR) can name: service variables and earlier env
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            for kind, ref in (("configmaps", source.get("configMapRef")), ("secrets", source.get("secretRef"))):
                if not ref:
                    continue
                obj = self.store.objects.get((kind, ns, ref.get("name", "")))
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise ContainerConfigError(f'{kind[:-1]} "{ref.get("name")}" not found')
                for k, v in (obj.get("data") or {}).items():
                    value = base64.b64decode(v).decode(errors="replace") if kind == "secrets" else v
                    env[prefix + k] = mapping[prefix + k] = value
        for var in container.get("env") or []:
            if var.get("valueFrom"):
                value = self._env_value_from(pod, container, var["valueFrom"])
                if value is None:
                    continue
            else:
                value = expand(var.get("value") or "", mapping)
            env[var["name"]] = mapping[var["name"]] = value
        argv = [expand(str(a), mapping) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not argv:
            raise ContainerConfigError("the emulator runs command + args: it has no images", "CreateContainerError")
        return argv, env, container.get("workingDir") or None

    def _env_value_from(self, pod: Obj, container: Obj, source: Obj) -> str | None:
        meta, ns = pod["metadata"], pod["metadata"]["namespace"]
        for kind, ref_name, label in (
            ("secrets", "secretKeyRef", "Secret"),
            ("configmaps", "configMapKeyRef", "ConfigMap"),
        ):
            ref = source.get(ref_name)
            if not ref:
                continue
            name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))
            obj = self.store.objects.get((kind, ns, name))
            if obj is None:
                if optional:
                    return None
                raise ContainerConfigError(f'{kind[:-1]} "{name}" not found')
            data = obj.get("data") or {}
            if key in data:
                return base64.b64decode(data[key]).decode(errors="replace") if kind == "secrets" else data[key]
            if kind == "configmaps" and key in (obj.get("binaryData") or {}):
                return base64.b64decode(obj["binaryData"][key]).decode(errors="replace")
            if optional:
                return None
            raise ContainerConfigError(f"couldn't find key {key} in {label} {ns}/{name}")
        if source.get("fieldRef"):
            path = source["fieldRef"].get("fieldPath", "")
            if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path):
                return (meta.get(m[1]) or {}).get(m[2], "")
            if path in ("metadata.labels", "metadata.annotations"):
                return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(path[9:]) or {}).items()))
            status, spec = pod.get("status") or {}, pod["spec"]
            values = {
                "metadata.name": meta["name"],
                "metadata.namespace": ns,
                "metadata.uid": meta["uid"],
                "spec.nodeName": spec.get("nodeName", ""),
                "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                "status.podIP": status.get("podIP", ""),
                "status.hostIP": status.get("hostIP", ""),
                "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
                "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
            }
            if path not in values:
                raise ContainerConfigError(f"unsupported fieldPath: {path}")
            return values[path]
        if source.get("resourceFieldRef"):
            resource = source["resourceFieldRef"].get("resource", "")
            kind, _, name = resource.partition(".")
            given = ((container.get("resources") or {}).get(kind) or {}).get(name)
            if given is not None:
                return str(given)
            return (
                str(os.cpu_count() or 1) if resource == "limits.cpu" else ("0" if kind == "requests" else str(1 << 34))
            )
        raise ContainerConfigError(f"env var with an unsupported valueFrom: {sorted(source)}")

    # -- internals: garbage collection

    def _on_event(self, event: WatchEvent) -> None:
        if event.type == "DELETED" or event.obj["metadata"].get("ownerReferences"):
            self._gc_wake.set()

    def _gc_loop(self) -> None:
        while not self.closed:
            self._gc_wake.wait(0.5)
            self._gc_wake.clear()
            if self.closed:
                return
            try:
                self._collect_garbage()
            except Exception:
                logger.exception("kube emulator: garbage collection failed")

    def _collect_garbage(self) -> None:
        """Deletes (in the background) objects whose owners, by uid, all no longer exist."""
        with self.store.lock:
            victims = [
                (key, obj["metadata"]["uid"])
                for key, obj in self.store.objects.items()
                if (refs := obj["metadata"].get("ownerReferences"))
                and not obj["metadata"].get("deletionTimestamp")
                and all(ref.get("uid") not in self.store.uids for ref in refs)
            ]
        for (plural, ns, name), uid in victims:
            try:
                self._delete(RESOURCES[plural], ns, name, {}, {"preconditions": {"uid": uid}}, wait=False)
            except ApiError:
                pass

    def _orphan_dependents(self, uid: str) -> None:
        with self.store.lock:
            for key, obj in list(self.store.objects.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                if any(ref.get("uid") == uid for ref in refs):
                    new = copy.deepcopy(obj)
                    kept = [ref for ref in refs if ref.get("uid") != uid]
                    if kept:
                        new["metadata"]["ownerReferences"] = kept
                    else:
                        del new["metadata"]["ownerReferences"]
                    self.store.write(key, new)

    # -- internals: routing

    def _route(self, method: str, path: str, query: dict[str, str], body: Any, content_type: str) -> Any:
        """Answers one authenticated request: ``(code, payload)``, or a plan to stream."""
        parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
        if parts == ["version"] and method == "GET":
            return 200, _VERSION
        if parts == ["api"]:
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if parts == ["apis"] and method == "GET":
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_api_group(RBAC)]}
        if parts == ["apis", RBAC] and method == "GET":
            return 200, {"kind": "APIGroup", "apiVersion": "v1", **_api_group(RBAC)}
        if parts in (["api", "v1"], ["apis", RBAC, "v1"]) and method == "GET":
            return 200, _api_resources("" if parts[0] == "api" else RBAC)
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif parts[:3] == ["apis", RBAC, "v1"]:
            group, rest = RBAC, parts[3:]
        else:
            raise ApiError(404, "NotFound", _MSG_NO_RESOURCE)
        watch_path = bool(rest) and rest[0] == "watch"
        rest = rest[1:] if watch_path else rest
        ns: str | None = None
        name = sub = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, plural, name, sub = rest[1], rest[2], *(rest[3:5] + [None, None])[:2]
            extra = rest[5:]
        elif rest and rest[0] == "namespaces":
            plural, name, extra = "namespaces", rest[1] if len(rest) > 1 else None, rest[2:]
        elif rest:
            plural, name, extra = rest[0], rest[1] if len(rest) > 1 else None, rest[2:]
        else:
            raise ApiError(404, "NotFound", _MSG_NO_RESOURCE)
        rt = RESOURCES.get(plural)
        if rt is None or rt.group != group or extra or (ns is None and rt.namespaced and name is not None):
            raise ApiError(404, "NotFound", _MSG_NO_RESOURCE)
        if rt.namespaced == (ns is None) and not (rt.namespaced and name is None):
            raise ApiError(404, "NotFound", _MSG_NO_RESOURCE)
        if name is None:
            verb = {"GET": "list", "POST": "create", "DELETE": "deletecollection"}.get(method)
            if verb == "list" and (watch_path or _truthy(query.get("watch"))):
                verb = "watch"
            if verb in ("create", "deletecollection") and rt.namespaced and ns is None:
                verb = None
        elif sub is None:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
        else:
            allowed = {
                "status": {"GET": "get", "PUT": "update", "PATCH": "patch"},
                "log": {"GET": "get"},
                "eviction": {"POST": "create"},
            }
            if rt is not PODS or sub not in allowed:
                raise ApiError(404, "NotFound", _MSG_NO_RESOURCE)
            verb = allowed[sub].get(method)
        if verb is None:
            raise ApiError(
                405, "MethodNotAllowed", f"the server does not allow this method on the requested resource ({method})"
            )
        with self._requests_lock:
            self.requests[(verb, plural if sub is None else f"{plural}/{sub}")] += 1
        self._authorize(verb, rt, sub, ns if rt.namespaced else name, name)
        key_ns = ns or ""
        if sub == "log":
            return self._log(key_ns, name or "", query)
        if sub == "eviction":
            options = (body or {}).get("deleteOptions") or {} if isinstance(body, dict) else {}
            self._delete(rt, key_ns, name or "", {}, options, wait=False)
            return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        if verb == "get":
            obj = self.store.get((rt.plural, key_ns, name or ""))
            if obj is None:
                raise not_found(rt, name or "")
            return 200, obj
        if verb == "list":
            return 200, self._list(rt, ns, query)
        if verb == "watch":
            return self._watch(rt, ns, query)
        if verb == "create":
            return 201, self._create(rt, key_ns, body, dry_run=bool(query.get("dryRun")))
        if verb == "update":
            return 200, self._replace(rt, key_ns, name or "", body, sub)
        if verb == "patch":
            return 200, self._patch(rt, key_ns, name or "", body, content_type, sub)
        if verb == "delete":
            return 200, self._delete(rt, key_ns, name or "", query, body if isinstance(body, dict) else {})
        return 200, self._delete_collection(rt, key_ns, query, body if isinstance(body, dict) else {})

    def _authorize(self, verb: str, rt: ResourceType, sub: str | None, ns: str | None, name: str | None) -> None:
        resource = rt.plural + (f"/{sub}" if sub else "")
        if not any(rule in self._denied for rule in ((verb, resource), ("*", resource), (verb, "*"), ("*", "*"))):
            return
        subject = f'{rt.qualified} "{name}"' if name else rt.qualified
        scope = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        action = f'cannot {verb} resource "{resource}" in API group "{rt.group}" {scope}'
        message = f'{subject} is forbidden: User "{self.user}" {action}'
        details: Obj = (
            {"name": name, "group": rt.group, "kind": rt.plural} if name else {"group": rt.group, "kind": rt.plural}
        )
        raise ApiError(403, "Forbidden", message, details)

    def _require_namespace(self, ns: str) -> None:
        if ("namespaces", "", ns) not in self.store.objects:
            raise not_found(NAMESPACES, ns)

    # -- internals: verbs

    def _list(self, rt: ResourceType, ns: str | None, query: dict[str, str]) -> Obj:
        match = self._matcher(rt, query)
        with self.store.lock:
            if ns is not None and self.strict_namespaces:
                self._require_namespace(ns)
            rv = self.store.rv
            selected = self.store.select(rt.plural, ns, match)
            metadata: Obj = {"resourceVersion": str(rv)}
            if token := query.get("continue"):
                try:
                    decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                    start, rv = tuple(decoded["start"]), int(decoded["rv"])
                except (ValueError, KeyError, TypeError):
                    raise bad_request("continue key is not valid: incorrect encoded start resourceVersion") from None
                if rv < self.store.floor:
                    raise ApiError(410, "Expired", _MSG_CONTINUE_EXPIRED)
                selected = [(k, o) for k, o in selected if (k[1], k[2]) > start]
                metadata["resourceVersion"] = str(rv)
            limit = int(query.get("limit") or 0)
            if limit > 0 and len(selected) > limit:
                metadata["remainingItemCount"] = len(selected) - limit
                selected = selected[:limit]
                last = selected[-1][0]
                metadata["continue"] = base64.urlsafe_b64encode(
                    json.dumps({"rv": rv, "start": [last[1], last[2]]}).encode()
                ).decode()
            items = [copy.deepcopy(obj) for _, obj in selected]
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": metadata, "items": items}

    def _matcher(self, rt: ResourceType, query: dict[str, str]) -> Callable[[Obj], bool]:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), rt)
        return lambda obj: labels(obj["metadata"].get("labels") or {}) and fields(obj)

    def _watch(self, rt: ResourceType, ns: str | None, query: dict[str, str]) -> _WatchPlan:
        match = self._matcher(rt, query)
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        requested = query.get("resourceVersion") or ""
        with self.store.lock:
            if ns is not None and self.strict_namespaces:
                self._require_namespace(ns)
            if requested in ("", "0"):
                initial = [copy.deepcopy(obj) for _, obj in self.store.select(rt.plural, ns, match)]
                return _WatchPlan(rt, ns, match, initial, self.store.rv, None, timeout, bookmarks)
            try:
                position = int(requested)
            except ValueError:
                raise bad_request(f"invalid resource version: {requested!r}") from None
            expired = None
            if position < self.store.floor:
                expired = f"too old resource version: {position} ({self.store.floor})"
            return _WatchPlan(rt, ns, match, [], position, expired, timeout, bookmarks)

    def _log(self, ns: str, name: str, query: dict[str, str]) -> Any:
        with self.store.lock:
            pod = self.store.objects.get(("pods", ns, name))
            if pod is None:
                raise not_found(PODS, name)
            runner = self._runners.get(pod["metadata"]["uid"])
            names = [c["name"] for c in pod["spec"]["containers"]]
            container = query.get("container") or names[0]
            if container not in names:
                raise bad_request(f"container {container} is not valid for pod {name}")
            attempts = list(runner.attempts) if runner is not None and container == names[0] else []
            if _truthy(query.get("previous")):
                if len(attempts) < 2:
                    raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
                attempt = attempts[-2]
            elif attempts:
                attempt = attempts[-1]
            else:
                statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
                reason = statuses[0].get("state", {}).get("waiting", {}).get("reason") or "ContainerCreating"
                raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {reason}')
        assert runner is not None
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        with runner.log_cond:
            data = bytes(attempt.data)
        start = 0
        if query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            tail = int(query["tailLines"])
            start = len(data) - sum(len(line) for line in (lines[-tail:] if tail > 0 else []))
        if _truthy(query.get("follow")):
            return _LogPlan(runner, attempt, start, limit)
        text = data[start:] if limit is None else data[start : start + limit]
        return 200, text.decode(errors="replace")

    def _create(self, rt: ResourceType, ns: str, body: Any, dry_run: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        self._check_kind(rt, obj)
        meta = obj.get("metadata") or {}
        obj["metadata"] = meta
        with self.store.lock:
            if rt.namespaced:
                if meta.get("namespace") not in (None, "", ns):
                    raise bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request"
                    )
                self._require_namespace(ns)
            name = meta.get("name") or ""
            if not name:
                prefix = meta.get("generateName")
                if not prefix:
                    raise invalid(
                        rt,
                        "",
                        "metadata.name",
                        "Required value: name or generateName is required",
                        "FieldValueRequired",
                    )
                name = prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
            key = (rt.plural, ns, name)
            if key in self.store.objects:
                raise ApiError(409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', _details(rt, name))
            for server_field in (
                "resourceVersion",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "selfLink",
                "managedFields",
            ):
                meta.pop(server_field, None)
            meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            if rt.namespaced:
                meta["namespace"] = ns
            self._validate(rt, obj)
            self._default(rt, obj, None)
            if dry_run:
                return obj
            stored = self.store.write(key, obj)
            if rt is PODS:
                runner = PodRunner(self, stored)
                self._runners[runner.uid] = runner
                self._queue.append(runner.uid)
                runner.thread.start()
            elif rt is NAMESPACES:
                self._create(RESOURCES["serviceaccounts"], name, {"metadata": {"name": "default"}})
            return stored

    def _check_kind(self, rt: ResourceType, obj: Obj) -> None:
        if obj.get("kind") not in (None, "", rt.kind):
            raise bad_request(f"the kind of the object ({obj['kind']}) does not match the resource ({rt.plural})")
        if obj.get("apiVersion") not in (None, "", rt.api_version):
            expected = f"does not match the expected API version ({rt.api_version})"
            raise bad_request(f"the API version in the data ({obj['apiVersion']}) {expected}")
        if not isinstance(obj.get("metadata") or {}, dict):
            raise bad_request("metadata must be an object")
        obj["kind"], obj["apiVersion"] = rt.kind, rt.api_version

    def _validate(self, rt: ResourceType, obj: Obj) -> None:
        """The checks of the real server that catch mistakes in manifests (names, labels, pod specs)."""
        meta, name = obj["metadata"], obj["metadata"]["name"]
        pattern, limit, rule = _NAME_RULES.get(rt.plural, _NAME_RULES["*"])
        if not pattern.fullmatch(name) or len(name) > limit:
            raise invalid(rt, name, "metadata.name", f'Invalid value: "{name}": {rule}')
        for attr in ("labels", "annotations"):
            values = meta.get(attr) or {}
            if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
                raise bad_request(f"metadata.{attr} must map strings to strings")
            for k, v in values.items():
                if not _LABEL_VALUE.fullmatch(k.rsplit("/", 1)[-1]) or not 0 < len(k.rsplit("/", 1)[-1]) <= 63:
                    raise invalid(rt, name, f"metadata.{attr}", f'Invalid value: "{k}": {_MSG_LABEL_KEY}')
                if attr == "labels" and (not _LABEL_VALUE.fullmatch(v) or len(v) > 63):
                    raise invalid(rt, name, "metadata.labels", f'Invalid value: "{v}": {_MSG_LABEL_VALUE}')
        for i, ref in enumerate(meta.get("ownerReferences") or []):
            for attr in ("apiVersion", "kind", "name", "uid"):
                if not isinstance(ref, dict) or not ref.get(attr):
                    raise required(rt, name, f"metadata.ownerReferences[{i}].{attr}")
        if rt is PODS:
            self._validate_pod(obj)
        elif rt.plural == "services":
            for i, port in enumerate((obj.get("spec") or {}).get("ports") or []):
                if not isinstance(port, dict) or not isinstance(port.get("port"), int):
                    raise required(rt, name, f"spec.ports[{i}].port")
        elif rt.plural == "roles":
            for i, rule in enumerate(obj.get("rules") or []):
                if not isinstance(rule, dict) or not rule.get("verbs"):
                    raise required(rt, name, f"rules[{i}].verbs")
        elif rt.plural == "rolebindings":
            ref = obj.get("roleRef")
            if not isinstance(ref, dict) or ref.get("kind") not in ("Role", "ClusterRole") or not ref.get("name"):
                raise required(rt, name, "roleRef", "Required value: kind Role or ClusterRole, and name")
        elif rt.plural == "secrets":
            for k, v in (obj.get("data") or {}).items():
                try:
                    base64.b64decode(v, validate=True)
                except (ValueError, TypeError):
                    message = (
                        f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{k!r}]'
                    )
                    raise bad_request(message) from None

    def _validate_pod(self, pod: Obj) -> None:
        name, spec = pod["metadata"]["name"], pod.get("spec")
        containers = spec.get("containers") if isinstance(spec, dict) else None
        if not isinstance(containers, list) or not containers:
            raise required(PODS, name, "spec.containers")
        seen: set[str] = set()
        for i, c in enumerate(containers):
            if not isinstance(c, dict) or not c.get("name"):
                raise required(PODS, name, f"spec.containers[{i}].name")
            if not _DNS_LABEL.fullmatch(c["name"]) or c["name"] in seen:
                raise invalid(PODS, name, f"spec.containers[{i}].name", f'Invalid value: "{c["name"]}": not unique')
            seen.add(c["name"])
            if not c.get("image"):
                raise required(PODS, name, f"spec.containers[{i}].image")
            for attr in ("command", "args"):
                if not isinstance(c.get(attr) or [], list) or not all(isinstance(a, str) for a in c.get(attr) or []):
                    raise bad_request(f"spec.containers[{i}].{attr} must be a list of strings")
            for j, var in enumerate(c.get("env") or []):
                if not isinstance(var, dict) or not var.get("name"):
                    raise required(PODS, name, f"spec.containers[{i}].env[{j}].name")
        policy = spec.get("restartPolicy", "Always")
        if policy not in ("Always", "OnFailure", "Never"):
            message = f'Unsupported value: "{policy}": supported values: "Always", "OnFailure", "Never"'
            raise invalid(PODS, name, "spec.restartPolicy", message, "FieldValueNotSupported")
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if not isinstance(grace, int) or grace < 0:
            raise invalid(PODS, name, "spec.terminationGracePeriodSeconds", f"Invalid value: {grace}: must be >= 0")

    def _default(self, rt: ResourceType, obj: Obj, old: Obj | None) -> None:
        """Server-side defaults and what a create (``old`` None) or an update sets."""
        name = obj["metadata"]["name"]
        if rt is PODS:
            spec = obj["spec"]
            for k, v in _POD_SPEC_DEFAULTS.items():
                spec.setdefault(k, copy.deepcopy(v))
            account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
            spec["serviceAccountName"] = spec["serviceAccount"] = account
            for c in spec["containers"]:
                image = c["image"]
                latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
                c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
                c.setdefault("terminationMessagePath", "/dev/termination-log")
                c.setdefault("terminationMessagePolicy", "File")
                c.setdefault("resources", {})
            if old is None:
                ns = obj["metadata"]["namespace"]
                if ("serviceaccounts", ns, account) not in self.store.objects:
                    message = f'error looking up service account {ns}/{account}: serviceaccount "{account}" not found'
                    raise ApiError(
                        403, "Forbidden", f'pods "{name}" is forbidden: {message}', {"name": name, "kind": "pods"}
                    )
                resources = [c["resources"] for c in spec["containers"]]
                qos = "BestEffort" if not any(r.get("requests") or r.get("limits") for r in resources) else "Burstable"
                obj["status"] = {"phase": "Pending", "qosClass": qos}
            else:
                spec.setdefault("nodeName", old["spec"].get("nodeName"))
                if spec.get("nodeName") is None:
                    spec.pop("nodeName")
                mutable = ("activeDeadlineSeconds", "tolerations")

                def frozen(s: Obj) -> Obj:
                    s = {k: v for k, v in s.items() if k not in mutable}
                    s["containers"] = [{k: v for k, v in c.items() if k != "image"} for c in s.get("containers", [])]
                    return s

                if frozen(spec) != frozen(old["spec"]):
                    raise invalid(PODS, name, "spec", _MSG_POD_UPDATE, "FieldValueForbidden")
        elif rt.plural == "services":
            spec = obj.setdefault("spec", {})
            old_ip = (old or {}).get("spec", {}).get("clusterIP")
            if old_ip and spec.get("clusterIP") not in (None, "", old_ip):
                raise invalid(
                    rt, name, "spec.clusterIPs[0]", f'Invalid value: ["{spec["clusterIP"]}"]: may not change once set'
                )
            if not spec.get("clusterIP"):
                if old_ip:
                    spec["clusterIP"] = old_ip
                else:
                    self._cluster_ip_counter += 1
                    spec["clusterIP"] = "10.96.{}.{}".format(*divmod(self._cluster_ip_counter, 256))
            if spec["clusterIP"] != "None":
                spec["clusterIPs"] = [spec["clusterIP"]]
            for k, v in _SERVICE_SPEC_DEFAULTS.items():
                spec.setdefault(k, copy.deepcopy(v))
            for port in spec.get("ports") or []:
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port["port"])
            if old is None:
                obj["status"] = {"loadBalancer": {}}
        elif rt.plural == "secrets":
            data = obj.get("data") or {}
            for k, v in (obj.pop("stringData", None) or {}).items():
                data[k] = base64.b64encode(str(v).encode()).decode()
            if data:
                obj["data"] = data
            obj.setdefault("type", "Opaque")
        elif rt is NAMESPACES:
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            if old is None:
                obj["status"] = {"phase": "Active"}
        elif rt.plural == "rolebindings" and old is not None and obj.get("roleRef") != old.get("roleRef"):
            raise invalid(rt, name, "roleRef", "Invalid value: cannot change roleRef")

    def _replace(self, rt: ResourceType, ns: str, name: str, body: Any, sub: str | None) -> Obj:
        with self.store.lock:
            old = self.store.objects.get((rt.plural, ns, name))
            if old is None:
                raise not_found(rt, name)
            return self._update(rt, (rt.plural, ns, name), old, body, sub)

    def _patch(self, rt: ResourceType, ns: str, name: str, body: Any, content_type: str, sub: str | None) -> Obj:
        kind = content_type.split(";")[0].strip().lower()
        if kind not in _PATCH_TYPES:
            accepted = ", ".join(_PATCH_TYPES)
            message = f"the body of the request was in an unknown format - accepted media types include: {accepted}"
            raise ApiError(415, "UnsupportedMediaType", message)
        with self.store.lock:
            old = self.store.objects.get((rt.plural, ns, name))
            if old is None:
                raise not_found(rt, name)
            try:
                if isinstance(body, list) and kind == _PATCH_TYPES[0]:
                    new = json_patch(old, body)
                elif isinstance(body, dict):
                    new = merge_patch(old, body)
                else:
                    raise ValueError("the patch must be a JSON object (or, for a JSON patch, a list)")
            except (KeyError, IndexError, ValueError, TypeError) as e:
                raise ApiError(
                    422, "Invalid", f"the server rejected our request due to an error in our request: {e}"
                ) from None
            return self._update(rt, (rt.plural, ns, name), old, new, sub)

    def _update(self, rt: ResourceType, key: Key, old: Obj, body: Any, sub: str | None) -> Obj:
        """Replaces ``old`` by ``body`` (main resource or ``status``), with the server's rules (store lock held)."""
        name = key[2]
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        new = copy.deepcopy(body)
        self._check_kind(rt, new)
        meta = new.get("metadata") or {}
        new["metadata"] = meta
        if meta.get("name") not in (None, "", name):
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        if rt.namespaced and meta.get("namespace") not in (None, "", key[1]):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise conflict(rt, name)
        if sub == "status":
            result = copy.deepcopy(old)
            result["status"] = new.get("status") or {}
        else:
            result = new
            for attr in (
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "generation",
                "generateName",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "resourceVersion",
            ):
                if attr in old["metadata"]:
                    meta[attr] = old["metadata"][attr]
                else:
                    meta.pop(attr, None)
            if rt.has_status:
                result["status"] = copy.deepcopy(old.get("status") or {})
            self._validate(rt, result)
            self._default(rt, result, old)

            def content(obj: Obj) -> Obj:
                return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}

            if content(result) != content(old):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        if result == old:
            return copy.deepcopy(old)
        return self.store.write(key, result)

    def _delete(
        self, rt: ResourceType, ns: str, name: str, query: dict[str, str], options: Obj, wait: bool = True
    ) -> Obj:
        """Deletes one object; pods gracefully (their runner stops the process, then removes the object)."""
        grace_text = query.get("gracePeriodSeconds")
        grace = int(grace_text) if grace_text else options.get("gracePeriodSeconds")
        propagation = query.get("propagationPolicy") or options.get("propagationPolicy")
        if propagation is None and (_truthy(query.get("orphanDependents")) or options.get("orphanDependents")):
            propagation = "Orphan"
        preconditions = options.get("preconditions") or {}
        if rt is NAMESPACES:
            raise ApiError(405, "MethodNotAllowed", "the emulator does not delete namespaces")
        runner: PodRunner | None = None
        with self.store.lock:
            key = (rt.plural, ns, name)
            old = self.store.objects.get(key)
            if old is None:
                raise not_found(rt, name)
            meta = old["metadata"]
            if preconditions.get("uid") not in (None, meta["uid"]):
                why = f"UID in precondition: {preconditions['uid']}, UID in object meta: {meta['uid']}"
                raise conflict(rt, name, f"Precondition failed: {why}")
            if preconditions.get("resourceVersion") not in (None, meta["resourceVersion"]):
                wanted = preconditions["resourceVersion"]
                why = f"ResourceVersion in precondition: {wanted}, ResourceVersion in meta: {meta['resourceVersion']}"
                raise conflict(rt, name, f"Precondition failed: {why}")
            if propagation == "Orphan":
                self._orphan_dependents(meta["uid"])
            if rt is PODS:
                runner = self._runners.get(meta["uid"])
                if grace is None:
                    grace = old["spec"].get("terminationGracePeriodSeconds", 30)
                grace = max(0, int(grace))
                if runner is not None and not runner.done.is_set() and old["spec"].get("nodeName"):
                    if meta.get("deletionTimestamp") and grace >= (meta.get("deletionGracePeriodSeconds") or 0):
                        result = copy.deepcopy(old)
                    else:
                        new = copy.deepcopy(old)
                        new["metadata"].update(deletionTimestamp=_now(grace), deletionGracePeriodSeconds=grace)
                        result = self.store.write(key, new)
                    runner.request_delete(grace)
                    if not (wait and grace == 0):
                        return result
                else:
                    if runner is not None:
                        runner.request_delete(0)
                    return self.store.remove(key)
            else:
                removed = self.store.remove(key)
                if rt.delete_returns_object:
                    return removed
                details = {**_details(rt, name), "uid": meta["uid"]}
                return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
        # grace period 0: the object is gone when the answer comes, as on a real server
        assert runner is not None
        runner.done.wait(timeout=10)
        return runner.removed or result

    def _delete_collection(self, rt: ResourceType, ns: str, query: dict[str, str], options: Obj) -> Obj:
        match = self._matcher(rt, query)
        deleted = []
        for (_, obj_ns, name), obj in self.store.select(rt.plural, ns or None, match):
            try:
                result = self._delete(rt, obj_ns, name, query, options, wait=False)
            except ApiError as e:
                if e.code != 404:
                    raise
                continue
            deleted.append(result if rt.delete_returns_object else copy.deepcopy(obj))
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version,
            "metadata": {"resourceVersion": self.resource_version},
            "items": deleted,
        }
