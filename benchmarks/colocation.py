"""How much training jobs slow each other down when they share ONE GPU (simulator calibration).

Three modes, one file:

- **group mode** (the default): for each group (``resnet50+alexnet``), start one worker process
  per member at once, wait until every worker has built its model and warmed up (``ready``), send
  ``go`` to all of them together, let each train for ``--seconds`` of wall clock, collect one JSON
  line from each. Meanwhile the parent samples the GPU's utilisation through NVML every 0.2 s.
  Each member of a multi-member group then gets a **speed**: its co-located samples/s over the
  samples/s of the same model and batch alone (a single-member group of the same run). The
  group's **sum of speeds** is its total throughput relative to solo: above 1, sharing helps.
- **sweep mode** (``--sweep MODEL --batches 16,32,64``): one worker process trains MODEL alone at
  each batch size in turn and records the median iteration time, then the parent fits
  ``fixed_s + per_sample_s * batch`` by least squares: the linear device-time model of
  drbalance/workload/models.py. Runs before the groups when both are asked for.
- **worker mode** (``--worker``): what the parent starts; not meant to be run by hand.

One iteration = zero_grad, forward, cross-entropy, backward, SGD step (lr 0.01, momentum 0.9),
on a synthetic batch (``torch.randn(B, 3, S, S)`` and random labels of 1000 classes) created once
on the device: no data loading. On CUDA every iteration ends with ``torch.cuda.synchronize()``,
so the times are real and no worker queues work ahead of the window.

Robust for a one-shot run on a borrowed machine: the JSON is rewritten (atomically) after the
sweep and after every group; a failed group (a worker that crashes, times out or prints a
malformed line) is recorded under ``errors`` with the tail of its stderr, its workers are killed,
and the run goes on with the next group. The exit status is 0 without errors, 1 with any, 2 for
bad arguments.

Usage:
    python -m benchmarks.colocation --device cuda:0 --seconds 5 --batch 64 \\
        --groups "resnet50 alexnet resnet50+resnet50 resnet50+alexnet" --json colocation.json
    python -m benchmarks.colocation --device cuda:0 --sweep resnet50 --batches 16,32,64,128,256 --json sweep.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from drbalance.argtypes import positive_float, positive_int

REPO_ROOT = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.colocation"
NUM_CLASSES = 1000
MAX_ITERATION_TIMES = 2000  # entries of the per-iteration list kept in a worker's JSON line
NVML_INTERVAL_S = 0.2  # seconds between two NVML utilisation samples
STDERR_TAIL_CHARS = 3000  # characters of a failed worker's stderr kept in "errors"
EXIT_GRACE_S = 15.0  # seconds a worker may take to exit after its JSON line


# ----------------------------------------------------------------------------------------------
# Input parsing


@dataclass(frozen=True)
class Member:
    """One job of a group: a torchvision model name and its batch size (images per iteration)."""

    model: str
    batch: int

    @property
    def label(self) -> str:
        return f"{self.model}@{self.batch}"


class GroupSyntaxError(ValueError):
    """A ``--groups`` entry that cannot be parsed (empty member, bad ``@batch``)."""


def batch_list(text: str) -> list[int]:
    """argparse type: comma-separated positive batch sizes, e.g. ``16,32,64``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated batch sizes such as 16,32,64")
    return [positive_int(p) for p in parts]


def parse_member(text: str, default_batch: int) -> Member:
    """``resnet50`` or ``resnet50@32`` -> Member; raises GroupSyntaxError on bad input."""
    model, sep, batch_text = text.partition("@")
    model = model.strip()
    if not model:
        raise GroupSyntaxError(f"empty model name in member {text!r}")
    if not sep:
        return Member(model, default_batch)
    try:
        batch = int(batch_text)
    except ValueError:
        raise GroupSyntaxError(f"bad batch size in member {text!r} (expected MODEL@INTEGER)") from None
    if batch <= 0:
        raise GroupSyntaxError(f"batch size must be positive in member {text!r}")
    return Member(model, batch)


def parse_groups(entries: Iterable[str], default_batch: int) -> list[list[Member]]:
    """Groups from ``--groups`` values: whitespace separates groups, ``+`` separates members.

    Raises GroupSyntaxError for an empty group or member (``a++b``, ``+``, ``a+``).
    """
    groups: list[list[Member]] = []
    for entry in entries:
        for token in entry.split():
            parts = token.split("+")
            if any(not p.strip() for p in parts):
                raise GroupSyntaxError(f"empty member in group {token!r} (members are joined by a single '+')")
            groups.append([parse_member(p, default_batch) for p in parts])
    return groups


