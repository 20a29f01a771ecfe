"""Worker of test_launcher.py: behaves as told by argv, per launch index (EDL_LOCAL_INDEX)."""

import os
import signal
import sys
import time

index = int(os.environ["EDL_LOCAL_INDEX"])
mode, out_dir = sys.argv[1], sys.argv[2]

if mode == "hello":
    print(f"hello from {os.environ['EDL_WORKER_ID']}", flush=True)
    print(f"threads {os.environ.get('TF_NUM_INTRAOP_THREADS')} {os.environ.get('OMP_NUM_THREADS')}", flush=True)
    assert os.environ["EDL_JOB_TOKEN"] and os.environ["EDL_COORDINATOR_ADDR"]
elif mode == "devices":  # what the launcher gave this worker; argv[3], if given: the launch index that fails
    env = os.environ
    slot = f"{env['EDL_LOCAL_RANK']}/{env['EDL_LOCAL_SIZE']}"
    print(
        f"devices of {env['EDL_WORKER_ID']}: slot {slot} cuda {env.get('CUDA_VISIBLE_DEVICES', '<unset>')}", flush=True
    )
    if sys.argv[3:] == [str(index)]:
        sys.exit(3)
elif mode == "fail-one":
    if index == 1:
        print("something went wrong: boom", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(0.2)
elif mode == "fail-each-way":  # index 0 exits with code 3, then index 1 is killed by SIGKILL
    flag = os.path.join(out_dir, "index0-exits")
    if index == 0:
        open(flag, "w").close()
        sys.exit(3)
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "wait-for-signal":

    def on_term(signum, frame):
        open(os.path.join(out_dir, f"term{index}"), "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    open(os.path.join(out_dir, f"ready{index}"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(4)
