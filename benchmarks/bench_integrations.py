"""Per-step overhead of the Lightning and Accelerate integrations against the frameworks' plain DDP.

Two ranks under torchrun (gloo on the CPU, one torch thread each) train the same model on the
same data with equal shares, drbalance's candidate beside the framework's plain one, in turns
whose order alternates (the same on every rank); no manager runs (``DRBALANCE_NO_MANAGER=1``):

- Lightning: ``Trainer(strategy="ddp")`` against ``Trainer(strategy="drbalance")`` (the strategy,
  its balanced loader and its session, which opens with each fit). A fit cannot be interleaved
  step by step with another, so they take turns by fit: ``rounds`` fits of each, of ``warmup +
  steps`` optimizer steps; a step's time is rank 0's time from one ``on_train_batch_end`` to the
  next (Lightning's loop, loading, forward, backward, optimizer step); per fit, the median step
  after the warm-up ones; one ratio per round (drbalance's fit over plain's).
- Accelerate: ``Accelerator`` against ``BalancedAccelerator`` (its DDP model, its loader shard
  and the session), both prepared side by side and stepped in turn, ``rounds x steps`` timed
  step pairs after ``warmup``; a step's time is rank 0's (next batch, forward, backward,
  optimizer step); one ratio per step pair.

Two measures of a step on rank 0: wall-clock seconds, and the rank's CPU seconds (all its
threads: ``process_time``), which the other processes of a loaded machine disturb less. Reported
per measure: the median of the paired ratios and their quartiles (drift of the machine's load
cancels within a pair), and the ratio of the medians. Results in
benchmarks/results/integrations_overhead_<model>_cpu.json; the ratios are quoted in docs/benchmarks.md.

Usage: python -m benchmarks.bench_integrations [--framework lightning|accelerate|both] [--model mlp|resnet18]
       [--batch 16] [--image 32] [--rounds 24] [--steps 20] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.bench_parallel import build, make_batch
from benchmarks.timing import add_no_write, percentile, save, summary
from drbalance.argtypes import non_negative_int, positive_int

FRAMEWORKS = ("lightning", "accelerate")


def dataset(args: argparse.Namespace, batches: int) -> TensorDataset:
    """``batches`` global batches of ``batch`` samples per rank x 2 ranks, made once (seed 0)."""
    torch.manual_seed(0)
    x, y = make_batch(args.model, args.batch * 2 * batches, args.image, "cpu")
    return TensorDataset(x, y)


MEASURES = ("wall", "cpu")
"""A step's seconds on rank 0: wall-clock (``perf_counter``), and the rank's CPU time, all its threads
(``process_time``), which other processes on a loaded machine disturb less."""


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def step_medians(stamps: list[tuple[float, float]], warmup: int) -> dict[str, float]:
    """Per measure, the median step after the first ``warmup`` steps (``stamps``: :func:`now` at each step's end)."""
    return {measure: statistics.median([later[index] - earlier[index] for earlier, later
                                        in zip(stamps, stamps[1:])][max(0, warmup - 1):])
            for index, measure in enumerate(MEASURES)}


def lightning_rounds(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Each candidate's median step per fit, ``rounds`` fits each (see :func:`alternating_rounds`)."""
    import lightning.pytorch as pl

    import drbalance.integrations.lightning  # noqa: F401  (registers "drbalance")

    data = dataset(args, args.warmup + args.steps)

    class Timed(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build(args.model)
            self.stamps: list[tuple[float, float]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return functional.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.stamps.append(now())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(strategy: str) -> dict[str, float]:
        torch.manual_seed(0)
        module = Timed()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(data, batch_size=args.batch, shuffle=True))
        return step_medians(module.stamps, args.warmup)

    return alternating_rounds({"plain": lambda: fit("ddp"), "drbalance": lambda: fit("drbalance")}, args.rounds)


def accelerate_steps(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Both candidates prepared side by side, stepped in turn (the order alternating from step to
    step), ``rounds x steps`` timed steps each after the warm-up ones; each candidate's step times."""
    from accelerate import Accelerator

    from drbalance.integrations.accelerate import BalancedAccelerator

    def prepared(accelerator: Accelerator) -> Callable[[], None]:
        torch.manual_seed(0)
        net = build(args.model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        model, optimizer, loader = accelerator.prepare(net, optimizer,
                                                       DataLoader(data, batch_size=args.batch, shuffle=True))
        batches = iter(loader)

        def step() -> None:
            x, y = next(batches)
            accelerator.backward(functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

        return step

    timed = args.rounds * args.steps
    data = dataset(args, args.warmup + timed)
    candidates = {"plain": prepared(Accelerator(cpu=True)),
                  "drbalance": prepared(BalancedAccelerator(epochs=1, cpu=True, app="bench-accelerate"))}
    found: dict[str, dict[str, list[float]]] = {name: {measure: [] for measure in MEASURES} for name in candidates}
    names = list(candidates)
    for index in range(args.warmup + timed):
        for name in names if index % 2 == 0 else names[::-1]:
            started = now()
            candidates[name]()
            ended = now()
            if index >= args.warmup:
                for position, measure in enumerate(MEASURES):
                    found[name][measure].append(ended[position] - started[position])
    return found


def alternating_rounds(candidates: dict[str, Callable[[], dict[str, float]]],
                       rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each candidate's medians per round; odd rounds run them in reverse order (all ranks alike)."""
    found: dict[str, dict[str, list[float]]] = {name: {measure: [] for measure in MEASURES} for name in candidates}
    names = list(candidates)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            for measure, seconds in candidates[name]().items():
                found[name][measure].append(seconds)
    return found


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): time the framework's rounds, rank 0 writes them to ``--out``."""
    torch.set_num_threads(1)
    rounds = lightning_rounds(args) if args.worker == "lightning" else accelerate_steps(args)
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(rounds))


def ratios(found: dict[str, dict[str, list[float]]]) -> dict:
    """Per measure: paired ratios (drbalance over plain, per round or per step pair), their median
    and quartiles, and the ratio of the medians."""
    return {measure: measure_ratios({name: times[measure] for name, times in found.items()}) for measure in MEASURES}


def measure_ratios(rounds: dict[str, list[float]]) -> dict:
    per_round = [ours / plain for ours, plain in zip(rounds["drbalance"], rounds["plain"])]
    return {
        "step_seconds": {name: summary(values) for name, values in rounds.items()},
        "paired_ratios": per_round,
        "paired_median_ratio": statistics.median(per_round),
        "paired_ratio_quartiles": [percentile(per_round, 0.25), percentile(per_round, 0.75)],
        "median_ratio": statistics.median(rounds["drbalance"]) / statistics.median(rounds["plain"]),
    }


def run_framework(framework: str, args: argparse.Namespace, folder: str) -> dict:
    """Run ``framework``'s rounds on 2 ranks under torchrun; their ratios."""
    out = Path(folder, f"{framework}.json")
    env = {**os.environ, "DRBALANCE_NO_MANAGER": "1", "DRBALANCE_LOG_DIR": folder,
           "DRBALANCE_NAMESPACE": f"bench{os.getpid()}", "DRBALANCE_RUNTIME_DIR": str(Path(folder, "run"))}
    sizes = [f"--{name}={getattr(args, name)}" for name in ("model", "batch", "image", "rounds", "steps", "warmup")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--log-dir", str(Path(folder, "torchrun")), "-m", "benchmarks.bench_integrations", *sizes,
               "--worker", framework, "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {framework} ranks failed (status {done.returncode}):\n{done.stderr[-4000:]}")
    return ratios(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=(*FRAMEWORKS, "both"), default="both")
    parser.add_argument("--model", default="mlp", help="'mlp' (default) or a torchvision model name (resnet18)")
    parser.add_argument("--batch", type=positive_int, default=16, help="samples per rank and step (default 16)")
    parser.add_argument("--image", type=positive_int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--rounds", type=positive_int, default=24, help="Lightning: fits of each candidate "
                        "(default 24)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per fit (Lightning; Accelerate "
                        "times rounds x steps step pairs) (default 20)")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    add_no_write(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    payload: dict = {"args": vars(args), "backend": "gloo (CPU), 2 ranks under torchrun"}
    with tempfile.TemporaryDirectory(prefix="drbalance-bench-integrations-") as folder:
        for framework in FRAMEWORKS if args.framework == "both" else (args.framework,):
            payload[framework] = run_framework(framework, args, folder)
            for measure, found in payload[framework].items():
                plain = found["step_seconds"]["plain"]["median"]
                low, high = found["paired_ratio_quartiles"]
                print(f"{framework}, {args.model}, batch {args.batch} per rank, {measure} time: plain median step "
                      f"{plain * 1000:.2f} ms; drbalance / plain = {found['paired_median_ratio']:.4f} (median of "
                      f"{len(found['paired_ratios'])} paired ratios, quartiles {low:.3f}-{high:.3f}); ratio of "
                      f"medians {found['median_ratio']:.4f}")
    save(f"integrations_overhead_{args.model}_cpu", "benchmarks.bench_integrations", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