def group_label(members: Sequence[Member]) -> str:
    return "+".join(m.label for m in members)


def classification_models() -> set[str]:
    """Names of torchvision's classification model builders (``torchvision.models.<name>``)."""
    import torchvision

    return set(torchvision.models.list_models(module=torchvision.models))


def unknown_model_message(name: str) -> str:
    return f"{name!r} is not a torchvision classification model (see torchvision.models.list_models())"


# ----------------------------------------------------------------------------------------------
# Worker mode (runs in the child processes)


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _build_training(model_name: str, device_text: str, cpu_threads: int) -> tuple[Any, Any, Any, Any]:
    """(torch, device, model, optimizer) for MODEL on DEVICE; SystemExit(2) for an unknown model."""
    import torch
    import torchvision

    if model_name not in classification_models():
        print(f"error: {unknown_model_message(model_name)}", file=sys.stderr)
        raise SystemExit(2)
    if cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    device = torch.device(device_text)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, model_name)(weights=None).to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch, device, model, optimizer


def _make_batch(torch: Any, device: Any, batch: int, image_size: int) -> tuple[Any, Any]:
    """Synthetic images (B, 3, S, S) and integer labels in [0, 1000), on the device."""
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, NUM_CLASSES, (batch,), device=device)
    return images, labels


def _train_step(torch: Any, device: Any, model: Any, optimizer: Any, images: Any, labels: Any) -> float:
    """One training iteration; returns its wall-clock duration in seconds (device synchronised)."""
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    output = model(images)
    if not isinstance(output, torch.Tensor):  # GoogLeNet/Inception return (logits, aux...) in training
        output = output[0]
    loss = torch.nn.functional.cross_entropy(output, labels)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _train_for(
    torch: Any, device: Any, model: Any, optimizer: Any, images: Any, labels: Any, seconds: float
) -> tuple[list[float], float, float]:
    """Train until ``seconds`` of wall clock have passed (at least one iteration).

    Returns (iteration times in s, elapsed s, unix time at the start).
    """
    times: list[float] = []
    start_unix = time.time()
    started = time.perf_counter()
    while True:
        times.append(_train_step(torch, device, model, optimizer, images, labels))
        if time.perf_counter() - started >= seconds:
            break
    return times, time.perf_counter() - started, start_unix


def _device_name(torch: Any, device: Any) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _peak_memory_mib(torch: Any, device: Any) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def run_worker(args: argparse.Namespace) -> int:
    """Worker: build, warm up, print ``ready``, wait for ``go``, train, print one JSON line."""
    process_started = time.perf_counter()
    torch, device, model, optimizer = _build_training(args.model, args.device, args.cpu_threads)
    images, labels = _make_batch(torch, device, args.batch, args.image_size)
    for _ in range(args.warmup):
        _train_step(torch, device, model, optimizer, images, labels)
    setup_s = time.perf_counter() - process_started
    _emit("ready")
    command = sys.stdin.readline().strip()
    if command != "go":
        print(f"error: expected 'go' on stdin, got {command!r} (parent gone?)", file=sys.stderr)
        return 3
    times, elapsed, start_unix = _train_for(torch, device, model, optimizer, images, labels, args.seconds)
    result = {
        "model": args.model,
        "batch": args.batch,
        "device_name": _device_name(torch, device),
        "iterations": len(times),
        "seconds": round(elapsed, 4),
        "samples_per_second": len(times) * args.batch / elapsed,
        "median_iteration_s": statistics.median(times),
        "start_unix": start_unix,
        "end_unix": start_unix + elapsed,
        "setup_s": round(setup_s, 3),
        "peak_memory_mib": _peak_memory_mib(torch, device),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "iteration_times_s": [round(t, 4) for t in times[:MAX_ITERATION_TIMES]],
        "iteration_times_truncated": len(times) > MAX_ITERATION_TIMES,
    }
    _emit(json.dumps(result))
    return 0


def _is_out_of_memory(torch: Any, error: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(error, oom_type)) or "out of memory" in str(error).lower()


