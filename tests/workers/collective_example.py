"""Worker of test_launcher.py: joins through runtime.init() and checks rank/size."""

import sys

import numpy as np

from elasticdl_strategy import runtime

runtime.init()
total = runtime.allreduce(np.array([1], np.int64))
print(f"rank {runtime.rank()} of {runtime.size()} total {int(total[0])}", flush=True)
runtime.shutdown()
sys.exit(0)
