"""Control-plane benchmark: one coordinator and N simulated workers speaking the real protocol.

Usage::

    python benchmarks/control_plane.py [--workers 10,100,1000] [--processes 4] [--commits 10]
                                       [--heartbeat-window 10] [--json out.json]

Each simulated worker is a few coroutines with a gRPC channel (a connection) of its own, in one
of ``--processes`` simulator processes (``grpc.aio``); it registers, long-polls for its
membership, heartbeats every interval, commits and reports failures as ``runtime`` does, with
the job token. The coordinator is the real one, ``python -m elasticdl_strategy coordinator``,
in a process of its own. A worker's peer address is a port on 127.0.0.1 that nothing listens
on, so a health probe of it is refused at once (a dead worker's). Times are ``time.monotonic``
read in every process (one clock on Linux).

Measured per N, in this order (targets of issue 17 at N = 1,000 in brackets):

- formation: the last Register answered -> the last worker holding the first membership [<= 2 s]
- heartbeat CPU: the coordinator's CPU time (``/proc/PID/stat``) over ``--heartbeat-window``
  seconds of every worker heartbeating at the interval the coordinator hands out (1 s, longer
  for jobs above 250 workers: ``CoordinatorParams.worker_heartbeat_interval_s``), as a share of
  one core [<= 20 %]
- commit: the members agree by two small all-reduces (``elastic/agreement.py``) and rank 0 alone
  sends ``Commit``. Measured: rank 0's call, sent -> answered ("recorded"), while every worker
  heartbeats, median over ``--commits`` rounds; predicted by ``collective/cost_model.py`` (the
  data-socket costs: workers on different hosts): the two all-reduces at N. The commit is
  their sum [<= 100 ms]
- failure: one worker stops; at one instant every survivor reports it (``ReportFailure``, as
  after a failed collective) and long-polls; the reports -> the last survivor holding the new
  membership without it [<= 1 s]
- restart: the coordinator is SIGKILLed and started again on its port; its port file written ->
  the last worker re-registered with its membership and last commit, which it does when its
  next heartbeat is answered "unknown" (as ``Worker.reregister``) [<= 5 s]
- coordinator peak RSS (``VmHWM``) before the restart [<= 500 MiB]

The simulators share the machine's cores with the coordinator: their own CPU use is printed
too, and on a machine with fewer cores than processes + 1 the times include their queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)

from benchmarks._common import free_ports, sigterm_interrupts, stop  # noqa: E402

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # the launchers' default
START_TIMEOUT_S = 60.0
PHASE_TIMEOUT_S = 120.0
TARGETS = {  # issue 17, at N = 1,000
    "formation_s": 2.0,
    "failure_s": 1.0,
    "commit_ms": 100.0,
    "heartbeat_cpu_pct": 20.0,
    "rss_mib": 500.0,
    "restart_s": 5.0,
}


# ---- the simulator: N/P workers in one process ---------------------------------------------


class SimulatedWorker:
    """One worker's side of the protocol: a channel, a heartbeat loop, the calls the driver asks for."""

    def __init__(self, worker_id: str, address: str, coordinator: str, token: str):
        from elasticdl_strategy.transport.auth import call_metadata
        from elasticdl_strategy.transport.endpoints import open_aio_channel
        from elasticdl_strategy.transport.options import TransportOptions
        from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc

        self.pb = coordinator_pb2
        self.worker_id, self.address = worker_id, address
        self.incarnation = os.urandom(8).hex()
        # The channel CoordinatorClient opens (keepalive, limits), a connection of its own as in a worker process.
        self._channel = open_aio_channel(coordinator, TransportOptions())
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.metadata = call_metadata(token)
        self.membership = coordinator_pb2.Membership()
        self.last_commit = coordinator_pb2.CommitRecord()
        self.heartbeating = False
        self.interval_s = HEARTBEAT_INTERVAL_S
        self.known_since: Optional[float] = None  # when it registered again after the coordinator's restart
        self._heartbeats: Optional[asyncio.Task] = None

    async def register(self, with_state: bool = False) -> float:
        request = self.pb.RegisterRequest(worker_id=self.worker_id, address=self.address, incarnation=self.incarnation)
        if with_state:
            request.membership.CopyFrom(self.membership)
            request.last_commit.CopyFrom(self.last_commit)
        response = await self.stub.Register(request, timeout=PHASE_TIMEOUT_S, metadata=self.metadata)
        self.interval_s = response.heartbeat_interval_s  # as CoordinatorClient.register
        return time.monotonic()

    async def wait_for_membership(self, after_version: int) -> float:
        """Long-polls until a membership newer than ``after_version`` holds this worker; when it came."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while time.monotonic() < deadline:
            request = self.pb.GetMembershipRequest(
                worker_id=self.worker_id, after_version=after_version, wait_s=30.0, incarnation=self.incarnation
            )
            response = await self.stub.GetMembership(request, timeout=40.0, metadata=self.metadata)
            m = response.membership
            if m.version > after_version and any(member.worker_id == self.worker_id for member in m.members):
                self.membership, self.last_commit = m, response.last_commit
                return time.monotonic()
        raise TimeoutError(f"{self.worker_id}: no membership after version {after_version} in {PHASE_TIMEOUT_S:g}s")

    def start_heartbeats(self) -> None:
        self.heartbeating = True
        self._heartbeats = asyncio.ensure_future(self._heartbeat_loop())

    async def stop(self) -> None:
        self.heartbeating = False
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        await self._channel.close()

    async def _heartbeat_loop(self) -> None:
        import grpc

        await asyncio.sleep(random.uniform(0, self.interval_s))  # spread, as processes started apart are
        stream = None
        while self.heartbeating:
            request = self.pb.HeartbeatRequest(
                worker_id=self.worker_id, membership_version=self.membership.version, incarnation=self.incarnation
            )
            # One stream of heartbeats, opened again when it breaks: at once, as CoordinatorClient's
            # reader learns of the break when it happens (this loop only at its next heartbeat).
            response = None
            for fresh in (stream is None, True):
                try:
                    stream = stream or self.stub.Heartbeats(metadata=self.metadata)
                    await stream.write(request)
                    response = await asyncio.wait_for(stream.read(), 5.0)
                except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
                    response = None
                if response is not None and response is not grpc.aio.EOF:
                    break
                response, stream = None, None  # broken; if it was new, the coordinator is down: next interval
                if fresh:
                    break
            if response is not None and not response.known:
                try:
                    registered = await self.register(with_state=True)  # as Worker.reregister after a restart
                    self.known_since = self.known_since or registered
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(self.interval_s)

    @property
    def is_rank_0(self) -> bool:
        return bool(self.membership.members) and self.membership.members[0].worker_id == self.worker_id

    async def commit(self, commit_id: int) -> Dict[str, float]:
        """Records ``commit_id`` for every member, as rank 0 does once they agreed."""
        request = self.pb.CommitRequest(
            worker_id=self.worker_id,
            membership_version=self.membership.version,
            commit_id=commit_id,
            incarnation=self.incarnation,
        )
        sent = time.monotonic()
        response = await self.stub.Commit(request, timeout=PHASE_TIMEOUT_S, metadata=self.metadata)
        if not response.recorded:
            raise RuntimeError(f"{self.worker_id}: commit #{commit_id} not recorded: {response.reason}")
        self.last_commit = self.pb.CommitRecord(commit_id=commit_id, membership_version=self.membership.version)
        return {"sent": sent, "answered": time.monotonic()}

    async def report_and_wait(self, suspect: str) -> float:
        version = self.membership.version
        request = self.pb.FailureReport(
            worker_id=self.worker_id,
            membership_version=version,
            suspects=[suspect],
            reason="a collective failed",
            incarnation=self.incarnation,
        )
        await self.stub.ReportFailure(request, timeout=PHASE_TIMEOUT_S, metadata=self.metadata)
        return await self.wait_for_membership(version)


async def _until(instant: float) -> None:
    await asyncio.sleep(max(0.0, instant - time.monotonic()))


async def simulate(coordinator: str, ids: Sequence[str], addresses: Sequence[str], token: str) -> None:
    """Serves the driver's commands, one JSON line each on stdin, one JSON answer line each on stdout."""
    workers = {i: SimulatedWorker(i, a, coordinator, token) for i, a in zip(ids, addresses, strict=True)}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        command = json.loads(line)
        kind, at = command["kind"], command.get("at", 0.0)
        await _until(at)
        live = [w for w in workers.values() if w.heartbeating or kind == "form"]
        answer: dict = {"cpu_s": time.process_time()}
        if kind == "form":
            registered = await asyncio.gather(*(w.register() for w in live))
            joined = await asyncio.gather(*(w.wait_for_membership(0) for w in live))
            for w in live:
                w.start_heartbeats()
            answer.update(registered=max(registered), joined=list(joined), interval_s=live[0].interval_s)
        elif kind == "commit":
            answer["calls"] = [await w.commit(command["commit_id"]) for w in live if w.is_rank_0]
        elif kind == "die":
            await asyncio.gather(*(workers[i].stop() for i in command["ids"] if i in workers))
        elif kind == "report":
            answer["joined"] = await asyncio.gather(*(w.report_and_wait(command["suspect"]) for w in live))
        elif kind == "adopted":  # waits until every live worker is known again after the restart
            deadline = time.monotonic() + PHASE_TIMEOUT_S
            while not all(w.known_since is not None for w in live):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the restarted coordinator did not know every worker in {PHASE_TIMEOUT_S:g}s")
                await asyncio.sleep(0.05)  # polls flags the heartbeat loops set
            answer["known"] = [w.known_since for w in live]
        elif kind == "idle":
            pass
        answer["cpu_s"] = time.process_time() - answer["cpu_s"]
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    await asyncio.gather(*(w.stop() for w in workers.values() if w.heartbeating))


