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


def _a_user_function():
    return 1


def test_autograph_calls_the_library_as_it_is_and_still_converts_user_code():
    # Converting the library's functions (runtime.size() in a step, and all they call) made a
    # process's first trace ~0.2 s slower; user functions must still be converted.
    from tensorflow.python.autograph.impl import conversion

    from elasticdl_strategy import runtime
    from elasticdl_strategy.strategy import bridge

    assert conversion.is_allowlisted(runtime.size)
    assert conversion.is_allowlisted(bridge.all_reduce_tensors)
    assert not conversion.is_allowlisted(_a_user_function)


def test_excluding_a_package_twice_adds_one_rule():
    rules = len(tf_compat.autograph_config.CONVERSION_RULES)
    tf_compat.exclude_from_autograph("elasticdl_strategy")
    assert len(tf_compat.autograph_config.CONVERSION_RULES) == rules


def test_a_function_instantiated_without_running_runs_nothing_until_it_is_called():
    import numpy as np
    import tensorflow as tf

    counter, python_calls = tf.Variable(0, dtype=tf.int64), []

    def record(x):
        python_calls.append(x)
        return x

    @tf.function
    def step(x):
        counter.assign_add(1)
        return tf.numpy_function(record, [x * 2], tf.float32)

    x = tf.constant(3.0)
    concrete = step.get_concrete_function(x)
    tf_compat.instantiate_without_running(concrete, (x,), {})
    tf_compat.instantiate_without_running(concrete, (x,), {})  # again: still nothing runs
    assert int(counter.numpy()) == 0 and python_calls == []
    assert float(step(x)) == 6.0  # the call itself runs, once
    assert int(counter.numpy()) == 1 and python_calls == [np.float32(6.0)]
    with pytest.raises((TypeError, ValueError)):
        tf_compat.instantiate_without_running(concrete, (tf.constant([1, 2]),), {})  # inputs that do not fit
    assert int(counter.numpy()) == 1
