"""Optional TLS: a ring over mutually authenticated TLS works; a plaintext client cannot connect."""

import shutil
import subprocess

import grpc
import numpy as np
import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.options import TLSConfig, TransportOptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.cluster import ThreadCluster

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=edl-test-ca",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", str(d / "node.key"), "-out", str(d / "node.csr"))  # fmt: skip
    run("x509", "-req", "-in", str(d / "node.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
        "-CAcreateserial", "-days", "1", "-extfile", str(d / "ext.cnf"), "-out", str(d / "node.pem"))  # fmt: skip
    return TLSConfig(str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem"))


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
