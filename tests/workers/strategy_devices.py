"""Worker of tests/strategy/test_devices.py: where AllReduceStrategy puts variables, compute and reductions.

``python strategy_devices.py RESULTS_DIR host``: the device the strategy chooses (the CPU here).
``python strategy_devices.py RESULTS_DIR stand-in``: this machine has no GPU, so the process splits
its CPU into two logical devices and the device choice is shown ``/device:CPU:1`` as the only GPU:
the replica then runs on a device that is not its host (``CPU:0``), as on a GPU, and the same
placement rules apply. Writes ``{results_dir}/rank{r}.json``.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report


def _strategy_on_cpu_1() -> AllReduceStrategy:
    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    real = tf.config.list_logical_devices

    def list_logical_devices(device_type=None):
        if device_type == "GPU":
            return [d for d in real("CPU") if d.name.endswith("CPU:1")]
        return real(device_type)

    tf.config.list_logical_devices = list_logical_devices
    try:
        return AllReduceStrategy()
    finally:
        tf.config.list_logical_devices = real


def _graph_placement(strategy, rank: int) -> dict:
    """Devices of the traced ring ops and of the copies of their results, and what they computed."""

    def step():
        ctx = tf.distribute.get_replica_context()
        total = ctx.all_reduce("sum", [tf.fill([3], float(rank + 1))])[0]
        rows = ctx.all_gather(tf.fill([1, 2], float(rank)), axis=0)
        return total * 2.0, rows

    function = tf.function(lambda: strategy.run(step))
    graph = function.get_concrete_function().graph
    ring_ops = [op for op in graph.get_operations() if op.type == "PyFunc"]
    copies = [c for op in ring_ops for out in op.outputs for c in out.consumers() if c.type == "Identity"]
    total, rows = function()
    return {
        "ring_op_devices": sorted({op.device for op in ring_ops}),
        "ring_op_count": len(ring_ops),
        "copy_devices": sorted({op.device for op in copies}),
        "copy_count": len(copies),
        "graph_total": total.numpy().tolist(),
        "graph_rows": rows.numpy().tolist(),
    }


def _eager_placement(strategy, rank: int) -> dict:
    def step():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", tf.fill([2], float(rank + 1))), ctx.all_gather(tf.fill([1], rank), axis=0)

    total, rows = strategy.run(step)
    reduced = strategy.reduce("SUM", tf.constant([float(rank)]), axis=None)
    return {
        "eager_devices": [total.device, rows.device, reduced.device],
        "eager_total": total.numpy().tolist(),
        "eager_rows": rows.numpy().tolist(),
    }


def _fit(strategy) -> dict:
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        plain = tf.Variable([1.0, 2.0])
    before = [w.numpy().tolist() for w in model.weights]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    return {
        "variable_devices": sorted({w.value.device for w in model.weights} | {plain.device}),
        "optimizer_devices": sorted({v.value.device for v in model.optimizer.variables}),
        "weights_moved": [w.numpy().tolist() for w in model.weights] != before,
        "weights": [w.numpy().tolist() for w in model.weights],
    }


def main(results_dir: str, mode: str) -> None:
    strategy = _strategy_on_cpu_1() if mode == "stand-in" else AllReduceStrategy()
    rank = runtime.rank()
    report = {"worker_devices": list(strategy.extended.worker_devices)}
    report.update(_fit(strategy))
    report.update(_eager_placement(strategy, rank))
    report.update(_graph_placement(strategy, rank))
    write_report(results_dir, rank, report)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
