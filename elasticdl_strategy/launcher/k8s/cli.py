"""``elasticdl-strategy k8s SUBCOMMAND``: submit, manifest, status, logs, delete (and master, in the pod)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from elasticdl_strategy.errors import ConfigError, ElasticDLError
from elasticdl_strategy.launcher.arguments import OneLineParser, split_command

PROG = "elasticdl-strategy k8s"
USAGE = f"""usage: {PROG} COMMAND ...

Commands:
    submit    create a job: its master pod creates and watches the workers
    manifest  print the YAML of every object submit would create (and RBAC)
    status    phase, workers, restarts and membership version of a job
    logs      log of a job's master or of one worker
    delete    delete every object of a job
    master    run the master (inside the master pod)
"""


def _job_parser(command: str) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=f"{PROG} {command}", usage=f"{PROG} {command} --name JOB --image IMAGE --workers N [...] -- CMD..."
    )
    p.add_argument("--name", required=True, help="job name (lower-case DNS label)")
    p.add_argument("--image", required=True, help="container image with TensorFlow and elasticdl_strategy")
    p.add_argument("--workers", "-w", type=int, required=True, help="worker pods to start")
    p.add_argument("--min-workers", type=int, help="fewest workers to train with (default: --workers)")
    p.add_argument("--max-workers", type=int, help="most workers in a membership (default: --workers)")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--cpu", default="1", help="CPU request and limit per worker (default 1)")
    p.add_argument("--memory", default="2Gi", help="memory request and limit per worker (default 2Gi)")
    p.add_argument("--gpu", type=int, default=0, help="nvidia.com/gpu per worker pod: 0 (default) or 1")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the workers")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches of failed workers (default 3)")
    p.add_argument("--priority-class", help="PriorityClass of the pods")
    p.add_argument("--relaunch-on-error", action="store_true", help="also relaunch workers that exit 1-127 or OOM")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="silence that declares a worker dead")
    p.add_argument("--rendezvous-timeout", type=float, default=600.0, help="seconds workers wait for a membership")
    p.add_argument("--termination-grace", type=int, default=60, help="seconds a worker gets to leave on SIGTERM")
    p.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    p.add_argument(
        "--shared-memory-host-path",
        metavar="DIR",
        help="node directory mounted in every worker: workers on one node exchange through shared memory",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config or in-cluster)")
    return p


def _config(parser: argparse.ArgumentParser, argv: List[str]):
    from elasticdl_strategy.launcher.k8s.job_config import K8sJobConfig, parse_env

    options, command = split_command(argv)
    args = parser.parse_args(options)
    try:
        config = K8sJobConfig(
            name=args.name,
            image=args.image,
            command=tuple(command),
            workers=args.workers,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            namespace=args.namespace,
            cpu=args.cpu,
            memory=args.memory,
            gpu=args.gpu,
            env=tuple(parse_env(args.env).items()),
            max_restarts=args.max_restarts,
            priority_class=args.priority_class,
            relaunch_on_error=args.relaunch_on_error,
            heartbeat_timeout_s=args.heartbeat_timeout,
            rendezvous_timeout_s=args.rendezvous_timeout,
            termination_grace_s=args.termination_grace,
            image_pull_policy=args.image_pull_policy,
            shared_memory_host_path=args.shared_memory_host_path,
        )
    except ConfigError as e:
        parser.error(str(e))
    return config, args


def _api_client(kubeconfig: Optional[str]):
    from kubernetes import client, config

    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        try:
            config.load_kube_config()
        except (config.ConfigException, FileNotFoundError, TypeError):
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise ConfigError("no Kubernetes configuration: set KUBECONFIG or pass --kubeconfig") from None
    return client.ApiClient()


def _submit(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.job_client import JobClient

    config, args = _config(_job_parser("submit"), argv)
    created = JobClient(_api_client(args.kubeconfig)).submit(config)
    for item in created:
        print(f"created {item}")
    print(f"job {config.name} submitted: elasticdl-strategy k8s status {config.name} -n {config.namespace}")
    return 0


def _manifest(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.manifests import render_yaml

    config, _ = _config(_job_parser("manifest"), argv)
    sys.stdout.write(render_yaml(config))
    return 0


def _master(argv: List[str]) -> int:
    import os

    from elasticdl_strategy.launcher.k8s.job_config import JOB_CONFIG_VARIABLE, K8sJobConfig
    from elasticdl_strategy.launcher.k8s.master import run_master

    if argv:
        raise ConfigError(f"the master takes no arguments: its configuration comes in {JOB_CONFIG_VARIABLE}")
    if JOB_CONFIG_VARIABLE not in os.environ:
        raise ConfigError(f"{JOB_CONFIG_VARIABLE} is not set: the master runs in the pod that `submit` creates")
    return run_master(K8sJobConfig.from_json(os.environ[JOB_CONFIG_VARIABLE]))


def _job_name_parser(command: str) -> argparse.ArgumentParser:
    p = OneLineParser(prog=f"{PROG} {command}")
    p.add_argument("job", help="job name")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config or in-cluster)")
    return p


def _status(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.job_client import JobClient, format_status

    p = _job_name_parser("status")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    status = JobClient(_api_client(args.kubeconfig)).status(args.job, args.namespace)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _logs(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.job_client import JobClient

    p = _job_name_parser("logs")
    p.add_argument("--worker", type=int, help="worker index (default: the master)")
    p.add_argument("--tail", type=int, help="last lines only")
    args = p.parse_args(argv)
    sys.stdout.write(JobClient(_api_client(args.kubeconfig)).logs(args.job, args.namespace, args.worker, args.tail))
    return 0


def _delete(argv: List[str]) -> int:
    from elasticdl_strategy.launcher.k8s.job_client import JobClient

    args = _job_name_parser("delete").parse_args(argv)
    deleted = JobClient(_api_client(args.kubeconfig)).delete(args.job, args.namespace)
    if not deleted:
        raise ConfigError(f"no job {args.job!r} in namespace {args.namespace!r}")
    print(f"job {args.job}: deleted {deleted} object(s)")
    return 0


_COMMANDS = {
    "submit": _submit,
    "manifest": _manifest,
    "status": _status,
    "logs": _logs,
    "delete": _delete,
    "master": _master,
}


def main(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.strip())
        return 0 if argv else 2
    command = _COMMANDS.get(argv[0])
    if command is None:
        sys.stderr.write(f"{PROG}: error: unknown command {argv[0]!r} (expected one of: {', '.join(_COMMANDS)})\n")
        return 2
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        return command(argv[1:])
    except ConfigException as e:
        sys.stderr.write(f"{PROG} {argv[0]}: error: bad Kubernetes configuration: {e}\n")
        return 2
    except HTTPError as e:
        sys.stderr.write(f"{PROG} {argv[0]}: error: cannot reach the Kubernetes API: {e}\n")
        return 1
    except ConfigError as e:
        sys.stderr.write(f"{PROG} {argv[0]}: error: {e}\n")
        return 2
    except ElasticDLError as e:
        sys.stderr.write(f"{PROG} {argv[0]}: error: {e}\n")
        return 1
