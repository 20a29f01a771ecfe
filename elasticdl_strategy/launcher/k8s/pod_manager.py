"""The master's pod manager: creates the worker pods, watches them, relaunches and finishes the job.

Decisions per worker pod (``decide``):

* exits 0 (Succeeded): training finished; the job succeeds once every worker
  pod has ended (standbys exit 0 by themselves);
* deleted, evicted or preempted before ending, or exited 128-255 (killed by a
  signal): relaunched under a new worker id while the restart budget lasts,
  after a backoff of 1 s that doubles with every relaunch in a row of one worker
  slot whose pods did not run for a minute (up to 60 s; Kubernetes'
  CrashLoopBackOff): a wave of evictions is replaced within a second, a pod
  that keeps crashing ever more slowly;
* OOMKilled, or exited 1-127 (an error in the program): not relaunched
  unless ``--relaunch-on-error``; reported with its reason;
* the job fails when fewer than ``--min-workers`` workers remain alive and the
  budget cannot replace them, with a message saying why.

The status ConfigMap is written at most once a second (and at the end):
at hundreds of pods, writing it at every pod event would make the master the
API server's busiest client.

Watch events are applied idempotently. resourceVersions are opaque strings
(the API promises no order between them): an event whose (uid,
resourceVersion) equals the last one seen is a duplicate, and order comes
from the watch stream itself and from the pod lifecycle, whose phase never
goes back (Pending, then Running, then Succeeded or Failed), so an event
that would move a pod back is a late one and is ignored. Any phase may follow
Pending (a pod can fail before running). The watch resumes from the last
resourceVersion and re-lists on 410 Gone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from elasticdl_strategy.launcher.k8s import manifests
from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig

logger = logging.getLogger(__name__)

# Reasons (pod.status.reason) of pods removed by the cluster rather than by a failure of the program.
_CLUSTER_REASONS = {"Evicted", "Preempting", "Preempted", "NodeShutdown", "Shutdown", "Terminated", "NodeLost"}
_BACKOFF_START_S, _BACKOFF_CAP_S = 1.0, 60.0
# A pod that ran this long ended its slot's run of crashes: its replacement starts the backoff again.
_STABLE_RUN_S = 60.0
_STATUS_INTERVAL_S = 1.0
_WATCH_TIMEOUT_S = 5
_API_TIMEOUT_S = 30
_RETRY_PAUSE_S = 2.0


@dataclasses.dataclass
class WorkerPod:
    """What the manager knows of one worker pod."""

    index: int
    name: str
    phase: str = "Pending"
    exit_code: Optional[int] = None
    reason: str = ""
    uid: Optional[str] = None
    resource_version: Optional[str] = None  # of the last event applied; None: none seen yet
    deleted: bool = False  # deleted or being deleted
    gone: bool = False  # the DELETED event arrived
    handled: bool = False  # its end was acted upon (relaunched, accepted or reported)
    running_since: Optional[float] = None  # the manager's clock when it was first seen Running
    crashes_before: int = 0  # pods of its slot before it, in a row, that ended without a stable run
    crashes: int = 0  # once ended: those and itself if it did not run stably (0 if it did)

    @property
    def ended(self) -> bool:
        return self.phase in ("Succeeded", "Failed") or (self.deleted and self.gone)

    def describe(self) -> str:
        if self.exit_code is not None:
            return f"{self.name} exited with code {self.exit_code}" + (f" ({self.reason})" if self.reason else "")
        if self.deleted:
            return f"{self.name} was deleted" + (f" ({self.reason})" if self.reason else "")
        return f"{self.name} is {self.phase}" + (f" ({self.reason})" if self.reason else "")


def decide(pod: WorkerPod, relaunch_on_error: bool, training_finished: bool = True) -> str:
    """What to do about an ended worker: ``"finished"``, ``"relaunch"`` or ``"failed"``.

    ``training_finished``: the coordinator learned that training finished. A
    worker exiting 0 before that left gracefully (SIGTERM: deleted, evicted,
    node shutdown) and is replaced.
    """
    cluster_removed = pod.deleted or pod.reason in _CLUSTER_REASONS
    if cluster_removed and pod.reason != "OOMKilled" and (pod.exit_code in (None, 0) or pod.exit_code >= 128):
        return "relaunch"  # deleted, evicted or preempted (a graceful leave exits 0)
    if pod.phase == "Succeeded" or pod.exit_code == 0:
        return "finished" if training_finished else "relaunch"
    if pod.reason == "OOMKilled":
        return "relaunch" if relaunch_on_error else "failed"
    if pod.exit_code is not None and 1 <= pod.exit_code <= 127 and pod.reason not in _CLUSTER_REASONS:
        return "relaunch" if relaunch_on_error else "failed"
    return "relaunch"  # deleted, evicted, preempted, or killed by a signal (128-255)


# The status ConfigMap stays far below Kubernetes' 1 MiB object limit at any job size: every pod
# not ended is listed, but of the ended ones and of the failures only the newest are, the rest counted.
STATUS_ENDED_PODS = 100
STATUS_FAILURES = 20


def index_ranges(indices: Set[int]) -> str:
    """``{0, 1, 2, 5, 7, 8}`` as ``"0-2,5,7-8"``: the settled worker indices, whatever their number.

    >>> index_ranges({0, 1, 2, 5, 7, 8}), parse_index_ranges("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    ('0-2,5,7-8', True)
    """
    runs: List[List[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_index_ranges(text: str) -> Set[int]:
    indices: Set[int] = set()
    for run in filter(None, text.split(",")):
        first, _, last = run.partition("-")
        indices.update(range(int(first), int(last or first) + 1))
    return indices


def _worker_index(obj: Any) -> Optional[int]:
    """The worker index in a pod's labels, or None if it has none (not one of our worker pods)."""
    try:
        return int((obj.metadata.labels or {}).get(manifests.WORKER_ID_LABEL, ""))
    except ValueError:
        return None


# A pod's phase only moves forward; an event that would move it back arrived late.
_PHASE_ORDER = {"Pending": 0, "Running": 1, "Unknown": 1, "Succeeded": 2, "Failed": 2}


def _is_stale(pod: WorkerPod, kind: str, obj: Any) -> bool:
    """Whether a watch event of ``pod`` adds nothing: a duplicate, or older than what is known."""
    if kind == "DELETED":
        return False
    if (obj.metadata.uid, obj.metadata.resource_version) == (pod.uid, pod.resource_version):
        return True
    phase = obj.status.phase if obj.status is not None else None
    return phase is not None and _PHASE_ORDER.get(phase, 0) < _PHASE_ORDER.get(pod.phase, 0)


@dataclasses.dataclass
class JobOutcome:
    phase: str  # "Succeeded" or "Failed"
    message: str


class PodManager:
    """Keeps a job's worker pods (see the module docstring for the policy).

    Args:
        api: a ``kubernetes.client.CoreV1Api``.
        config: the job.
        owner: the master pod (``{"name", "uid"}``) that owns every worker pod.
        coordinator_address: ``host:port`` workers dial.
        membership_version: returns the coordinator's membership version (for the status).
    """

    def __init__(
        self,
        api,
        config: K8sJobConfig,
        owner: Dict[str, str],
        coordinator_address: str,
        membership_version: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
        training_finished: Callable[[], bool] = lambda: True,
    ):
        self.api = api
        self.config = config
        self.owner = owner
        self.coordinator_address = coordinator_address
        self.membership_version = membership_version
        self.training_finished = training_finished
        self.clock = clock
        self.pods: Dict[str, WorkerPod] = {}
        self.restarts = 0
        self.next_index = 0
        self.pending_relaunches: List[Tuple[float, str]] = []  # (due time, pod it replaces)
        # Ended pods whose end was fully dealt with (replaced, accepted or reported), kept in the status
        # so that a restarted master neither replaces them twice nor forgets a replacement it owed.
        self.settled: Set[int] = set()  # indices of the worker pods whose end was dealt with
        self.failures: List[str] = []
        self.earlier_failures = 0  # failures before a master restart that the status only counted
        self.finished = False
        self.outcome: Optional[JobOutcome] = None
        self._status_written = ""
        self._next_status_write = float("-inf")

    # ---- pods -------------------------------------------------------------------------------

    def create_worker(self) -> WorkerPod:
        index = self.next_index
        self.next_index += 1
        body = manifests.worker_pod(self.config, index, self.coordinator_address, self.owner)
        pod = WorkerPod(index, self.config.worker_name(index))
        self.api.create_namespaced_pod(self.config.namespace, body, _request_timeout=_API_TIMEOUT_S)
        self.pods[pod.name] = pod  # only once it exists: a refused create must not count as a live worker
        logger.info("created %s", pod.name)
        return pod

    def start(self) -> None:
        """Adopts the job's existing worker pods (after a master restart), or creates the first ones."""
        self._read_previous_status()
        existing = self.api.list_namespaced_pod(
            self.config.namespace, label_selector=manifests.selector(self.config, "worker")
        )
        for item in existing.items:
            index = _worker_index(item)
            if index is None:
                continue  # not one of ours
            if index in self.settled:
                self.pods[item.metadata.name] = WorkerPod(index, item.metadata.name, handled=True)
            self.apply("ADDED", item)
        if self.pods:
            self.next_index = 1 + max(p.index for p in self.pods.values())
            logger.info("adopted %d existing worker pods", len(self.pods))
        else:
            for _ in range(self.config.workers):
                self.create_worker()
        self._resource_version = existing.metadata.resource_version

    def _read_previous_status(self) -> None:
        """After a master restart: the restarts used and the pods already dealt with."""
        try:
            data = self.api.read_namespaced_config_map(self.config.status_name, self.config.namespace).data or {}
        except Exception as e:  # noqa: BLE001 - no status yet (a new job) or unreadable: start afresh
            logger.debug("no previous status: %s", e)
            return
        self.restarts = int(data.get("restarts", "0") or 0)
        self.settled = parse_index_ranges(data.get("settled", ""))
        self.failures = list(json.loads(data.get("failures", "[]") or "[]"))
        self.earlier_failures = int(data.get("failures_total", "0") or 0) - len(self.failures)

    # ---- events -----------------------------------------------------------------------------

    def apply(self, kind: str, obj: Any) -> None:
        """Applies one watch event (``ADDED``/``MODIFIED``/``DELETED``) of a worker pod; idempotent."""
        name = obj.metadata.name
        pod = self.pods.get(name)
        if pod is None:
            index = _worker_index(obj)
            if index is None:
                return  # not one of ours
            pod = self.pods[name] = WorkerPod(index, name)
        if _is_stale(pod, kind, obj):
            return
        pod.uid, pod.resource_version = obj.metadata.uid, obj.metadata.resource_version
        status = obj.status
        if status is not None:
            pod.phase = status.phase or pod.phase
            if pod.phase == "Running" and pod.running_since is None:
                pod.running_since = self.clock()
            pod.reason = status.reason or pod.reason
            for container in status.container_statuses or []:
                terminated = container.state.terminated if container.state else None
                if terminated is not None:
                    pod.exit_code = terminated.exit_code
                    pod.reason = (
                        terminated.reason if terminated.reason not in (None, "Error", "Completed") else pod.reason
                    )
        if kind == "DELETED":
            pod.gone = True
        if kind == "DELETED" or obj.metadata.deletion_timestamp is not None:
            # Deleted (or being deleted: the worker may leave gracefully and exit 0 on the SIGTERM,
            # which must not read as the end of training).
            pod.deleted = True
        self._act_on(pod)

    def _act_on(self, pod: WorkerPod) -> None:
        if not pod.ended or pod.handled:
            return
        pod.handled = True
        action = decide(pod, self.config.relaunch_on_error, self.training_finished())
        if action != "relaunch" or self.finished:
            self.settled.add(pod.index)
        if action == "finished":
            if not self.finished:
                logger.info("%s finished: training is done", pod.name)
            self.finished = True
            return
        if self.finished:
            return  # the job is winding down: nothing to replace
        if action == "relaunch" and self.restarts + len(self.pending_relaunches) < self.config.max_restarts:
            pod.crashes = 0 if self._ran_stably(pod) else pod.crashes_before + 1
            delay = min(_BACKOFF_CAP_S, _BACKOFF_START_S * 2 ** max(0, pod.crashes - 1))
            self.pending_relaunches.append((self.clock() + delay, pod.name))
            logger.warning("%s: relaunching it as a new worker in %.0fs", pod.describe(), delay)
            return
        why = "restart budget spent" if action == "relaunch" else "not relaunched"
        if action == "failed" and pod.reason == "OOMKilled":
            why += "; raise --memory"
        elif action == "failed":
            why += " (an error in the program; --relaunch-on-error to relaunch anyway)"
        message = f"{pod.describe()}: {why}"
        logger.error(message)
        self.failures.append(message)

    def _ran_stably(self, pod: WorkerPod) -> bool:
        return pod.running_since is not None and self.clock() - pod.running_since >= _STABLE_RUN_S

    def relaunch_due(self) -> None:
        now = self.clock()
        due = [name for t, name in self.pending_relaunches if t <= now]
        self.pending_relaunches = [(t, name) for t, name in self.pending_relaunches if t > now]
        from kubernetes.client.exceptions import ApiException

        for replaced in due:
            if self.finished:
                break
            self.restarts += 1
            self.settled.add(self.pods[replaced].index)
            try:
                pod = self.create_worker()
                pod.crashes_before = self.pods[replaced].crashes
            except ApiException as e:  # quota, admission webhook, RBAC: counts against the budget
                message = f"relaunch {self.restarts} refused by the API: {e.status} {e.reason}"
                logger.error(message)
                self.failures.append(message)
                continue
            except Exception as e:  # noqa: BLE001 - a connection error: counts against the budget too
                message = f"relaunch {self.restarts} failed: {e}"
                logger.error(message)
                self.failures.append(message)
                continue
            logger.warning("relaunched: %s (restart %d of %d)", pod.name, self.restarts, self.config.max_restarts)

    # ---- the job ----------------------------------------------------------------------------

    def alive(self) -> List[WorkerPod]:
        return [p for p in self.pods.values() if not p.ended]

    def check_outcome(self) -> Optional[JobOutcome]:
        """The job's end, once it is decided."""
        alive = self.alive()
        # Pods seen Pending (unschedulable standbys, relaunches waiting for room) don't hold up the end.
        if self.finished and all(p.phase == "Pending" and p.resource_version is not None for p in alive):
            return JobOutcome("Succeeded", "training finished")  # pods still Pending are deleted
        if self.finished or self.pending_relaunches:
            return None
        min_workers = self.config.counts.min_workers
        if len(alive) < min_workers and self.failures:
            return JobOutcome(
                "Failed",
                f"{len(alive)} worker(s) left, fewer than --min-workers={min_workers}, and none can be "
                f"relaunched ({self.restarts} of {self.config.max_restarts} restarts used): " + self._failures_text(),
            )
        return None

    def _failures_text(self, shown: int = 5) -> str:
        more = self.earlier_failures + max(0, len(self.failures) - shown)
        return "; ".join(self.failures[-shown:]) + (f" (and {more} earlier)" if more else "")

    def status(self) -> Dict[str, str]:
        """The job's status ConfigMap: phase, message, the pods not ended and the newest ended ones,
        restarts, settled indices and the newest failures (bounded at any job size)."""
        ended = [p for p in sorted(self.pods.values(), key=lambda p: p.index) if p.ended]
        listed = sorted([*self.alive(), *ended[-STATUS_ENDED_PODS:]], key=lambda p: p.index)
        workers = {
            p.name: {"phase": "Deleted" if p.deleted else p.phase, "exit_code": p.exit_code, "reason": p.reason}
            for p in listed
        }
        phase = self.outcome.phase if self.outcome else ("Finishing" if self.finished else "Running")
        message = self.outcome.message if self.outcome else f"{len(self.alive())} worker(s) alive"
        return {
            "phase": phase,
            "message": message,
            "workers": json.dumps(workers, sort_keys=True),
            "workers_not_listed": str(len(self.pods) - len(listed)),
            "restarts": str(self.restarts),
            "membership_version": str(self.membership_version()),
            "settled": index_ranges(self.settled),
            "failures": json.dumps(self.failures[-STATUS_FAILURES:]),
            "failures_total": str(self.earlier_failures + len(self.failures)),
        }

    def write_status(self, force: bool = False) -> None:
        """Writes the status if it changed, at most once per :data:`_STATUS_INTERVAL_S` unless ``force``
        (a change held back is written by a later call: the watch loop makes one at least every
        ``_WATCH_TIMEOUT_S``)."""
        if not force and self.clock() < self._next_status_write:
            return
        data = self.status()
        text = json.dumps(data, sort_keys=True)
        if text == self._status_written and not force:
            return
        try:
            self.api.patch_namespaced_config_map(self.config.status_name, self.config.namespace, {"data": data})
            self._status_written = text
            self._next_status_write = self.clock() + _STATUS_INTERVAL_S
        except Exception as e:  # noqa: BLE001 - the status is informative; the job goes on
            logger.warning("could not write the job status: %s", e)

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> JobOutcome:
        """Watches until the job succeeds or fails (or ``should_stop``); returns the outcome (also in the status)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        self.start()
        while self.outcome is None:
            self.write_status()
            try:
                stream = watch.Watch().stream(
                    self.api.list_namespaced_pod,
                    self.config.namespace,
                    label_selector=manifests.selector(self.config, "worker"),
                    resource_version=self._resource_version,
                    timeout_seconds=_WATCH_TIMEOUT_S,
                    _request_timeout=_WATCH_TIMEOUT_S + 5,
                )
                for event in stream:
                    obj = event["object"]
                    self._resource_version = obj.metadata.resource_version or self._resource_version
                    self.apply(event["type"], obj)
                    if self._step() or should_stop():
                        break
            except ApiException as e:
                if e.status == 410:
                    logger.info("watch expired (410 Gone): listing the pods again")
                else:
                    logger.warning("watching the pods failed (%s %s): retrying", e.status, e.reason)
                    self._pause(should_stop)
                self._relist_safely(should_stop)
            except Exception as e:  # noqa: BLE001 - connection errors (API server restarts): retry, never give up the job
                logger.warning("watching the pods failed (%s): retrying", e)
                self._pause(should_stop)
                self._relist_safely(should_stop)
            self._step()
            if should_stop() and self.outcome is None:
                self.outcome = JobOutcome("Failed", "the master was stopped (SIGTERM) before training finished")
        self.write_status(force=True)
        return self.outcome

    def _pause(self, should_stop: Callable[[], bool]) -> None:
        deadline = self.clock() + _RETRY_PAUSE_S
        while self.clock() < deadline and not should_stop():
            time.sleep(0.1)

    def _relist_safely(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            try:
                self._relist()
                return
            except Exception as e:  # noqa: BLE001 - keep trying while the API is unreachable
                logger.warning("listing the pods failed (%s): retrying", e)
                self._pause(should_stop)

    def _step(self) -> bool:
        self.relaunch_due()
        self.outcome = self.check_outcome()
        self.write_status(force=self.outcome is not None)
        return self.outcome is not None

    def _relist(self) -> None:
        listed = self.api.list_namespaced_pod(
            self.config.namespace, label_selector=manifests.selector(self.config, "worker")
        )
        present = set()
        for item in listed.items:
            present.add(item.metadata.name)
            self.apply("MODIFIED", item)
        for pod in self.pods.values():
            if pod.name not in present and not pod.ended:
                pod.deleted = pod.gone = True  # deleted while we were not watching
                self._act_on(pod)
        self._resource_version = listed.metadata.resource_version

    def delete_remaining(self) -> None:
        """Deletes worker pods that have not ended (standbys, Pending pods); ended ones keep their logs."""
        from kubernetes.client.exceptions import ApiException

        for pod in self.pods.values():
            if not pod.gone and not pod.ended:
                try:
                    self.api.delete_namespaced_pod(pod.name, self.config.namespace, grace_period_seconds=0)
                except ApiException as e:
                    if e.status != 404:
                        logger.warning("could not delete %s: %s", pod.name, e.reason)
