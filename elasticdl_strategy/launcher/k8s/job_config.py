"""A Kubernetes job request, validated before any object is created."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Dict, Optional, Sequence, Tuple

from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.logs import LEVEL_VARIABLE, level_from_env

# The master pod's environment variable that holds the job's configuration (K8sJobConfig.to_json).
JOB_CONFIG_VARIABLE = "EDL_JOB_CONFIG"

# Longest suffix added to the job name ("-worker-" + a worker id of up to 5 digits).
_LONGEST_SUFFIX = len("-worker-99999")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names: start with a letter
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_IMAGE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._/:@-]*$")

COORDINATOR_PORT = 50051
WORKER_PORT = 50052
DATA_PORT = 50053  # direct data sockets between workers


def _check_quantity(flag: str, value: str) -> None:
    from kubernetes.utils.quantity import parse_quantity

    try:
        if parse_quantity(value) <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{flag}={value!r} is not a positive Kubernetes quantity (e.g. 500m, 2, 4Gi)") from None


def parse_env(pairs: Sequence[str]) -> Dict[str, str]:
    """``["K=V", ...]`` to a dict; raises ConfigError naming a malformed pair or name."""
    env: Dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise ConfigError(f"--env {pair!r} must be NAME=VALUE with a valid variable name")
        if name == LEVEL_VARIABLE:
            level_from_env({name: value})  # validated here, a one-line error before anything is created
        elif name.startswith("EDL_"):
            raise ConfigError(f"--env {name}: EDL_ variables are set by the job itself (except {LEVEL_VARIABLE})")
        env[name] = value
    return env


@dataclasses.dataclass(frozen=True)
class K8sJobConfig:
    """What ``elasticdl-strategy k8s submit`` / ``manifest`` create; construction validates.

    Example::

        config = K8sJobConfig(name="mnist", image="registry/edl:0.1", command=["python", "train.py"], workers=4)
    """

    name: str
    image: str
    command: Tuple[str, ...]
    workers: int
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    namespace: str = "default"
    cpu: str = "1"
    memory: str = "2Gi"
    gpu: int = 0  # nvidia.com/gpu of each worker pod: 0 or 1 (its one worker process uses one GPU)
    env: Tuple[Tuple[str, str], ...] = ()
    max_restarts: int = 3
    priority_class: Optional[str] = None
    relaunch_on_error: bool = False
    heartbeat_timeout_s: float = 10.0
    rendezvous_timeout_s: float = 600.0
    termination_grace_s: int = 60
    image_pull_policy: str = "IfNotPresent"
    master_cpu: str = "500m"
    master_memory: str = "512Mi"
    # A directory on the node, mounted into every worker pod as its shared-memory
    # directory, so that workers scheduled on the same node exchange through shared
    # memory instead of gRPC. Needs a cluster that allows hostPath volumes.
    shared_memory_host_path: Optional[str] = None

    def __post_init__(self) -> None:
        if not _DNS_1035_LABEL.match(self.name) or len(self.name) > 63 - _LONGEST_SUFFIX:
            raise ConfigError(
                f"--name={self.name!r} must be lower-case letters, digits and '-', start with a letter, end "
                f"with a letter or digit, and be at most {63 - _LONGEST_SUFFIX} characters"
            )
        if not _DNS_LABEL.match(self.namespace):
            raise ConfigError(f"--namespace={self.namespace!r} is not a valid namespace name")
        if not self.image or not _IMAGE.match(self.image):
            raise ConfigError(f"--image={self.image!r} is not a valid image reference")
        if not self.command:
            raise ConfigError("missing command: use `elasticdl-strategy k8s submit ... -- CMD ARGS...`")
        self.counts  # validates the worker counts
        if self.gpu < 0:
            raise ConfigError(f"--gpu={self.gpu} must not be negative")
        if self.gpu > 1:
            raise ConfigError(
                f"--gpu={self.gpu}: each worker pod runs one worker process, which uses one GPU: run {self.gpu} "
                f"times the workers with --gpu 1 instead (e.g. --workers {self.workers * self.gpu} --gpu 1)"
            )
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory)):
            _check_quantity(flag, value)
        if self.priority_class is not None and not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", self.priority_class):
            raise ConfigError(f"--priority-class={self.priority_class!r} is not a valid PriorityClass name")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ConfigError(f"image pull policy {self.image_pull_policy!r} must be Always, IfNotPresent or Never")
        path = self.shared_memory_host_path
        if path is not None and (not path.startswith("/") or ".." in path.split("/") or path == "/"):
            raise ConfigError(f"--shared-memory-host-path={path!r} must be an absolute directory path without '..'")
        for name in ("heartbeat_timeout_s", "rendezvous_timeout_s", "termination_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")

    @property
    def counts(self) -> WorkerCounts:
        return WorkerCounts.of(self.workers, self.min_workers, self.max_workers, self.max_restarts)

    # Names of the job's objects.
    @property
    def master_name(self) -> str:
        return f"{self.name}-master"

    @property
    def secret_name(self) -> str:
        return f"{self.name}-token"

    @property
    def status_name(self) -> str:
        return f"{self.name}-status"

    def worker_name(self, worker_index: int) -> str:
        return f"{self.name}-worker-{worker_index}"

    def to_json(self) -> str:
        """The config as data, for the master pod (``EDL_JOB_CONFIG``); :meth:`from_json` reads it back."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "K8sJobConfig":
        """The config :meth:`to_json` wrote, validated again.

        Raises:
            ConfigError: not such a config (not JSON, unknown or missing fields, invalid values).
        """
        try:
            data = json.loads(text)
            data["command"] = tuple(data["command"])
            data["env"] = tuple((key, value) for key, value in data["env"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"{JOB_CONFIG_VARIABLE} does not hold a job configuration: {e}") from None
