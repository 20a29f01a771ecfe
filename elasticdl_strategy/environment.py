"""The environment the launchers hand to every worker, read by ``runtime.init()``.

=========================  ===================================================
Variable                   Meaning
=========================  ===================================================
EDL_COORDINATOR_ADDR       ``host:port`` of the coordinator; unset: single worker
EDL_JOB_TOKEN              the job's secret, carried by every RPC
EDL_WORKER_ID              stable id of this worker (unique in the job); when unset,
                           derived from ``TF_CONFIG`` (Kubeflow TFJob): "worker-3"
EDL_BIND_HOST              interface the peer server listens on (default 127.0.0.1)
EDL_PEER_PORT              port of the peer server (default 0: any free port)
EDL_DATA_PORT              port for direct data sockets (default 0: any free port)
EDL_ADVERTISE_HOST         host peers dial (default: EDL_BIND_HOST, or the pod IP)
EDL_HOST_ID                what tells this worker's host from others, for the
                           hierarchical all-reduce (default: the advertised host;
                           on Kubernetes the node's name)
EDL_RENDEZVOUS_TIMEOUT     seconds to wait for a membership (default 120)
EDL_TIMEOUT                default deadline of collectives and receives (default 60)
EDL_CHUNK_SIZE             bytes per streamed chunk (default 4 MiB)
EDL_CONNECT_TIMEOUT        seconds to wait for a peer's server (default 10)
EDL_KEEPALIVE              seconds between HTTP/2 keepalive pings (default 2)
EDL_SLOW_WARNING           seconds before a waiting collective logs whom it waits for
EDL_SHARED_MEMORY          1 (default): payloads to peers that can map this worker's
                           arenas go through shared memory; 0: always gRPC
EDL_SHM_DIR                directory of the shared-memory arenas (default /dev/shm)
EDL_SHM_SLOT_SIZE          bytes per arena slot (default 4 MiB)
EDL_SHM_SLOTS              slots per arena, one arena per peer sent to (default 8)
EDL_SHM_LANE_BYTES         bytes of each arena's lane, for messages up to 3/4 of it
                           (default 16 MiB; 0: no lanes)
EDL_HOST_SEGMENT_BYTES     all-reduces up to this size among workers all on one host go
                           through one shared file they all map (default 256 KiB among 2 or 3
                           workers, 4 MiB among 4 to 16, less beyond (the file within 128 MiB),
                           256 KiB where the directory has no room for that;
                           0: never; workers asking for different sizes get the smallest)
EDL_SINGLE_COPY            1 (default): larger all-reduces among workers all on one host go
                           through that file too, each worker reading the others' arrays
                           straight out of their processes (process_vm_readv), where every
                           worker allows it and the kernel lets them; 0: by messages
EDL_SPIN_US                microseconds a caller polls a lane or data socket before
                           it sleeps (default 200; where the host's workers outnumber
                           its cores 2000, or 0 with EDL_SPIN_YIELD=0; 0: sleep at once)
EDL_SPIN_YIELD             1: a polling caller yields its core between looks (default 1
                           where the host's workers outnumber its cores, else 0)
EDL_DATA_SOCKET            1 (default): streams not in shared memory move their
                           frames to a direct TCP data socket; 0: gRPC only
EDL_HIERARCHICAL           1 (default): large all-reduces of a job with several workers
                           on some of its several hosts go within hosts, then between
                           one leader per host; 0: the flat ring
EDL_TLS_CERT/KEY/CA        PEM files for TLS (optional)
EDL_LOCAL_RANK             this worker process's slot on its host, 0 .. EDL_LOCAL_SIZE-1
                           (default 0): with several GPUs visible, AllReduceStrategy
                           uses GPU ``EDL_LOCAL_RANK % #GPUs`` (``strategy/devices.py``);
                           a replacement worker takes the slot of the one it replaces
EDL_LOCAL_SIZE             worker slots on this host (default 1): ``--workers`` of the
                           local launcher, 1 in a Kubernetes worker pod
EDL_LOCAL_INDEX            the local launcher's count of the workers it started (0, 1, ...;
                           replacements continue it)
CUDA_VISIBLE_DEVICES       not EDL's, but set per worker by the local launcher's
                           ``--gpus-per-worker G`` (slot i: GPUs ``[i*G, (i+1)*G)``)
=========================  ===================================================
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.auth import validate_token
from elasticdl_strategy.transport.options import TransportOptions

COORDINATOR_ADDR = "EDL_COORDINATOR_ADDR"
JOB_TOKEN = "EDL_JOB_TOKEN"
WORKER_ID = "EDL_WORKER_ID"
BIND_HOST = "EDL_BIND_HOST"
ADVERTISE_HOST = "EDL_ADVERTISE_HOST"
HOST_ID = "EDL_HOST_ID"
RENDEZVOUS_TIMEOUT = "EDL_RENDEZVOUS_TIMEOUT"
PEER_PORT = "EDL_PEER_PORT"
DATA_PORT = "EDL_DATA_PORT"
TF_CONFIG = "TF_CONFIG"
LOCAL_RANK = "EDL_LOCAL_RANK"
LOCAL_SIZE = "EDL_LOCAL_SIZE"
LOCAL_INDEX = "EDL_LOCAL_INDEX"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def worker_id_from_tf_config(text: str) -> str:
    """The worker id of a process started by an operator that sets ``TF_CONFIG`` (Kubeflow TFJob).

    Example:

    >>> worker_id_from_tf_config('{"cluster": {}, "task": {"type": "worker", "index": 2}}')
    'worker-2'

    Raises:
        ConfigError: ``TF_CONFIG`` is not JSON with a ``task`` type and index.
    """
    import json

    try:
        task = json.loads(text)["task"]
        kind, index = str(task["type"]), int(task["index"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{TF_CONFIG} has no task type and index: {text[:200]!r}") from None
    return f"{kind}-{index}"


def _port(env: Mapping[str, str], var: str) -> int:
    try:
        port = int(env.get(var) or 0)
    except ValueError:
        raise ConfigError(f"{var}={env[var]!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{var}={port} is not a port number")
    return port


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    """This worker process's slot on its host (``EDL_LOCAL_RANK``; 0 when unset).

    >>> local_rank({"EDL_LOCAL_RANK": "3"}), local_rank({})
    (3, 0)

    Raises:
        ConfigError: it is not a non-negative integer.
    """
    text = env.get(LOCAL_RANK) or "0"
    try:
        rank = int(text)
    except ValueError:
        raise ConfigError(f"{LOCAL_RANK}={text!r} is not a non-negative integer") from None
    if rank < 0:
        raise ConfigError(f"{LOCAL_RANK}={rank} is not a non-negative integer")
    return rank


@dataclasses.dataclass(frozen=True)
class WorkerEnvironment:
    """Everything a worker needs to join its job, parsed and validated."""

    coordinator_address: str
    token: str
    worker_id: str
    bind_host: str = "127.0.0.1"
    advertise_host: Optional[str] = None
    host_id: str = ""
    peer_port: int = 0
    data_port: int = 0
    rendezvous_timeout_s: float = 120.0
    transport: TransportOptions = TransportOptions()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["WorkerEnvironment"]:
        """Returns the parsed environment, or ``None`` when no launcher set it up.

        Raises:
            ConfigError: a variable is missing or invalid.
        """
        address = env.get(COORDINATOR_ADDR)
        if not address:
            return None
        worker_id = env.get(WORKER_ID) or ""
        if not worker_id and env.get(TF_CONFIG):
            worker_id = worker_id_from_tf_config(env[TF_CONFIG])
        if not worker_id:
            raise ConfigError(f"{COORDINATOR_ADDR} is set but {WORKER_ID} (or {TF_CONFIG}) is not")
        peer_port, data_port = _port(env, PEER_PORT), _port(env, DATA_PORT)
        try:
            rendezvous_timeout = float(env.get(RENDEZVOUS_TIMEOUT, "120"))
        except ValueError:
            raise ConfigError(f"{RENDEZVOUS_TIMEOUT}={env[RENDEZVOUS_TIMEOUT]!r} is not a number") from None
        if rendezvous_timeout <= 0:
            raise ConfigError(f"{RENDEZVOUS_TIMEOUT}={rendezvous_timeout} must be positive")
        bind_host = env.get(BIND_HOST) or "127.0.0.1"
        return cls(
            coordinator_address=address,
            token=validate_token(env.get(JOB_TOKEN)),
            worker_id=worker_id,
            bind_host=bind_host,
            advertise_host=env.get(ADVERTISE_HOST) or None,
            host_id=env.get(HOST_ID, ""),
            peer_port=peer_port,
            data_port=data_port,
            rendezvous_timeout_s=rendezvous_timeout,
            transport=TransportOptions.from_env(env),
        )

    @property
    def peer_host(self) -> str:
        """The host other workers dial to reach this one."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in ("0.0.0.0", "::", "[::]"):
            raise ConfigError(
                f"{BIND_HOST}={self.bind_host} listens everywhere: set {ADVERTISE_HOST} to an address peers can dial"
            )
        return self.bind_host