def run_sweep_worker(args: argparse.Namespace) -> int:
    """Sweep worker: MODEL alone at each batch size, ``--seconds`` each; one JSON line per batch."""
    torch, device, model, optimizer = _build_training(args.model, args.device, args.cpu_threads)
    for batch in args.sweep_batches:
        point: dict[str, Any] = {"batch": batch}
        try:
            images, labels = _make_batch(torch, device, batch, args.image_size)
            for _ in range(args.warmup):  # cudnn.benchmark tunes again for every new shape
                _train_step(torch, device, model, optimizer, images, labels)
            times, elapsed, _ = _train_for(torch, device, model, optimizer, images, labels, args.seconds)
            point.update(
                iterations=len(times),
                seconds=round(elapsed, 4),
                median_iteration_s=statistics.median(times),
                samples_per_second=len(times) * batch / elapsed,
                peak_memory_mib=_peak_memory_mib(torch, device),
            )
        except Exception as error:  # a failure (an OOM above all) at one batch size must not end the sweep
            point["error"] = "out of memory" if _is_out_of_memory(torch, error) else type(error).__name__
            point["detail"] = (str(error).splitlines() or [type(error).__name__])[0][:300]
            traceback.print_exc()
        finally:
            images = labels = None
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        _emit(json.dumps({"sweep_point": point, "device_name": _device_name(torch, device)}))
    return 0


# ----------------------------------------------------------------------------------------------
# NVML utilisation sampling (parent)


class GpuSampler:
    """Samples one GPU's utilisation (percent) and memory use (MiB) through NVML in a thread.

    ``unavailable`` holds the reason when NVML cannot be used (CPU device, no driver, no pynvml).
    """

    def __init__(self, device_text: str) -> None:
        self.unavailable: str | None = None
        self._handle: Any = None
        self._nvml: Any = None
        if not device_text.startswith("cuda"):
            self.unavailable = f"device is {device_text}"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._device_handle(pynvml, _cuda_index(device_text))
        except Exception as error:  # any NVML problem is recorded, never fatal
            self.unavailable = f"{type(error).__name__}: {error}"

    @staticmethod
    def _device_handle(pynvml: Any, cuda_index: int) -> Any:
        """NVML handle of torch's cuda:INDEX, honouring CUDA_VISIBLE_DEVICES (indices or UUIDs)."""
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if cuda_index < len(visible):
            entry = visible[cuda_index]
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def name(self) -> str | None:
        if self._handle is None:
            return None
        with contextlib.suppress(Exception):
            name = self._nvml.nvmlDeviceGetName(self._handle)
            return name.decode() if isinstance(name, bytes) else str(name)
        return None

    def sample_until(self, stop: threading.Event, window_s: float) -> dict[str, Any]:
        """Sample every NVML_INTERVAL_S until ``stop`` is set or ``window_s`` seconds have passed."""
        if self.unavailable is not None:
            return {"nvml": f"unavailable: {self.unavailable}"}
        utilisation: list[float] = []
        memory_mib: list[float] = []
        errors: list[str] = []
        deadline = time.perf_counter() + window_s
        # Wait first: NVML's figure covers the last sample period, so a sample taken at 'go' would
        # still see the idle GPU of the workers waiting for it.
        while not stop.wait(NVML_INTERVAL_S) and time.perf_counter() <= deadline:
            try:
                utilisation.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
                memory_mib.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
        record: dict[str, Any] = {
            "nvml": "ok",
            "interval_s": NVML_INTERVAL_S,
            "samples": len(utilisation),
            "gpu_percent_mean": round(statistics.fmean(utilisation), 2) if utilisation else None,
            "gpu_percent_min": min(utilisation) if utilisation else None,
            "memory_used_mib_max": round(max(memory_mib), 1) if memory_mib else None,
        }
        if errors:
            record["sample_errors"] = sorted(set(errors))[:5]
        return record

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def _cuda_index(device_text: str) -> int:
    """``cuda`` -> 0, ``cuda:3`` -> 3."""
    _, _, index = device_text.partition(":")
    return int(index) if index else 0


# ----------------------------------------------------------------------------------------------
# Worker processes (parent side)


