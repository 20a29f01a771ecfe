"""The ``elasticdl-strategy`` command (also ``python -m elasticdl_strategy``).

Subcommands:
    run          start the coordinator and N workers on this machine
    k8s          submit and control jobs on Kubernetes (k8s --help)
    coordinator  serve the coordinator (started by the launchers)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from elasticdl_strategy import logs
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher.arguments import OneLineParser, split_command

PROG = "elasticdl-strategy"


def _run_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=f"{PROG} run",
        description="Start the coordinator and N workers running CMD on this machine.",
        usage=f"{PROG} run --workers N [options] -- CMD [ARGS...]",
    )
    p.add_argument("--workers", "-n", type=int, required=True, help="number of workers to start")
    p.add_argument(
        "--min-workers", type=int, help="fewest workers to train with; below it training waits (default: --workers)"
    )
    p.add_argument(
        "--max-workers",
        type=int,
        help="most workers in a membership; workers beyond it wait as standbys (default: --workers)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=0, help="start a failed worker again (new worker id) up to this many times"
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="interface for the coordinator and workers (default 127.0.0.1)")
    p.add_argument("--timeout", type=float, help="deadline of collectives and receives in seconds (default 60)")
    p.add_argument("--rendezvous-timeout", type=float, default=120.0, help="seconds to wait for a membership")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="silence that declares a worker dead")
    p.add_argument(
        "--gpus-per-worker",
        type=int,
        default=0,
        metavar="G",
        help="give worker slot i the GPUs [i*G, (i+1)*G) through CUDA_VISIBLE_DEVICES, out of the launcher's "
        "CUDA_VISIBLE_DEVICES or else nvidia-smi -L (default 0: CUDA_VISIBLE_DEVICES left as it is)",
    )
    p.add_argument("--tls-cert", help="PEM certificate for TLS on every connection")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA bundle: verify peers and require client certificates")
    p.add_argument("--tls-server-name", help="name to verify in server certificates instead of the host")
    return p


def _run(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.local import LaunchConfig, LocalLauncher
    from elasticdl_strategy.transport.options import TLSConfig

    parser = _run_parser()
    options, command = split_command(argv)
    args = parser.parse_args(options)
    try:
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise ConfigError("--tls-cert and --tls-key go together")
            tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        config = LaunchConfig(
            command=command,
            workers=args.workers,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            max_restarts=args.max_restarts,
            port=args.port,
            host=args.host,
            timeout_s=args.timeout,
            rendezvous_timeout_s=args.rendezvous_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            tls=tls,
            gpus_per_worker=args.gpus_per_worker,
        )
    except ConfigError as e:
        parser.error(str(e))
    return LocalLauncher(config).run()


def _coordinator(argv: List[str]) -> int:
    from elasticdl_strategy.coordinator import server

    parser = OneLineParser(prog=f"{PROG} coordinator", description="Serve the rendezvous coordinator.")
    server.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return server.run(args)
    except ConfigError as e:
        parser.error(str(e))


def _k8s(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.cli import main as k8s_main

    return k8s_main(argv)


_COMMANDS = {"run": _run, "k8s": _k8s, "coordinator": _coordinator}
_ROLES = {"run": "launcher", "k8s": "k8s", "coordinator": "coordinator"}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    role = _ROLES.get(argv[0] if argv else "", "cli")
    try:
        logs.configure(lambda: role, os.environ)
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(
            __doc__.strip().replace("The ``elasticdl-strategy`` command", f"usage: {PROG} COMMAND ...\n\nThe command")
        )
        return 0 if argv else 2
    command = _COMMANDS.get(argv[0])
    if command is None:
        sys.stderr.write(f"{PROG}: error: unknown command {argv[0]!r} (expected one of: {', '.join(_COMMANDS)})\n")
        return 2
    return command(argv[1:])
