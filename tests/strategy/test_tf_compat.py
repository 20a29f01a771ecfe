import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.strategy import tf_compat


def test_tested_tensorflow_versions_pass():
    tf_compat.check_version("2.21.0")
    tf_compat.check_version("2.21.3rc1")


@pytest.mark.parametrize("version", ["2.20.1", "2.22.0", "3.0.0"])
def test_other_tensorflow_versions_are_refused_with_what_to_do(version):
    with pytest.raises(ConfigError, match=f"TensorFlow {version} is installed.*pip install"):
        tf_compat.check_version(version)
