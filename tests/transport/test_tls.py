"""Optional TLS: a ring over mutually authenticated TLS works; a plaintext client cannot connect."""

import grpc
import numpy as np
import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.options import TLSConfig, TransportOptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.cluster import ThreadCluster


def test_ring_over_mutual_tls(tls_files):
    options = TransportOptions(tls=tls_files, timeout_s=20)
    with ThreadCluster(3, options) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(100_000, c.rank, np.float32)))
        for r in results:
            np.testing.assert_array_equal(r, np.full(100_000, 3, np.float32))
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)


def test_missing_tls_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TLSConfig(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))
