"""``elasticdl-strategy k8s master``: what runs in the master pod — the coordinator and the pod manager.

Exit code 0 when training finished, 1 when the job failed (the reason is in
the status ConfigMap and the log). Kubernetes restarts the container in place
if it crashes (``restartPolicy: OnFailure``): the coordinator recovers the job
from the workers' re-registrations and the pod manager adopts the existing
worker pods.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.server import CoordinatorServer
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher.k8s.job_config import COORDINATOR_PORT, K8sJobConfig
from elasticdl_strategy.launcher.k8s.pod_manager import PodManager
from elasticdl_strategy.transport.auth import validate_token
from elasticdl_strategy.transport.options import TLSConfig, TransportOptions

logger = logging.getLogger(__name__)


def run_master(config: K8sJobConfig, api=None) -> int:
    """Serves the coordinator and manages the worker pods until the job ends; returns the exit code."""
    pod_name, pod_uid, pod_ip = (os.environ.get(k, "") for k in ("EDL_POD_NAME", "EDL_POD_UID", "EDL_POD_IP"))
    if not (pod_name and pod_uid and pod_ip):
        raise ConfigError("EDL_POD_NAME, EDL_POD_UID and EDL_POD_IP must come from the downward API")
    token = validate_token(os.environ.get("EDL_JOB_TOKEN"))
    if api is None:
        api = core_api()
    params = CoordinatorParams(
        config.counts,
        heartbeat_interval_s=min(1.0, config.heartbeat_timeout_s / 4),
        heartbeat_timeout_s=config.heartbeat_timeout_s,
    )
    options = TransportOptions(tls=TLSConfig.from_env(os.environ))
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod IPs in host:port
    server = CoordinatorServer(params, f"{host}:{COORDINATOR_PORT}", token, options)
    logger.info("job %s: coordinator serving on %s:%d", config.name, pod_ip, server.port)
    manager = PodManager(
        api,
        config,
        owner={"name": pod_name, "uid": pod_uid},
        coordinator_address=f"{host}:{server.port}",
        membership_version=lambda: server.coordinator.membership.version,
        training_finished=lambda: server.coordinator.finished,
    )
    if _already_ended(api, config):
        server.stop()
        return 0
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        outcome = manager.run(should_stop=stop.is_set)
        manager.delete_remaining()  # only once the job's outcome is decided: a crash keeps the workers
    except BaseException:
        logger.exception("job %s: the master failed; Kubernetes restarts it and it adopts the workers", config.name)
        raise
    finally:
        server.stop()
    logger.info("job %s %s: %s", config.name, outcome.phase.lower(), outcome.message)
    # The verdict is in the status ConfigMap and this log. A non-zero exit would make Kubernetes
    # restart the master (restartPolicy OnFailure, meant for crashes), which would run the job again.
    return 0


def _already_ended(api, config: K8sJobConfig) -> bool:
    """Whether the job's status says it ended (the master container was restarted after that)."""
    try:
        data = api.read_namespaced_config_map(config.status_name, config.namespace).data or {}
    except Exception as e:  # noqa: BLE001 - no readable status: the job has not ended
        logger.warning("could not read the job status: %s", e)
        return False
    if data.get("phase") in ("Succeeded", "Failed"):
        logger.warning("job %s already %s (%s): nothing to do", config.name, data["phase"].lower(), data.get("message"))
        return True
    return False


def core_api():
    """A CoreV1Api from ``$KUBECONFIG`` if set, else the pod's service account (in-cluster)."""
    from kubernetes import client, config

    config.load_config()
    return client.CoreV1Api()
