"""What test workers hand back: one JSON file per rank."""

import json
import os


def write_report(results_dir: str, rank: int, report: dict) -> None:
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def write_named_report(results_dir: str, name: str, report: dict) -> None:
    """Like :func:`write_report`, keyed by a name (worker id) for jobs whose ranks change."""
    tmp = os.path.join(results_dir, f".{name}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(results_dir, f"{name}.json"))
