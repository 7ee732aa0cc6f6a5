"""benchmarks/colocation.py on the CPU: groups, speeds, failures that spare the other groups, the sweep.

The end-to-end tests run real worker processes (tiny models, 32-pixel images, 1-second windows,
one torch thread each), so they hold on a busy 2-core machine; they check structure and signs,
never how fast anything is.
"""

from __future__ import annotations

import json
import math
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import colocation
from benchmarks.colocation import GroupSyntaxError, Member, WorkerFailed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--image-size", "32", "--batch", "2", "--seconds", "1", "--cpu-threads", "1"]


def run_bench(*args: str, timeout: float = 150) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """Run the benchmark's parent; returns the process and the JSON it wrote (None if none)."""
    json_path = Path(args[args.index("--json") + 1]) if "--json" in args else None
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.colocation", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    record = json.loads(json_path.read_text()) if json_path is not None and json_path.exists() else None
    return proc, record


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# End to end (worker processes)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_solo_and_pair_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "colocation.json"
    proc, record = run_bench(*TINY, "--groups", "resnet18 resnet18+resnet18", "--json", str(out), "--timeout", "90")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record is not None
    assert record["errors"] == []
    assert record["device"] == "cpu" and record["seconds"] == 1.0 and record["image_size"] == 32
    assert record["command"][1:3] == ["-m", "benchmarks.colocation"] and str(out) in record["command"]
    assert [g["members"] for g in record["groups"]] == [["resnet18@2"], ["resnet18@2", "resnet18@2"]]
    for group in record["groups"]:
        for result in group["results"]:
            assert result["model"] == "resnet18" and result["batch"] == 2
            assert result["iterations"] >= 1
            assert is_number(result["samples_per_second"]) and result["samples_per_second"] > 0
            assert result["seconds"] >= 1.0  # trains at least the window
            assert len(result["iteration_times_s"]) == result["iterations"]
        nvml = group["utilisation"]["nvml"]
        assert isinstance(nvml, str) and nvml.startswith("unavailable:")  # no NVML for a CPU device
    solo, pair = record["groups"]
    assert solo["speeds"] == [] and solo["sum_of_speeds"] is None
    speeds = [s["speed"] for s in pair["speeds"]]
    assert len(speeds) == 2 and all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in speeds)
    assert pair["sum_of_speeds"] == pytest.approx(sum(speeds))
    solo_rate = solo["results"][0]["samples_per_second"]
    assert speeds[0] == pytest.approx(pair["results"][0]["samples_per_second"] / solo_rate)
    assert pair["timing"]["overlap_fraction"] > 0.5  # both started on 'go' and trained side by side
    assert "NaN" not in out.read_text()
    assert "resnet18@2+resnet18@2" in proc.stdout  # the table


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_failed_group_is_an_error_and_the_others_still_run(tmp_path: Path) -> None:
    # not_a_model's worker exits with status 2 before 'ready' and says why; the resnet18 group
    # after it must still run and be written.
    out = tmp_path / "colocation.json"
    proc, record = run_bench(*TINY, "--groups", "not_a_model resnet18", "--json", str(out), "--timeout", "90")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert record is not None
    assert [g["members"] for g in record["groups"]] == [["resnet18@2"]]
    assert record["groups"][0]["results"][0]["samples_per_second"] > 0
    assert [e["group"] for e in record["errors"]] == ["not_a_model@2"]
    failed = record["errors"][0]
    assert "exited (status 2) before 'ready'" in failed["error"]
    assert "not a torchvision classification model" in failed["error"]
    assert failed["workers"][0]["returncode"] == 2
    assert "not a torchvision classification model" in failed["workers"][0]["stderr_tail"]
    assert "not a torchvision" in proc.stderr and "ERROR not_a_model@2" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sweep_fits_a_line(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    args = ["--device", "cpu", "--image-size", "32", "--seconds", "0.5", "--cpu-threads", "1"]
    proc, record = run_bench(*args, "--sweep", "resnet18", "--batches", "2,4", "--json", str(out), "--timeout", "90")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record is not None and record["errors"] == [] and record["groups"] == []
    sweep = record["sweep"]
    assert [p["batch"] for p in sweep["points"]] == [2, 4]
    assert all(p["median_iteration_s"] > 0 and p["iterations"] >= 1 for p in sweep["points"])
    fit = sweep["fit"]
    assert {"fixed_s", "per_sample_s", "r2", "fixed_share_at_12"} <= set(fit)
    assert is_number(fit["fixed_s"]) and is_number(fit["per_sample_s"]) and fit["points"] == 2
    assert "fit:" in proc.stdout


@pytest.mark.timeout(60)
def test_bad_command_lines_exit_2_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    for groups, expected in [("resnet18++alexnet", "empty member"), ("resnet18@x", "bad batch"), ("  ", "empty")]:
        proc, record = run_bench("--device", "cpu", "--groups", groups, "--json", str(out), timeout=60)
        assert proc.returncode == 2 and expected in proc.stderr, (groups, proc.stderr)
        assert record is None  # nothing ran, nothing written
    proc, _ = run_bench("--device", "cpu", "--json", str(out), timeout=60)
    assert proc.returncode == 2 and "nothing to run" in proc.stderr
    proc, _ = run_bench("--help", timeout=60)
    assert proc.returncode == 0 and "--groups" in proc.stdout and "--sweep" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Pieces (no worker processes)


@pytest.mark.timeout(30)
def test_parse_groups() -> None:
    groups = colocation.parse_groups(["resnet50 alexnet@32+resnet50", "densenet121"], default_batch=64)
    assert groups == [
        [Member("resnet50", 64)],
        [Member("alexnet", 32), Member("resnet50", 64)],
        [Member("densenet121", 64)],
    ]
    for bad in ["a+", "+", "a++b", "a@0", "a@-3", "a@", "@8"]:
        with pytest.raises(GroupSyntaxError):
            colocation.parse_groups([bad], default_batch=64)


def _group(*results: tuple[str, int, float, float]) -> dict[str, Any]:
    return {
        "results": [
            {"model": m, "batch": b, "samples_per_second": rate, "median_iteration_s": median}
            for m, b, rate, median in results
        ]
    }


@pytest.mark.timeout(30)
def test_speeds_need_the_same_model_and_batch_alone() -> None:
    groups = [
        _group(("resnet50", 64, 400.0, 0.16)),
        _group(("resnet50", 64, 240.0, 0.25), ("alexnet", 64, 1000.0, 0.05)),  # no alexnet solo
        _group(("resnet50", 64, 200.0, 0.32), ("resnet50", 64, 220.0, 0.30)),
        _group(("resnet50", 32, 100.0, 0.30), ("resnet50", 64, 100.0, 0.60)),  # no solo at batch 32
        _group(("alexnet", 64, 2000.0, 0.032)),  # a solo after the pair still counts
    ]
    colocation.compute_speeds(groups)
    mixed = groups[1]["speeds"]
    assert mixed[0]["speed"] == pytest.approx(0.6) and mixed[0]["speed_from_median"] == pytest.approx(0.64)
    assert mixed[1]["speed"] == pytest.approx(0.5)
    assert groups[1]["sum_of_speeds"] == pytest.approx(1.1)
    assert [s["speed"] for s in groups[2]["speeds"]] == pytest.approx([0.5, 0.55])
    assert groups[3]["speeds"][0]["speed"] is None and "no solo" in groups[3]["speeds"][0]["note"]
    assert groups[3]["sum_of_speeds"] is None
    assert groups[0]["speeds"] == [] and groups[4]["sum_of_speeds"] is None


@pytest.mark.timeout(30)
def test_fit_recovers_a_line_and_skips_out_of_memory() -> None:
    points = [{"batch": b, "median_iteration_s": 0.05 + 0.004 * b} for b in (16, 32, 64, 128)]
    points.append({"batch": 256, "error": "out of memory"})
    fit = colocation.fit_linear(points)
    assert fit is not None and fit["points"] == 4
    assert fit["fixed_s"] == pytest.approx(0.05) and fit["per_sample_s"] == pytest.approx(0.004)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["fixed_share_at_12"] == pytest.approx(0.05 / (0.05 + 0.048))
    assert colocation.fit_linear(points[:1] + points[-1:]) is None


@pytest.mark.timeout(30)
def test_json_is_atomic_and_never_holds_nan(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "r.json"
    colocation.write_json_atomic(path, {"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2.5}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2.5}}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left behind


@pytest.mark.timeout(30)
def test_a_bug_in_one_step_is_recorded_and_the_run_goes_on() -> None:
    record: dict[str, Any] = {"errors": []}
    colocation._guarded("resnet50@64", record, lambda: {}["missing"])
    colocation._guarded("alexnet@64", record, lambda: None)
    assert [e["group"] for e in record["errors"]] == ["resnet50@64"]
    error = record["errors"][0]
    assert error["error"].startswith("internal: KeyError") and "Traceback" in error["traceback"]


@pytest.mark.timeout(60)
def test_a_silent_worker_times_out_and_is_killed() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(120)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=colocation._pump_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    worker = colocation.WorkerProcess("sleeper", proc, lines, tempfile.TemporaryFile(), reader=reader)
    started = time.perf_counter()
    with pytest.raises(WorkerFailed, match="timed out waiting for 'ready'"):
        worker.wait_for("ready", time.perf_counter() + 1.0)
    assert time.perf_counter() - started < 30
    worker.kill()
    assert proc.returncode is not None and proc.returncode < 0  # killed by a signal, and reaped
    assert worker.report()["stdout_other"] == ["hello"]
