"""The private TensorFlow modules the strategy needs, in one place, version-checked.

``tf.distribute.Strategy`` subclasses have to use TensorFlow internals
(``distribute_lib``, ``input_util``, ...). They change between releases, so
this module imports them only for TensorFlow versions we test, and raises a
clear error on any other version instead of failing in obscure ways later.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

from elasticdl_strategy.errors import ConfigError

# Minor versions the strategy is tested with (see README).
SUPPORTED_MINOR_VERSIONS = ("2.21",)


def check_version(version: str) -> None:
    """Raises ConfigError unless ``version`` (``tf.__version__``) is a tested release."""
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_MINOR_VERSIONS:
        raise ConfigError(
            f"elasticdl_strategy.AllReduceStrategy supports TensorFlow {', '.join(SUPPORTED_MINOR_VERSIONS)}.x "
            f"but TensorFlow {version} is installed; install a supported version "
            f"(pip install 'tensorflow=={SUPPORTED_MINOR_VERSIONS[-1]}.*')"
        )


check_version(tf.__version__)

from tensorflow.python.autograph.core import config as autograph_config  # noqa: E402
from tensorflow.python.data.ops import batch_op, dataset_ops, map_op, prefetch_op, repeat_op, skip_op, take_op  # noqa: E402
from tensorflow.python.data.util import structure as data_structure  # noqa: E402
from tensorflow.python.eager import cancellation  # noqa: E402
from tensorflow.python.eager import context as eager_context  # noqa: E402
from tensorflow.python.eager import execute as eager_execute  # noqa: E402
from tensorflow.python.eager.polymorphic_function import function_type_utils  # noqa: E402
from tensorflow.python.distribute import device_util  # noqa: E402
from tensorflow.python.distribute import distribute_lib  # noqa: E402
from tensorflow.python.distribute import distribute_utils  # noqa: E402
from tensorflow.python.distribute import input_lib  # noqa: E402
from tensorflow.python.distribute import input_util  # noqa: E402
from tensorflow.python.distribute import reduce_util  # noqa: E402
from tensorflow.python.distribute import values as distribute_values  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402
from tensorflow.python.framework import tensor_util  # noqa: E402
from tensorflow.python.ops import control_flow_util  # noqa: E402
from tensorflow.python.ops import resource_variable_ops  # noqa: E402
from tensorflow.python.util import nest  # noqa: E402


# tf.data's Python dataset objects know what they were made from, privately.


def dataset_inputs(dataset: tf.data.Dataset) -> list:
    """The datasets ``dataset`` was made from (a ``map``'s input, a ``zip``'s components, ...)."""
    return list(dataset._inputs())


def dataset_function_graphs(dataset: tf.data.Dataset) -> list:
    """The GraphDefs (with their function libraries) of the functions a dataset applies."""
    return [wrapper.function.graph.as_graph_def() for wrapper in dataset._functions()]


def reader_file_names(reader: tf.data.Dataset):
    """The file names a tf.data file reader reads: a dataset of names, or a tensor of them."""
    return reader._filenames


# AutoGraph's list of packages whose functions a tf.function calls as they are.


def exclude_from_autograph(package: str) -> None:
    """Has AutoGraph call the functions of ``package`` (and its submodules) unconverted inside a
    ``tf.function``, as it calls TensorFlow's and Keras's own (a ``DoNotConvert`` rule; once).

    AutoGraph otherwise converts every function a traced function calls, and all it calls in
    turn: parsing and rewriting their source the first time in each process.
    """
    rules = autograph_config.CONVERSION_RULES
    if not any(isinstance(rule, autograph_config.DoNotConvert) and rule.matches(package) for rule in rules):
        autograph_config.CONVERSION_RULES = (autograph_config.DoNotConvert(package), *rules)


# A traced function's first call also optimizes its graph (Grappler) and creates its kernels.


def instantiate_without_running(concrete_function, args: tuple, kwargs: dict) -> None:
    """Has TensorFlow optimize ``concrete_function``'s graph and create its kernels for inputs
    like ``args`` and ``kwargs``, without running any of it, so that its first call costs what a
    later one does (the MLP of benchmarks/train_step.py: 53 ms instead of 120, later calls 16).

    The call TensorFlow makes for ``concrete_function(*args, **kwargs)`` is made under a
    cancellation manager cancelled before it starts: TensorFlow instantiates the function (and
    keeps it for later calls with the same attributes), then finds the call cancelled before
    running an op. The manager is passed to this call alone (``tf.function`` calls read a
    process-wide one), so calls in other threads run as usual meanwhile.

    Raises:
        RuntimeError: the call was not cancelled (it ran).
        what binding the inputs or instantiating raises (inputs that do not fit the function).
    """
    bound = function_type_utils.canonicalize_function_inputs(args, kwargs, concrete_function.function_type)
    inputs = [*concrete_function.function_type.unpack_inputs(bound), *concrete_function.captured_inputs]
    atomic = concrete_function._inference_function
    context = eager_context.context()
    attrs = tuple(itertools.chain(*context.function_call_options.as_attrs().items()))
    manager = cancellation.CancellationManager()
    manager.start_cancel()
    try:
        eager_execute.execute_with_cancellation(
            atomic.name.decode("utf-8"),
            num_outputs=len(atomic.function_type.flat_outputs),
            inputs=inputs,
            attrs=attrs,
            ctx=context,
            cancellation_manager=manager,
        )
    except tf.errors.CancelledError:
        return
    raise RuntimeError(f"{atomic.name.decode('utf-8')} ran instead of being cancelled before its first op")


__all__ = [
    "batch_op",
    "dataset_ops",
    "data_structure",
    "map_op",
    "prefetch_op",
    "repeat_op",
    "skip_op",
    "take_op",
    "tensor_util",
    "check_version",
    "dataset_inputs",
    "dataset_function_graphs",
    "reader_file_names",
    "exclude_from_autograph",
    "instantiate_without_running",
    "device_util",
    "distribute_lib",
    "distribute_utils",
    "distribute_values",
    "input_lib",
    "input_util",
    "reduce_util",
    "ops",
    "control_flow_util",
    "resource_variable_ops",
    "nest",
]