class WorkerFailed(RuntimeError):
    """A worker crashed, timed out or printed something unexpected; ``reports`` describe the group's workers."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reports: list[dict[str, Any]] = []


@dataclass
class WorkerProcess:
    """A running worker: its process, a queue of its stdout lines (None = EOF), its stderr file."""

    label: str
    proc: subprocess.Popen[bytes]
    lines: queue.Queue[str | None]
    stderr_file: Any
    reader: threading.Thread | None = None
    other_lines: list[str] = field(default_factory=list)
    spawned: float = field(default_factory=time.perf_counter)

    def stderr_tail(self) -> str:
        try:
            self.stderr_file.flush()
            self.stderr_file.seek(0)
            data = self.stderr_file.read()
        except (OSError, ValueError):
            return ""
        return data.decode(errors="replace")[-STDERR_TAIL_CHARS:]

    def next_line(self, deadline: float, waiting_for: str) -> str:
        """The next stdout line, or WorkerFailed on EOF or when ``deadline`` (perf_counter) passes."""
        remaining = deadline - time.perf_counter()
        try:
            line = self.lines.get(timeout=max(0.0, remaining))
        except queue.Empty:
            raise WorkerFailed(f"{self.label}: timed out waiting for {waiting_for}") from None
        if line is None:
            code = self._wait_exit(5.0)
            last = [t for t in self.stderr_tail().splitlines() if t.strip()][-1:]
            detail = f": {last[0].strip()[:300]}" if last else ""
            raise WorkerFailed(f"{self.label}: exited (status {code}) before {waiting_for}{detail}")
        return line

    def wait_for(self, wanted: str, deadline: float) -> None:
        """Read stdout until a line equal to ``wanted``; other lines are kept for the error report."""
        while True:
            line = self.next_line(deadline, repr(wanted))
            if line == wanted:
                return
            self.other_lines.append(line)

    def read_json(self, deadline: float, key: str | None = None) -> dict[str, Any]:
        """Read stdout until a JSON object line (with ``key`` when given); WorkerFailed if malformed."""
        while True:
            line = self.next_line(deadline, "its JSON line")
            if not line.startswith("{"):
                self.other_lines.append(line)
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise WorkerFailed(f"{self.label}: malformed JSON line ({error}): {line[:200]!r}") from None
            if not isinstance(value, dict) or (key is not None and key not in value):
                raise WorkerFailed(f"{self.label}: unexpected JSON line: {line[:200]!r}")
            return value

    def _wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def finish(self, timeout: float) -> None:
        """Wait for a clean exit; WorkerFailed on a non-zero status or when it does not exit."""
        code = self._wait_exit(timeout)
        if code is None:
            raise WorkerFailed(f"{self.label}: did not exit within {timeout:.0f} s after its result")
        if code != 0:
            raise WorkerFailed(f"{self.label}: exited with status {code}")

    def kill(self) -> None:
        """Kill the process if it still runs, reap it, close its pipes and stderr file."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        self._wait_exit(10.0)
        if self.reader is not None:
            self.reader.join(timeout=2.0)  # EOF follows the exit; then its stdout can be closed safely
        streams = [self.proc.stdin] + ([self.proc.stdout] if self.reader is None or not self.reader.is_alive() else [])
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()

    def report(self) -> dict[str, Any]:
        return {
            "worker": self.label,
            "returncode": self.proc.poll(),
            "stdout_other": self.other_lines[-10:],
            "stderr_tail": self.stderr_tail(),
        }


def _pump_lines(stream: Any, lines: queue.Queue[str | None]) -> None:
    """Reader thread: every stdout line of a worker into ``lines``, then None at EOF."""
    try:
        for raw in iter(stream.readline, b""):
            lines.put(raw.decode(errors="replace").rstrip("\r\n"))
    except (OSError, ValueError):
        pass
    finally:
        lines.put(None)


def spawn_worker(label: str, worker_args: Sequence[str]) -> WorkerProcess:
    """Start ``python -m benchmarks.colocation --worker ...`` in the repository root."""
    stderr_file = tempfile.TemporaryFile()
    command = [sys.executable, "-m", MODULE, "--worker", *worker_args]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file)
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    return WorkerProcess(label=label, proc=proc, lines=lines, stderr_file=stderr_file, reader=reader)


def _common_worker_args(args: argparse.Namespace, seconds: float) -> list[str]:
    return [
        "--device",
        args.device,
        "--image-size",
        str(args.image_size),
        "--seconds",
        repr(seconds),
        "--warmup",
        str(args.warmup),
        "--cpu-threads",
        str(args.cpu_threads),
    ]


# ----------------------------------------------------------------------------------------------
# Group mode


