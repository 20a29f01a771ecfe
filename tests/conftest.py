import shutil
import subprocess

import pytest

from elasticdl_strategy import runtime
from elasticdl_strategy.transport.options import TLSConfig
from tests import interrupts


def pytest_configure(config):
    interrupts.install()
    config.addinivalue_line("markers", "slow: takes several seconds (multi-process jobs, 64 MiB tensors)")


def pytest_collection_modifyitems(session, config, items):
    """Modules with slow tests first (otherwise in collection order): under ``-n 2 --dist loadfile``
    the long multi-process modules then start early, and short ones fill in at the end instead of
    one process finishing a long module while the other waits."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: keeps the order within each group


@pytest.fixture
def single_worker(monkeypatch):
    """This process as a job of one worker (rank 0 of 1, no coordinator), shut down afterwards."""
    monkeypatch.delenv("EDL_COORDINATOR_ADDR", raising=False)
    runtime.init()
    yield
    runtime.shutdown()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A CA and a certificate for localhost/127.0.0.1 signed by it (needs the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
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
