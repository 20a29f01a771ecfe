"""Layer 5: exactly-once data for elastic jobs.

:class:`ElasticRecords` gives each worker the indices of the records it
trains on; user code maps them to features (arrays, files, TFRecords)::

    records = data.ElasticRecords(num_records=60000, batch_size=64, seed=1)
    dataset = records.dataset().map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
"""

from elasticdl_strategy.data.records import ElasticRecords, Position

__all__ = ["ElasticRecords", "Position"]
