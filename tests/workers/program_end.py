"""Worker of tests/runtime/test_program_end.py: joins, all-reduces, and ends without calling shutdown.

argv: OUT_DIR MODE. ``finish``: every member ends normally. ``crash_first``: the first member
to get here (a marker file in OUT_DIR says who) raises; the later ones end normally.
"""

import os
import sys

import numpy as np

from elasticdl_strategy import runtime

out_dir, mode = sys.argv[1], sys.argv[2]
worker_id = os.environ["EDL_WORKER_ID"]
runtime.init()  # a standby of a job that finished without it raises WorkerLeft here: exit code 0
print(f"{worker_id}: a member of {runtime.size()}", flush=True)
assert runtime.allreduce(np.ones(2, np.float32)).tolist() == [runtime.size()] * 2
if mode == "crash_first":
    try:
        os.close(os.open(os.path.join(out_dir, "crashed"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    else:
        raise RuntimeError(f"{worker_id} crashing on purpose")
print(f"{worker_id}: done", flush=True)
