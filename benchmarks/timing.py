"""Side-by-side timing helpers: interleaved repeats, medians and ratios (machines are noisy)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def interleaved_medians(
    candidates: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, measured in turn (A B A B ...) so drift hits all alike."""
    for _ in range(warmup):
        for run in candidates.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, run in candidates.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return samples


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "p10": percentile(values, 0.10),
        "p90": percentile(values, 0.90),
        "p99": percentile(values, 0.99),
        "n": len(values),
    }


def environment() -> dict[str, str]:
    info = {"python": sys.version.split()[0], "machine": platform.machine(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_result(name: str, command: str, payload: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``payload`` with the command and environment to ``benchmarks/results/NAME.json``."""
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    record = {"command": command, "environment": environment(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def add_no_write(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results/")


def save(name: str, module: str, argv: list[str] | None, payload: dict[str, Any], no_write: bool) -> None:
    """Record ``payload`` as benchmarks/results/NAME.json with the command that produced it."""
    if no_write:
        return
    path = write_result(name, f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]), payload)
    print(f"wrote {path}")


@contextmanager
def scratch_namespace(prefix: str) -> Iterator[Path]:
    """A private drbalance namespace and runtime dir for one benchmark, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="drbalance-bench-") as folder:
        os.environ["DRBALANCE_NAMESPACE"] = f"{prefix}{os.getpid()}"
        os.environ["DRBALANCE_RUNTIME_DIR"] = str(Path(folder) / "run")
        yield Path(folder)
