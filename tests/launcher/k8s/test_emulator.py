"""The Kubernetes API emulator, driven through the official client, unchanged."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests.launcher.k8s.emulator import KubeEmulator

PY = sys.executable


@pytest.fixture
def emu():
    with KubeEmulator() as e:
        yield e


@pytest.fixture
def core(emu):
    with emu.api_client() as api_client:
        yield client.CoreV1Api(api_client)


def pod_body(name, script, *, env=None, labels=None, restart="Never", grace=None):
    spec = {"restartPolicy": restart, "containers": [{"name": "main", "image": "python", "command": [PY, "-c", script], "env": env or []}]}  # fmt: skip
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def collect(core, rv, until, timeout=10, **kwargs):
    """Pod watch events (type, raw object) from ``rv`` until ``until(events)`` holds."""
    events = []
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=timeout, **kwargs):
        events.append((ev["type"], ev["raw_object"]))
        if until(events):
            w.stop()
    assert until(events), f"watch ended early: {[(t, o['status'].get('phase')) for t, o in events]}"
    return events


def test_crud_selectors_patch_and_errors(emu, core):
    for name, labels in (("a", {"app": "x", "tier": "web"}), ("b", {"app": "y"}), ("c", {})):
        cm = core.create_namespaced_config_map(
            "default", {"metadata": {"name": name, "labels": labels}, "data": {"k": name}}
        )
        assert cm.metadata.uid and cm.metadata.namespace == "default" and cm.metadata.creation_timestamp
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    assert exc.value.status == 409 and status_of(exc.value)["reason"] == "AlreadyExists"
    assert core.read_namespaced_config_map("b", "default").data == {"k": "b"}

    def names(**kw):
        return [o.metadata.name for o in core.list_namespaced_config_map("default", **kw).items]

    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app!=x") == ["b", "c"]
    assert names(label_selector="app in (x,y),tier") == ["a"]
    assert names(label_selector="app notin (x)") == ["b", "c"]
    assert names(label_selector="!app") == ["c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    listed = core.list_namespaced_config_map("default")
    assert int(listed.metadata.resource_version) == int(emu.resource_version)

    before = core.read_namespaced_config_map("a", "default").metadata.resource_version
    core.patch_namespaced_config_map("a", "default", {"metadata": {"labels": {"tier": None, "new": "1"}}})
    patched = core.patch_namespaced_config_map(
        "a", "default", {"data": {"k2": "v"}}, _content_type="application/merge-patch+json"
    )
    assert patched.metadata.labels == {"app": "x", "new": "1"} and patched.data == {"k": "a", "k2": "v"}
    assert int(patched.metadata.resource_version) > int(before)
    stale = core.read_namespaced_config_map("b", "default")
    core.replace_namespaced_config_map("b", "default", {"metadata": {"name": "b"}, "data": {"k": "new"}})
    stale.data = {"k": "stale"}
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map("b", "default", stale)
    assert exc.value.status == 409 and status_of(exc.value)["reason"] == "Conflict"

    core.delete_namespaced_config_map("a", "default")
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("a", "default")
    assert exc.value.status == 404
    assert status_of(exc.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 404, "reason": "NotFound",
        "message": 'configmaps "a" not found', "details": {"name": "a", "group": "", "kind": "configmaps"},
    }  # fmt: skip
    with pytest.raises(ApiException) as exc:
        core.delete_namespaced_config_map("a", "default")
    assert exc.value.status == 404

    # the other kinds: secrets (stringData), services, service accounts, RBAC
    secret = core.create_namespaced_secret("default", {"metadata": {"name": "s"}, "stringData": {"pw": "hunter2"}})
    assert secret.data == {"pw": "aHVudGVyMg=="} and secret.type == "Opaque"
    svc = core.create_namespaced_service("default", {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}})
    assert svc.spec.cluster_ip and core.delete_namespaced_service("svc", "default").metadata.name == "svc"
    core.create_namespaced_service_account("default", {"metadata": {"name": "worker"}})
    with emu.api_client() as api_client:
        rbac = client.RbacAuthorizationV1Api(api_client)
        rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]}]
        rbac.create_namespaced_role("default", {"metadata": {"name": "r"}, "rules": rules})
        rbac.create_namespaced_role_binding(
            "default",
            {
                "metadata": {"name": "rb"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
                "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": "default"}],
            },
        )
        assert [r.metadata.name for r in rbac.list_namespaced_role_binding("default").items] == ["rb"]
        with pytest.raises(ApiException) as exc:
            rbac.read_namespaced_role("nope", "default")
        assert status_of(exc.value)["message"] == 'roles.rbac.authorization.k8s.io "nope" not found'
    generated = core.create_namespaced_config_map("default", {"metadata": {"generateName": "gen-"}})
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9


def test_unknown_namespace_and_authentication(emu, core):
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("ghost", {"metadata": {"name": "a"}})
    assert exc.value.status == 404 and status_of(exc.value)["message"] == 'namespaces "ghost" not found'
    for call in (lambda: core.read_namespaced_pod("p", "ghost"), lambda: core.read_namespace("ghost")):
        with pytest.raises(ApiException) as exc:
            call()
        assert exc.value.status == 404 and status_of(exc.value)["reason"] == "NotFound"
    assert core.list_namespaced_pod("ghost").items == []  # as a real API server answers
    emu.add_namespace("ghost")
    core.create_namespaced_config_map("ghost", {"metadata": {"name": "a"}})
    assert core.read_namespace("ghost").status.phase == "Active"

    with KubeEmulator(strict_namespaces=True) as strict, strict.api_client() as api_client:
        with pytest.raises(ApiException) as exc:
            client.CoreV1Api(api_client).list_namespaced_pod("ghost")
        assert exc.value.status == 404

    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(f"{emu.url}/api/v1/namespaces/default/pods", timeout=5)
    assert http_err.value.code == 401
    cfg = emu.client_configuration()
    cfg.api_key = {"BearerToken": "wrong"}
    with client.ApiClient(cfg) as api_client, pytest.raises(ApiException) as exc:
        client.CoreV1Api(api_client).list_namespaced_pod("default")
    assert exc.value.status == 401


def test_deny_gives_403(emu, core):
    emu.deny("create", "pods")
    emu.deny("watch", "pods")
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("default", pod_body("p", "pass"))
    assert exc.value.status == 403
    body = status_of(exc.value)
    assert body["reason"] == "Forbidden"
    assert body["message"] == (
        'pods is forbidden: User "system:serviceaccount:default:default" cannot create resource "pods" '
        'in API group "" in the namespace "default"'
    )
    assert core.list_namespaced_pod("default").items == []  # list is still allowed
    with pytest.raises(ApiException) as exc:
        next(iter(watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=1)))
    assert exc.value.status == 403
    emu.allow("create", "pods")
    core.create_namespaced_pod("default", pod_body("p", "pass"))


def test_watch_after_compaction_gets_410(emu, core):
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    old_rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
    emu.compact()

    # on the wire: one ERROR event carrying a Status 410 Expired, then the stream ends
    resp = core.list_namespaced_config_map(
        "default", watch=True, resource_version=old_rv, timeout_seconds=5, _preload_content=False
    )
    lines = [json.loads(line) for line in resp.data.splitlines()]
    assert len(lines) == 1 and lines[0]["type"] == "ERROR"
    assert lines[0]["object"]["code"] == 410 and lines[0]["object"]["reason"] == "Expired"

    # the official Watch turns it into ApiException(410) (at once when timeout_seconds is given)
    start = time.monotonic()
    with pytest.raises(ApiException) as exc:
        list(
            watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=old_rv, timeout_seconds=5)
        )
    assert exc.value.status == 410 and exc.value.reason.startswith("Expired: too old resource version")
    # without timeout_seconds it retries once from the same resourceVersion, then raises the same
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=old_rv))
    assert exc.value.status == 410 and time.monotonic() - start < 3

    # the current resourceVersion is still watchable; so is a re-list
    fresh = core.list_namespaced_config_map("default").metadata.resource_version
    assert list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=fresh, timeout_seconds=1)) == []  # fmt: skip


def test_history_limit_expires_old_versions():
    with KubeEmulator(history_limit=3) as emu, emu.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        rvs = [core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}}).metadata.resource_version for i in range(5)]  # fmt: skip
        events = list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=rvs[1], timeout_seconds=1))  # fmt: skip
        assert [e["object"].metadata.name for e in events] == ["c2", "c3", "c4"]
        with pytest.raises(ApiException) as exc:
            list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=rvs[0], timeout_seconds=1))  # fmt: skip
        assert exc.value.status == 410


def test_watch_resumes_from_resource_version_without_gaps(emu, core):
    core.create_namespaced_config_map("default", {"metadata": {"name": "a", "labels": {"w": "1"}}})
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", {"metadata": {"name": "b", "labels": {"w": "1"}}})
    core.create_namespaced_config_map("default", {"metadata": {"name": "other"}})
    core.patch_namespaced_config_map("a", "default", {"data": {"x": "1"}})

    def writer():
        core.create_namespaced_config_map("default", {"metadata": {"name": "c", "labels": {"w": "1"}}})
        core.patch_namespaced_config_map("b", "default", {"metadata": {"labels": {"w": None}}})  # leaves the selector
        core.delete_namespaced_config_map("a", "default")

    seen, w, thread = [], watch.Watch(), threading.Thread(target=writer)
    for ev in w.stream(core.list_namespaced_config_map, "default", label_selector="w=1", resource_version=rv, timeout_seconds=10):  # fmt: skip
        seen.append((ev["type"], ev["object"].metadata.name, int(ev["object"].metadata.resource_version)))
        if len(seen) == 2:
            thread.start()  # live events after the replayed ones
        if ev["type"] == "DELETED" and ev["object"].metadata.name == "a":
            w.stop()
    thread.join(timeout=5)
    assert [s[:2] for s in seen] == [
        ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("ADDED", "c"),
        ("DELETED", "b"),
        ("DELETED", "a"),
    ]
    assert [s[2] for s in seen] == sorted(s[2] for s in seen) and seen[0][2] > int(rv)

    # resume from the resourceVersion of the last event seen: nothing is replayed twice, nothing is missed
    core.create_namespaced_config_map("default", {"metadata": {"name": "d", "labels": {"w": "1"}}})
    resumed = list(watch.Watch().stream(core.list_namespaced_config_map, "default", label_selector="w=1", resource_version=str(seen[-1][2]), timeout_seconds=1))  # fmt: skip
    assert [(e["type"], e["object"].metadata.name) for e in resumed] == [("ADDED", "d")]


def test_duplicate_pod_events(emu, core):
    rv = emu.resource_version
    emu.inject_duplicate_events(True)
    core.create_namespaced_pod("default", pod_body("dup", "pass"))
    events = collect(core, rv, lambda evs: sum(o["status"].get("phase") == "Succeeded" for _, o in evs) == 2)
    rvs = [o["metadata"]["resourceVersion"] for _, o in events]
    assert rvs[0::2] == rvs[1::2]


def test_pod_runs_with_secret_and_downward_env_then_fails(emu, core):
    core.create_namespaced_secret("default", {"metadata": {"name": "creds"}, "data": {"x": "c2VjcmV0LXZhbHVl"}})
    core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}, "data": {"mode": "fast"}})
    env = [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "x"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
        {"name": "ADDR", "value": "$(IP):2222/$(NAME)/$$(NAME)/$(UNDEFINED)"},
    ]
    script = "import os,sys; print(os.environ['X']); print(*(os.environ[k] for k in ('MODE','NAME','NS','UID','IP','ROLE','ADDR')), sep='|'); sys.exit(3)"  # fmt: skip
    rv = emu.resource_version
    created = core.create_namespaced_pod("default", pod_body("job", script, env=env, labels={"role": "worker"}))
    assert created.status.phase == "Pending"
    events = collect(core, rv, lambda evs: evs[-1][1]["status"].get("phase") == "Failed")
    phases = [o["status"]["phase"] for _, o in events]
    assert [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]] == ["Pending", "Running", "Failed"]

    pod = core.read_namespaced_pod("job", "default")
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (3, "Error")
    ip = pod.status.pod_ip
    log = core.read_namespaced_pod_log("job", "default")
    assert log == f"secret-value\nfast|job|default|{pod.metadata.uid}|{ip}|worker|{ip}:2222/job/$(NAME)/$(UNDEFINED)\n"
    assert core.read_namespaced_pod_log("job", "default", tail_lines=1).startswith("fast|job")


def test_missing_secret_keeps_pod_pending_until_created(emu, core):
    env = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "later", "key": "x"}}}]
    core.create_namespaced_pod("default", pod_body("waits", "import os; print(os.environ['X'])", env=env))

    def waiting_reason():
        statuses = emu.pod("waits")["status"].get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("waiting", {}).get("reason")

    emu.wait_for(lambda: waiting_reason() == "CreateContainerConfigError", 5)
    assert emu.pod("waits")["status"]["phase"] == "Pending"
    core.create_namespaced_secret("default", {"metadata": {"name": "later"}, "stringData": {"x": "now"}})
    emu.wait_for(lambda: emu.pod("waits")["status"]["phase"] == "Succeeded", 5)
    assert core.read_namespaced_pod_log("waits", "default") == "now\n"


def test_pods_get_distinct_bindable_loopback_ips(emu, core):
    with socket.socket() as held:  # the test holds 127.0.0.1:port; pods bind the same port on their own IP
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        script = f"import os,socket; s=socket.socket(); s.bind((os.environ['IP'], {port})); s.listen(); print('bound', s.getsockname()[0])"  # fmt: skip
        env = [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        for name in ("w0", "w1"):
            core.create_namespaced_pod("default", pod_body(name, script, env=env))
        emu.wait_for(lambda: all(emu.pod(n)["status"]["phase"] in ("Succeeded", "Failed") for n in ("w0", "w1")), 5)
    ips = []
    for name in ("w0", "w1"):
        pod = core.read_namespaced_pod(name, "default")
        assert pod.status.phase == "Succeeded", core.read_namespaced_pod_log(name, "default")
        assert core.read_namespaced_pod_log(name, "default") == f"bound {pod.status.pod_ip}\n"
        ips.append(pod.status.pod_ip)
    assert len(set(ips)) == 2 and all(ip.startswith("127.0.0.") and ip != "127.0.0.1" for ip in ips)


TRAP = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(0)))
print('ready', flush=True)
while True:
    time.sleep(0.05)
"""


