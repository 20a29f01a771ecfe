"""What test workers hand back: one JSON file per rank."""

import json
import os


def write_report(results_dir: str, rank: int, report: dict) -> None:
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
