"""Layer 5: exactly-once data for elastic jobs.

:class:`ElasticRecords` gives each worker the indices of the records it
trains on; user code maps them to features (in-memory arrays)::

    records = data.ElasticRecords(num_records=60000, batch_size=64, seed=1)
    dataset = records.dataset().map(lambda i: (tf.gather(x, i), tf.gather(y, i)))

:class:`ElasticFiles` reads the records themselves out of TFRecord or text
files, and runs a per-record function (parse, augment) on this worker's only::

    files = data.ElasticFiles(["train-0.tfrecord", "train-1.tfrecord"], batch_size=64, seed=1)
    dataset = files.dataset(parse)
"""

from elasticdl_strategy.data.files import ElasticFiles
from elasticdl_strategy.data.records import ElasticRecords, Position

__all__ = ["ElasticFiles", "ElasticRecords", "Position"]
