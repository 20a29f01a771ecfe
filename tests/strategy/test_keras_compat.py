"""The Keras adaptations are installed one by one: a Keras whose internals changed loses only the
adaptations that need them, with a warning naming what is lost, and the gradient check falls back
to the public Optimizer.apply. Run in a fresh interpreter: installing patches Keras for good."""

import json
import subprocess
import sys
import textwrap

from tests.launch import REPO_ROOT

SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import keras
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    keras.__version__ = "3.99.0"  # an untested minor whose internals moved:
    del TFOptimizer._all_reduce_sum_gradients
    del LossScaleOptimizer._tf_apply
    from elasticdl_strategy.strategy import keras_compat

    class Strategy:
        pass

    before = keras.optimizers.Optimizer.apply
    active = keras_compat.install(Strategy)
    print(json.dumps({"active": active, "apply_wrapped": keras.optimizers.Optimizer.apply is not before}))
    """
)


def test_a_changed_keras_loses_only_the_adaptations_whose_internals_are_gone():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    lost = {name for name, on in report["active"].items() if not on}
    assert lost == {"gradient check", "loss scaling"}
    assert report["active"]["numpy shuffle"] and report["active"]["saving on rank 0"]
    assert report["apply_wrapped"]  # the conservative gradient check took over
    assert "Keras 3.99.0 is not one elasticdl_strategy is tested with" in result.stderr
    assert "loss scaling is not adapted" in result.stderr and "desynchronizes" in result.stderr