# ---- the driver ------------------------------------------------------------------------------


class Coordinator:
    """The coordinator process, started (again) on a fixed port."""

    def __init__(self, workers: int, port: int, token: str, directory: Path):
        self.workers, self.port, self.token, self.directory = workers, port, token, directory
        self.process: Optional[subprocess.Popen] = None
        self.serving_since = 0.0

    def start(self) -> None:
        port_file = self.directory / "coordinator.port"
        port_file.unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", "elasticdl_strategy", "coordinator", "--port", str(self.port),
            "--port-file", str(port_file), "--workers", str(self.workers), "--min-workers", str(self.workers // 2),
            "--last-call", str(PHASE_TIMEOUT_S),
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
        ]  # fmt: skip
        env = dict(os.environ, EDL_JOB_TOKEN=self.token, EDL_LOG_LEVEL="warning")
        log = open(self.directory / "coordinator.log", "ab")
        self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start (see {self.directory / 'coordinator.log'})")
            time.sleep(0.01)
        self.serving_since = time.monotonic()

    def cpu_s(self) -> float:
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM in /proc/PID/status")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)


class Simulators:
    """The simulator processes and their command pipes."""

    def __init__(self, n: int, processes: int, coordinator: str, token: str, procs: List[subprocess.Popen]):
        ids = [f"sim-{i:04d}" for i in range(n)]
        ports = free_ports(n)  # free a moment ago and nothing listens: probes are refused
        self.ids = ids
        self.procs: List[subprocess.Popen] = []
        for p in range(processes):
            share = slice(p, n, processes)
            argv = [
                sys.executable, __file__, "--simulate", coordinator,
                "--ids", ",".join(ids[share]), "--addresses", ",".join(f"127.0.0.1:{q}" for q in ports[share]),
            ]  # fmt: skip
            env = dict(os.environ, EDL_JOB_TOKEN=token)
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
            )
            procs.append(proc)
            self.procs.append(proc)

    def ask(self, command: dict) -> List[dict]:
        """Sends ``command`` to every simulator; their answers, once all came."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        answers = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # bounded: every simulator call has a timeout
            if not line:
                raise RuntimeError(f"a simulator exited (code {proc.wait(timeout=10)}) during {command['kind']}")
            answers.append(json.loads(line))
        return answers


def measure(n: int, processes: int, commits: int, heartbeat_window_s: float) -> Dict[str, float]:
    from elasticdl_strategy.transport.auth import new_token

    token = new_token()
    vote_s = _predicted_vote_s(n)  # first: it imports the package's elastic layer (and TensorFlow)
    procs: List[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="edl-control-plane-") as directory:
        coordinator = Coordinator(n, free_ports(1)[0], token, Path(directory))
        try:
            coordinator.start()
            procs.append(coordinator.process)  # type: ignore[arg-type]
            sims = Simulators(n, min(processes, n), f"127.0.0.1:{coordinator.port}", token, procs)
            result: Dict[str, float] = {}

            answers = sims.ask({"kind": "form"})
            result["heartbeat_interval_s"] = answers[0]["interval_s"]
            last_registered = max(a["registered"] for a in answers)
            result["formation_s"] = max(t for a in answers for t in a["joined"]) - last_registered

            cpu_before, sim_cpu = coordinator.cpu_s(), 0.0
            started = time.monotonic()
            time.sleep(heartbeat_window_s)  # the window itself: nothing to wait for but time
            result["heartbeat_cpu_pct"] = 100 * (coordinator.cpu_s() - cpu_before) / (time.monotonic() - started)

            calls = []
            for commit_id in range(1, commits + 1):
                answers = sims.ask({"kind": "commit", "commit_id": commit_id, "at": time.monotonic() + 0.2})
                (call,) = [c for a in answers for c in a["calls"]]
                calls.append(call["answered"] - call["sent"])
                sim_cpu += sum(a["cpu_s"] for a in answers)
            result["commit_call_ms"] = 1000 * statistics.median(calls)
            result["commit_call_max_ms"] = 1000 * max(calls)
            result["commit_vote_ms"] = 1000 * vote_s
            result["commit_ms"] = result["commit_call_ms"] + result["commit_vote_ms"]
            result["sim_cpu_per_commit_s"] = sim_cpu / commits

            victim = sims.ids[-1]
            sims.ask({"kind": "die", "ids": [victim]})
            reported_at = time.monotonic() + 0.2
            answers = sims.ask({"kind": "report", "suspect": victim, "at": reported_at})
            result["failure_s"] = max(t for a in answers for t in a["joined"]) - reported_at

            result["rss_mib"] = coordinator.peak_rss_mib()
            coordinator.kill()
            coordinator.start()
            procs.append(coordinator.process)  # type: ignore[arg-type]
            answers = sims.ask({"kind": "adopted"})
            result["restart_s"] = max(t for a in answers for t in a["known"]) - coordinator.serving_since
            return result
        finally:
            stop(procs)


def _predicted_vote_s(n: int) -> float:
    """The cost model's time for the vote's two all-reduces at ``n`` workers on different hosts."""
    from elasticdl_strategy.collective import cost_model
    from elasticdl_strategy.elastic import agreement

    sizes = (8 * (8 + n), agreement.RESPONSE_BYTES)  # the vote (int64 per member and 8), the answer
    return sum(
        cost_model.predict(cost_model.choose(nbytes, n, cost_model.DATA_SOCKET), nbytes, n, cost_model.DATA_SOCKET)
        for nbytes in sizes
    )


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"every worker count must be at least 2, got {text!r}")
    return values


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_int_list, default=[10, 100, 1000])
    parser.add_argument("--processes", type=int, default=4, help="simulator processes (default 4)")
    parser.add_argument("--commits", type=int, default=10, help="commit rounds (default 10)")
    parser.add_argument("--heartbeat-window", type=float, default=10.0, help="seconds of heartbeats measured")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--simulate", metavar="COORDINATOR", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--addresses", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.simulate:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ids, addresses = args.ids.split(","), args.addresses.split(",")
        asyncio.run(simulate(args.simulate, ids, addresses, os.environ["EDL_JOB_TOKEN"]))
        return 0
    sigterm_interrupts()
    print(f"control plane: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {args.processes} simulators")
    header = (
        "N", "formation s", "failure s", "commit ms = call (max) + vote", "heartbeat CPU % (every s)", "RSS MiB",
        "restart s",
    )  # fmt: skip
    print(" | ".join(header))
    results: Dict[int, Dict[str, float]] = {}
    for n in args.workers:
        r = results[n] = measure(n, args.processes, args.commits, args.heartbeat_window)
        print(
            f"{n} | {r['formation_s']:.3f} | {r['failure_s']:.3f} | {r['commit_ms']:.1f} = "
            f"{r['commit_call_ms']:.1f} ({r['commit_call_max_ms']:.1f}) + {r['commit_vote_ms']:.1f} | "
            f"{r['heartbeat_cpu_pct']:.1f} ({r['heartbeat_interval_s']:g}) | {r['rss_mib']:.0f} | {r['restart_s']:.2f}",
            flush=True,
        )
    largest = results[max(results)]
    missed = [f"{k} {largest[k]:.3g} > {v:g}" for k, v in TARGETS.items() if largest[k] > v]
    print(f"targets at N = {max(results)}: " + ("all met" if not missed else "missed: " + ", ".join(missed)))
    if args.json:
        args.json.write_text(json.dumps({str(n): r for n, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
