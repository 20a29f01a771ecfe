import pytest

from elasticdl_strategy.errors import ConfigError


def test_invalid_timeout_is_refused_before_joining():
    from elasticdl_strategy import AllReduceStrategy, runtime

    with pytest.raises(ConfigError, match="timeout=0"):
        AllReduceStrategy(timeout=0)
    assert not runtime.is_initialized()