def run_group(
    members: Sequence[Member], args: argparse.Namespace, sampler: GpuSampler
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Run one group; returns (worker results in member order, utilisation, timing).

    Raises WorkerFailed (after killing every worker of the group) when any worker fails.
    """
    workers: list[WorkerProcess] = []
    group_started = time.perf_counter()
    try:
        for index, member in enumerate(members):
            extra = ["--model", member.model, "--batch", str(member.batch)]
            workers.append(spawn_worker(f"{member.label}#{index}", [*extra, *_common_worker_args(args, args.seconds)]))
        ready_deadline = time.perf_counter() + args.timeout
        for worker in workers:
            worker.wait_for("ready", ready_deadline)
        ready_after_s = [round(time.perf_counter() - w.spawned, 2) for w in workers]
        stop = threading.Event()
        utilisation: dict[str, Any] = {}
        sampler_thread = threading.Thread(
            target=lambda: utilisation.update(sampler.sample_until(stop, args.seconds)), daemon=True
        )
        go_at = time.perf_counter()
        for worker in workers:  # as close together as possible: one os.write() each, no Python buffering
            os.write(worker.proc.stdin.fileno(), b"go\n")
        go_spread_s = time.perf_counter() - go_at
        sampler_thread.start()
        try:
            result_deadline = go_at + args.seconds + args.timeout
            results = [worker.read_json(result_deadline, key="samples_per_second") for worker in workers]
        finally:
            stop.set()
            sampler_thread.join(timeout=5.0)
        for worker in workers:
            worker.finish(EXIT_GRACE_S)
        timing = {
            "ready_after_s": ready_after_s,
            "go_spread_s": round(go_spread_s, 6),
            "wall_s": round(time.perf_counter() - group_started, 2),
            **_overlap(results),
        }
        return results, utilisation, timing
    except WorkerFailed as error:
        for worker in workers:  # killed and reaped first, so the reports hold the final status and stderr
            worker.kill()
        error.reports = [w.report() for w in workers]
        raise
    finally:
        for worker in workers:
            worker.kill()
            with contextlib.suppress(OSError):
                worker.stderr_file.close()


def _overlap(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Seconds during which all workers trained at once, and that over the longest window."""
    starts = [r["start_unix"] for r in results]
    ends = [r["end_unix"] for r in results]
    overlap = min(ends) - max(starts)
    longest = max(e - s for s, e in zip(starts, ends))
    return {
        "overlap_s": round(overlap, 4),
        "overlap_fraction": round(overlap / longest, 4) if longest > 0 else None,
        "start_spread_s": round(max(starts) - min(starts), 4),
    }


def solo_table(groups: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(model, batch) -> worker result of the first successful single-member group of that job."""
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for group in groups:
        if len(group["results"]) == 1:
            result = group["results"][0]
            table.setdefault((result["model"], result["batch"]), result)
    return table


def compute_speeds(groups: list[dict[str, Any]]) -> None:
    """Fill ``speeds`` and ``sum_of_speeds`` of every multi-member group, in place.

    speed = co-located samples/s / solo samples/s (dimensionless); also ``speed_from_median``,
    the solo median iteration time over the co-located one. Without a solo: speed null, and a note.
    """
    solos = solo_table(groups)
    for group in groups:
        if len(group["results"]) < 2:
            group["speeds"] = []
            group["sum_of_speeds"] = None
            continue
        speeds: list[dict[str, Any]] = []
        for result in group["results"]:
            solo = solos.get((result["model"], result["batch"]))
            entry: dict[str, Any] = {"model": result["model"], "batch": result["batch"]}
            if solo is None:
                note = "no solo group of this model and batch in this run"
                entry.update(speed=None, speed_from_median=None, note=note)
            else:
                entry["speed"] = _ratio(result["samples_per_second"], solo["samples_per_second"])
                entry["speed_from_median"] = _ratio(solo["median_iteration_s"], result["median_iteration_s"])
            speeds.append(entry)
        group["speeds"] = speeds
        values = [s["speed"] for s in speeds]
        group["sum_of_speeds"] = sum(values) if all(v is not None for v in values) else None


def _ratio(numerator: float, denominator: float) -> float | None:
    value = numerator / denominator if denominator > 0 else math.nan
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------------------------------
# Sweep mode


def run_sweep(model: str, batches: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """One worker trains MODEL alone at each batch size; points so far survive a failure."""
    record: dict[str, Any] = {"model": model, "batches": list(batches), "seconds": args.sweep_seconds, "points": []}
    worker_args = ["--model", model, "--batch", str(batches[0]), "--sweep-batches", ",".join(map(str, batches))]
    worker = spawn_worker(f"sweep {model}", [*worker_args, *_common_worker_args(args, args.sweep_seconds)])
    try:
        for _ in batches:  # a fresh deadline per point: startup + warm-up + window + slack
            line = worker.read_json(time.perf_counter() + args.sweep_seconds + args.timeout, key="sweep_point")
            record["points"].append(line["sweep_point"])
            record["device_name"] = line.get("device_name")
        worker.finish(EXIT_GRACE_S)
    except WorkerFailed as error:
        worker.kill()
        record["error"] = str(error)
        record["worker"] = worker.report()
    finally:
        worker.kill()
        with contextlib.suppress(OSError):
            worker.stderr_file.close()
    try:
        record["fit"] = fit_linear(record["points"])
    except Exception as error:  # the points matter more than the fit
        record["fit"] = {"error": f"{type(error).__name__}: {error}"}
    return record


def fit_linear(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Least-squares ``median_iteration_s = fixed_s + per_sample_s * batch`` over the measured points.

    Also: r2, the largest relative residual, and the fixed share of a 12-image iteration (the
    figure docs/calibration.md assumes: 0.542). None with fewer than two distinct batch sizes.
    """
    good = [p for p in points if "median_iteration_s" in p]
    if len({p["batch"] for p in good}) < 2:
        return None
    try:
        import numpy as np
    except ImportError as error:
        return {"error": f"numpy unavailable: {error}"}
    batch = np.array([p["batch"] for p in good], dtype=float)
    seconds = np.array([p["median_iteration_s"] for p in good], dtype=float)
    design = np.stack([np.ones_like(batch), batch], axis=1)
    (fixed_s, per_sample_s), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = fixed_s + per_sample_s * batch
    total = float(((seconds - seconds.mean()) ** 2).sum())
    r2 = 1.0 - float(((seconds - predicted) ** 2).sum()) / total if total > 0 else None
    at12 = fixed_s + 12 * per_sample_s
    return {
        "fixed_s": float(fixed_s),
        "per_sample_s": float(per_sample_s),
        "points": len(good),
        "r2": r2,
        "max_relative_residual": float(np.max(np.abs(seconds - predicted) / seconds)),
        "fixed_share_at_12": float(fixed_s / at12) if at12 > 0 else None,
    }


# ----------------------------------------------------------------------------------------------
# Output


def _finite(value: Any) -> Any:
    """A copy with every non-finite float replaced by None (the JSON never holds NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` through a temporary file in the same folder and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(record), indent=1, allow_nan=False) + "\n"
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def print_table(record: dict[str, Any], stream: TextIO = sys.stdout) -> None:
    """Human-readable summary: each group's samples/s and speeds, the sweep and its fit."""
    sweep = record.get("sweep")
    if sweep:
        print(f"\nsweep {sweep['model']} ({sweep['seconds']} s per batch)", file=stream)
        for point in sweep["points"]:
            if "median_iteration_s" in point:
                print(
                    f"  batch {point['batch']:>5}: median {1000 * point['median_iteration_s']:9.2f} ms,"
                    f" {point['samples_per_second']:9.1f} samples/s",
                    file=stream,
                )
            else:
                print(f"  batch {point['batch']:>5}: {point.get('error')}", file=stream)
        fit = sweep.get("fit")
        if fit and "fixed_s" in fit:
            print(
                f"  fit: {1000 * fit['fixed_s']:.2f} ms + {1000 * fit['per_sample_s']:.3f} ms/sample"
                f" (r2 {_fmt(fit['r2'], '.4f')}, fixed share at 12 images {_fmt(fit['fixed_share_at_12'], '.3f')})",
                file=stream,
            )
        if sweep.get("error"):
            print(f"  error: {sweep['error']}", file=stream)
    if record["groups"]:
        print(f"\n{'group':<44} {'samples/s each':<30} {'speeds':<22} {'sum':>6} {'util%':>6}", file=stream)
    for group in record["groups"]:
        rates = " ".join(f"{r['samples_per_second']:.1f}" for r in group["results"])
        speeds = " ".join(_fmt(s["speed"], ".3f") for s in group["speeds"]) or "-"
        util = group["utilisation"].get("gpu_percent_mean")
        print(
            f"{group['label']:<44} {rates:<30} {speeds:<22} {_fmt(group['sum_of_speeds'], '.3f'):>6}"
            f" {_fmt(util, '.1f'):>6}",
            file=stream,
        )
    for error in record["errors"]:
        print(f"ERROR {error.get('group', '')}: {error['error']}", file=stream)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ----------------------------------------------------------------------------------------------
# Parent driver


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_parent(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Sweep (if asked), then every group; the JSON is rewritten after each step."""
    started = time.perf_counter()
    json_path = Path(args.json)
    sampler = GpuSampler(args.device)
    record: dict[str, Any] = {
        "command": [sys.executable, "-m", MODULE, *argv],
        "device": sampler.name() or ("cpu" if args.device == "cpu" else args.device),
        "torch": package_version("torch"),
        "torchvision": package_version("torchvision"),
        "python": sys.version.split()[0],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": args.seconds,
        "image_size": args.image_size,
        "batch": args.batch,
        "warmup_iterations": args.warmup,
        "groups": [],
        "errors": [],
    }
    write_json_atomic(json_path, record)
    previous_handler = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    current = "start"
    try:
        if args.sweep:
            current = f"sweep {args.sweep}"
            _guarded(current, record, lambda: _sweep_step(args, record))
            write_json_atomic(json_path, record)
        for members in args.parsed_groups:
            current = group_label(members)
            if args.budget is not None and time.perf_counter() - started >= args.budget:
                record["errors"].append({"group": current, "error": f"skipped: --budget {args.budget} s spent"})
            else:
                _guarded(current, record, lambda members=members: _group_step(members, args, sampler, record))
            _guarded("speeds", record, lambda: compute_speeds(record["groups"]))
            write_json_atomic(json_path, record)
    except (KeyboardInterrupt, SystemExit) as stop:
        record["errors"].append({"group": current, "error": f"interrupted ({type(stop).__name__} {stop})"})
        compute_speeds(record["groups"])
        write_json_atomic(json_path, record)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        sampler.close()
    record["wall_s"] = round(time.perf_counter() - started, 1)
    write_json_atomic(json_path, record)
    _guarded("table", {"errors": []}, lambda: print_table(record))
    print(f"\nwrote {json_path} ({record['wall_s']} s)")
    return 1 if record["errors"] else 0


def _guarded(label: str, record: dict[str, Any], step: Callable[[], None]) -> None:
    """Run one step; a bug in the parent's own code becomes an error entry, not the end of the run."""
    try:
        step()
    except Exception as error:
        print(f"{label}: INTERNAL ERROR: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        record["errors"].append(
            {"group": label, "error": f"internal: {type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        )


def _sweep_step(args: argparse.Namespace, record: dict[str, Any]) -> None:
    print(f"sweep {args.sweep} at batches {args.batches}", flush=True)
    record["sweep"] = run_sweep(args.sweep, args.batches, args)
    _adopt_device_name(record, record["sweep"].get("device_name"))
    if record["sweep"].get("error"):
        record["errors"].append({"group": f"sweep {args.sweep}", "error": record["sweep"]["error"]})
    for point in record["sweep"]["points"]:  # an out-of-memory batch size is a result; anything else is an error
        if "error" in point and point["error"] != "out of memory":
            message = f"batch {point['batch']}: {point['error']}: {point.get('detail', '')}"
            record["errors"].append({"group": f"sweep {args.sweep}", "error": message})


def _group_step(
    members: Sequence[Member], args: argparse.Namespace, sampler: GpuSampler, record: dict[str, Any]
) -> None:
    label = group_label(members)
    print(f"group {label} ...", flush=True)
    try:
        results, utilisation, timing = run_group(members, args, sampler)
    except WorkerFailed as error:
        print(f"group {label}: FAILED: {error}", file=sys.stderr, flush=True)
        record["errors"].append(
            {
                "group": label,
                "members": [m.label for m in members],
                "error": str(error),
                "workers": error.reports,
            }
        )
        return
    _adopt_device_name(record, results[0].get("device_name"))
    record["groups"].append(
        {
            "label": label,
            "members": [m.label for m in members],
            "results": results,
            "utilisation": utilisation,
            "timing": timing,
            "speeds": [],
            "sum_of_speeds": None,
        }
    )


def _adopt_device_name(record: dict[str, Any], name: str | None) -> None:
    """Prefer torch.cuda.get_device_name as the workers saw it over NVML's name."""
    if name:
        record["device"] = name


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.colocation",
        description=(
            "Measure how training jobs slow each other down when they share one GPU: each group's\n"
            "members train at once for --seconds, and each member's speed is its samples/s over the\n"
            "same job's samples/s alone (a single-member group of the same run). Optionally a\n"
            "batch-size sweep of one model alone, fitted as fixed_s + per_sample_s * batch."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  python -m benchmarks.colocation --device cuda:0 --seconds 5 --batch 64 \\\n"
            '    --groups "resnet50 alexnet resnet50+resnet50 resnet50+alexnet@32" --sweep resnet50 \\\n'
            "    --batches 16,32,64,128,256 --json colocation.json\n"
            "exit status: 0 all ran, 1 some group or the sweep failed (see 'errors' in the JSON), 2 bad arguments"
        ),
    )
    parser.add_argument("--device", default="cuda:0", help="torch device for every job: cuda:N or cpu (default cuda:0)")
    parser.add_argument(
        "--groups",
        action="append",
        default=[],
        metavar="GROUPS",
        help=(
            "groups to run, in order: separated by spaces (or repeat --groups), members joined by '+',"
            ' a member may set its own batch as MODEL@BATCH; e.g. "resnet50 alexnet resnet50+alexnet@32".'
            " Models are torchvision classification builders (torchvision.models.NAME(weights=None))."
            " Put the solo groups you need for the speeds in the list (first is best)."
        ),
    )
    parser.add_argument(
        "--batch", type=positive_int, default=64, help="images per iteration of a member without @BATCH (default 64)"
    )
    parser.add_argument(
        "--image-size", type=positive_int, default=224, help="side of the square synthetic images, pixels (default 224)"
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=5.0, help="wall-clock seconds each job trains after 'go' (default 5)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="iterations before 'ready' (and per sweep batch), not timed (default 5)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help=(
            "seconds a group's workers may take to start, build and warm up; also the slack after the"
            " --seconds window for their results, and per sweep point (default 120)"
        ),
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=None,
        help="seconds for the whole run: groups not started by then are skipped and listed in 'errors' (default: none)",
    )
    parser.add_argument(
        "--json", help="path of the JSON result, rewritten after the sweep and after every group (required)"
    )
    parser.add_argument(
        "--sweep", metavar="MODEL", help="also time MODEL alone at each of --batches (runs before the groups)"
    )
    parser.add_argument(
        "--batches",
        type=batch_list,
        default=[16, 32, 64, 128, 256],
        help="sweep batch sizes, comma-separated (default 16,32,64,128,256)",
    )
    parser.add_argument(
        "--sweep-seconds", type=positive_float, default=None, help="seconds per sweep batch size (default: --seconds)"
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch.set_num_threads in each worker; 0 leaves torch's default (default 0)",
    )
    worker = parser.add_argument_group("worker mode (started by the parent; not for direct use)")
    worker.add_argument(
        "--worker", action="store_true", help="run one job: build, warm up, 'ready', wait for 'go', train, JSON"
    )
    worker.add_argument("--model", help="worker: torchvision model name")
    worker.add_argument("--sweep-batches", type=batch_list, help="worker: run the sweep at these batch sizes instead")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) for inconsistent options; fills ``args.parsed_groups``."""
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.cpu_threads < 0:
        parser.error("--cpu-threads must be >= 0")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        parser.error(f"--device must be cpu, cuda or cuda:N; got {args.device!r}")
    if args.device.startswith("cuda:") and not args.device[5:].isdigit():
        parser.error(f"--device must be cpu, cuda or cuda:N; got {args.device!r}")
    if args.device == "cuda":
        args.device = "cuda:0"  # torch.cuda.set_device needs an index
    if args.sweep_seconds is None:
        args.sweep_seconds = args.seconds
    if args.worker:
        if not args.model:
            parser.error("--worker needs --model")
        return
    try:
        args.parsed_groups = parse_groups(args.groups, args.batch)
    except GroupSyntaxError as error:
        parser.error(f"--groups: {error}")
    if any(entry.strip() == "" for entry in args.groups):
        parser.error("--groups: empty group list")
    if not args.parsed_groups and not args.sweep:
        parser.error("nothing to run: give --groups and/or --sweep MODEL")
    if not args.json:
        parser.error("--json PATH is required")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.worker:
        return run_sweep_worker(args) if args.sweep_batches else run_worker(args)
    return run_parent(args, argv)


if __name__ == "__main__":
    sys.exit(main())
