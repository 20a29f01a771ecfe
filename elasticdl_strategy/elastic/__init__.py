"""Layer 5: elastic, fault-tolerant training in the spirit of Horovod elastic.

Wrap the training function in :func:`run` and keep everything that must
survive a failure in a state object::

    import tensorflow as tf
    from elasticdl_strategy import AllReduceStrategy, data, elastic

    strategy = AllReduceStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="mse")
    records = data.ElasticRecords(num_records=len(x), batch_size=32, seed=1)
    state = elastic.KerasState(model, records=records, checkpoint_dir="/tmp/ckpt")

    @elastic.run
    def train(state):
        dataset = records.dataset().map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
        model.fit(dataset, epochs=5, initial_epoch=records.epoch, callbacks=state.callbacks(batches_per_commit=10))

    train(state)

Launch with ``elasticdl-strategy run --workers 3 --min-workers 2 --max-restarts 2 -- python train.py``:
a worker that dies is replaced, the survivors carry on in-process from the
last commit, and every record is used exactly once per epoch.
"""

from elasticdl_strategy.elastic.callbacks import CommitStateCallback
from elasticdl_strategy.elastic.checkpoint import CheckpointStore
from elasticdl_strategy.elastic.membership_function import MembershipFunction, function
from elasticdl_strategy.elastic.run import run
from elasticdl_strategy.elastic.state import KerasState, State

__all__ = ["run", "function", "State", "KerasState", "CommitStateCallback", "CheckpointStore", "MembershipFunction"]
