"""Worker of test_launcher.py: joins through collective.init() and checks rank/size."""

import sys

import numpy as np

from elasticdl_strategy import collective

collective.init()
total = collective.allreduce(np.array([1], np.int64))
print(f"rank {collective.rank()} of {collective.size()} total {int(total[0])}", flush=True)
collective.shutdown()
sys.exit(0)
