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

from elasticdl_strategy.coordinator.coordinator import CoordinatorParams
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
        min_workers=config.min_workers_,
        max_workers=config.max_workers_,
        target_workers=min(config.workers, config.max_workers_),
        heartbeat_interval_s=min(1.0, config.heartbeat_timeout_s / 4),
        heartbeat_timeout_s=config.heartbeat_timeout_s,
    )
    options = TransportOptions(tls=TLSConfig.from_env(os.environ))
    server = CoordinatorServer(params, f"{pod_ip}:{COORDINATOR_PORT}", token, options)
    logger.info("job %s: coordinator serving on %s:%d", config.name, pod_ip, server.port)
    manager = PodManager(
        api,
        config,
        owner={"name": pod_name, "uid": pod_uid},
        coordinator_address=f"{pod_ip}:{server.port}",
        membership_version=lambda: server.coordinator.membership.version,
    )
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        outcome = manager.run(should_stop=stop.is_set)
    finally:
        manager.delete_remaining()
        server.stop()
    logger.info("job %s %s: %s", config.name, outcome.phase.lower(), outcome.message)
    return 0 if outcome.phase == "Succeeded" else 1


def core_api():
    """A CoreV1Api from ``$KUBECONFIG`` if set, else the pod's service account (in-cluster)."""
    from kubernetes import client, config

    config.load_config()
    return client.CoreV1Api()