def test_delete_running_pod_sends_sigterm_then_removes_it(emu, core):
    core.create_namespaced_pod("default", pod_body("trap", TRAP, grace=10))
    emu.wait_for(lambda: "ready" in emu.pod_log("trap"), 5)
    rv = emu.resource_version
    start = time.monotonic()
    deleted = core.delete_namespaced_pod("trap", "default")
    assert deleted.metadata.deletion_timestamp is not None and deleted.metadata.deletion_grace_period_seconds == 10
    events = collect(core, rv, lambda evs: evs[-1][0] == "DELETED")
    assert time.monotonic() - start < 5  # SIGTERM, not the SIGKILL after 10 s
    final = events[-1][1]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (final["exitCode"], final["reason"]) == (0, "Completed")
    assert emu.pods() == []
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("trap", "default")
    assert exc.value.status == 404


def test_delete_kills_after_grace_period(emu, core):
    script = (
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    core.create_namespaced_pod("default", pod_body("stubborn", script, grace=1))
    emu.wait_for(lambda: "ready" in emu.pod_log("stubborn"), 5)
    rv, start = emu.resource_version, time.monotonic()
    core.delete_namespaced_pod("stubborn", "default")
    events = collect(core, rv, lambda evs: evs[-1][0] == "DELETED")
    assert 1.0 <= time.monotonic() - start < 5
    assert events[-1][1]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_capacity_restarts_oom_eviction_and_garbage_collection(emu, core, tmp_path):
    emu.set_capacity(1)
    core.create_namespaced_pod("default", pod_body("long", TRAP, restart="Always", grace=5))
    core.create_namespaced_pod("default", pod_body("queued", "print('ran')"))
    emu.wait_for(lambda: "ready" in emu.pod_log("long"), 5)
    conditions = emu.wait_for(lambda: emu.pod("queued")["status"].get("conditions"), 5)
    assert conditions[0]["type"] == "PodScheduled" and conditions[0]["reason"] == "Unschedulable"
    assert emu.pod("queued")["status"]["phase"] == "Pending"

    # OOM: the Always pod restarts in place (same IP), reporting the kill
    ip = emu.pod("long")["status"]["podIP"]
    emu.simulate_oom("long")
    emu.wait_for(lambda: emu.pod("long")["status"]["containerStatuses"][0]["restartCount"] == 1, 5)
    emu.wait_for(lambda: "running" in emu.pod("long")["status"]["containerStatuses"][0]["state"], 5)
    status = emu.pod("long")["status"]
    assert status["podIP"] == ip and status["phase"] == "Running"
    assert status["containerStatuses"][0]["lastState"]["terminated"] == {**status["containerStatuses"][0]["lastState"]["terminated"], "exitCode": 137, "reason": "OOMKilled"}  # fmt: skip

    # eviction frees the slot; the queued pod then runs
    emu.evict("long")
    emu.wait_for(lambda: emu.pod("long")["status"].get("reason") == "Evicted", 5)
    assert emu.pod("long")["status"]["phase"] == "Failed"
    emu.wait_for(lambda: emu.pod("queued")["status"]["phase"] == "Succeeded", 5)

    # OnFailure: restarted until it succeeds
    script = "import os,sys; p='restart-marker-' + os.environ['HOSTNAME']; first = not os.path.exists(p); open(p,'w').close(); sys.exit(1 if first else 0)"  # fmt: skip
    emu.set_capacity(None)
    body = pod_body("flaky", script, restart="OnFailure")
    body["spec"]["containers"][0]["workingDir"] = str(tmp_path)
    core.create_namespaced_pod("default", body)
    emu.wait_for(lambda: emu.pod("flaky")["status"]["phase"] == "Succeeded", 5)
    assert emu.pod("flaky")["status"]["containerStatuses"][0]["restartCount"] == 1

    # garbage collection: dependents of a deleted owner are deleted
    owner = core.read_namespaced_pod("queued", "default").metadata
    ref = {"apiVersion": "v1", "kind": "Pod", "name": owner.name, "uid": owner.uid}
    core.create_namespaced_config_map("default", {"metadata": {"name": "dep", "ownerReferences": [ref]}})
    core.create_namespaced_pod("default", {**pod_body("child", TRAP, grace=5), "metadata": {"name": "child", "ownerReferences": [ref]}})  # fmt: skip
    emu.wait_for(lambda: "ready" in emu.pod_log("child"), 5)
    core.delete_namespaced_pod("queued", "default")
    emu.wait_for(lambda: emu.pod("child") is None and not core.list_namespaced_config_map("default", field_selector="metadata.name=dep").items, 5)  # fmt: skip


def test_pod_process_reaches_the_api_through_kubeconfig(emu, core, tmp_path):
    script = textwrap.dedent("""
        from kubernetes import client, config
        config.load_config()
        pods = client.CoreV1Api().list_namespaced_pod("default", label_selector="app=self")
        print(sorted(p.metadata.name for p in pods.items))
    """)
    core.create_namespaced_pod("default", pod_body("me", script, labels={"app": "self"}))
    # The pod imports kubernetes: seconds of CPU, more under load.
    emu.wait_for(lambda: emu.pod("me")["status"]["phase"] in ("Succeeded", "Failed"), 60)
    assert core.read_namespaced_pod_log("me", "default") == "['me']\n"
    # and a test-side kubeconfig works too
    path = tmp_path / "kubeconfig"
    emu.write_kubeconfig(path)
    with config.new_client_from_config(config_file=str(path)) as api_client:
        assert [p.metadata.name for p in client.CoreV1Api(api_client).list_namespaced_pod("default").items] == ["me"]


def test_log_follow_status_subresource_and_all_namespaces(emu, core):
    script = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.1)"
    core.create_namespaced_pod("default", pod_body("talker", script, labels={"app": "t"}))
    emu.wait_for(lambda: emu.pod("talker")["status"]["phase"] != "Pending", 5)
    lines = list(watch.Watch().stream(core.read_namespaced_pod_log, name="talker", namespace="default"))
    assert lines == ["0", "1", "2"]
    emu.wait_for(lambda: emu.pod("talker")["status"]["phase"] == "Succeeded", 5)

    core.patch_namespaced_pod("talker", "default", {"metadata": {"labels": {"seen": "yes"}}, "status": {"phase": "X"}})
    assert (
        core.read_namespaced_pod("talker", "default").status.phase == "Succeeded"
    )  # status ignored on the main resource
    core.patch_namespaced_pod_status("talker", "default", {"status": {"message": "noted"}})
    assert core.read_namespaced_pod_status("talker", "default").status.message == "noted"

    emu.add_namespace("other")
    core.create_namespaced_pod("other", pod_body("talker", "pass", labels={"app": "t"}))
    pods = core.list_pod_for_all_namespaces(label_selector="app=t").items
    assert [(p.metadata.namespace, p.metadata.name) for p in pods] == [("default", "talker"), ("other", "talker")]
    assert [p["metadata"]["name"] for p in emu.pods(label_selector="seen=yes")] == ["talker"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_close_kills_every_process_and_its_children():
    script = "import subprocess,time; c=subprocess.Popen(['sleep','60']); print(c.pid, flush=True); time.sleep(60)"
    with KubeEmulator() as emu, emu.api_client() as api_client:
        client.CoreV1Api(api_client).create_namespaced_pod("default", pod_body("parent", script))
        child = int(emu.wait_for(lambda: emu.pod_log("parent").strip(), 5))
        parent = emu.pod_pid("parent")
        assert parent and alive(parent) and alive(child)
    KubeEmulator.wait_for(lambda: not alive(parent) and not alive(child), 5)


def test_discovery_serves_the_dynamic_client(emu):
    from kubernetes.dynamic import DynamicClient

    with emu.api_client() as api_client:
        dynamic = DynamicClient(api_client, cache_file=None)
        roles = dynamic.resources.get(api_version="rbac.authorization.k8s.io/v1", kind="Role")
        configmaps = dynamic.resources.get(api_version="v1", kind="ConfigMap")
        assert (roles.namespaced, configmaps.namespaced) == (True, True)
        assert dynamic.resources.get(api_version="v1", kind="Namespace").namespaced is False
        assert "status" in dynamic.resources.get(api_version="v1", kind="Pod").subresources
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
        configmaps.create(body=body, namespace="default")
        configmaps.patch(name="c", namespace="default", body={"data": {"k": "w"}},
                         content_type="application/merge-patch+json")  # fmt: skip
        assert configmaps.get(name="c", namespace="default").data.k == "w"
        configmaps.delete(name="c", namespace="default")
        assert configmaps.get(namespace="default").items == []
