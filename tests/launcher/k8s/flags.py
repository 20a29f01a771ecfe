"""The command-line flags of a job configuration, for tests that drive ``elasticdl-strategy k8s``."""

from typing import Tuple

from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig


def submit_flags(config: K8sJobConfig) -> Tuple[str, ...]:
    """The ``k8s submit``/``k8s manifest`` flags that give ``config`` (for tests of the command line)."""
    flags = [
        "--name", config.name, "--namespace", config.namespace, "--image", config.image,
        "--workers", str(config.workers), "--min-workers", str(config.counts.min_workers),
        "--max-workers", str(config.counts.max_workers), "--cpu", config.cpu, "--memory", config.memory,
        "--gpu", str(config.gpu), "--max-restarts", str(config.max_restarts),
        "--heartbeat-timeout", f"{config.heartbeat_timeout_s:g}",
        "--rendezvous-timeout", f"{config.rendezvous_timeout_s:g}",
        "--termination-grace", str(config.termination_grace_s),
        "--image-pull-policy", config.image_pull_policy,
    ]  # fmt: skip
    if config.priority_class:
        flags += ["--priority-class", config.priority_class]
    if config.relaunch_on_error:
        flags.append("--relaunch-on-error")
    if config.shared_memory_host_path:
        flags += ["--shared-memory-host-path", config.shared_memory_host_path]
    for key, value in config.env:
        flags += ["--env", f"{key}={value}"]
    return tuple(flags)
