"""Model vs measurement for everything ../shared/data covers; fits the co-location capacity.

    python -m drbalance.sim.calibration [--gavel PATH/gavel_throughputs.json] [--fit] [--fit-gavel]

Compares: (1) DataParallel on 2 and 4 TITAN RTX GPUs (12 images per GPU) against the model's
1-GPU time plus its per-replica overhead; (2) Pollux's ResNet-50 batch-20 / batch-200 time ratio
against the linear device-time model; (3) the speed each of two identical jobs keeps when they
share one GPU, simulated, against Gavel's measured median (recomputed from the JSON when given).
The co-location capacity is fitted to (3) by bisection.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from pathlib import Path

from drbalance.argtypes import non_empty_path
from drbalance.sim.engine import SimConfig, simulate
from drbalance.sim.model import ContentionModel
from drbalance.workload.models import CO_LOCATED_SPEED, FIXED_FRACTION_AT_12, MODEL_COSTS, model_costs
from drbalance.workload.scenarios import AppSpec, Scenario

TITAN_RTX_MS = {  # ryujaehun/pytorch-gpu-benchmark, TITAN RTX, 12 images per GPU: 1, 2, 4 GPUs
    "densenet121": (103.4, 182.5, 276.6),
    "resnet50": (64.9, 103.3, 138.6),
    "resnext50_32x4d": (94.0, 123.1, 154.8),
    "shufflenet_v2_x1_0": (39.6, 82.5, 126.4),
    "mnasnet1_0": (38.5, 77.3, 114.2),
}
POLLUX_RESNET50 = (20, 0.147, 200, 0.924)  # batch, seconds, batch, seconds (g4dn, one GPU)


def gavel_median_pair_speed(path: Path) -> tuple[float, int]:
    """Median share of solo throughput that each of two co-located single-GPU jobs keeps (v100)."""
    data = json.loads(path.read_text())["v100"]
    shares = []
    for outer, row in data.items():
        if ast.literal_eval(outer)[1] != 1:
            continue
        solo_outer = row.get("null")
        for inner, pair in row.items():
            if inner == "null" or not isinstance(pair, list) or ast.literal_eval(inner)[1] != 1:
                continue
            solo_inner = data.get(inner, {}).get("null")
            if not solo_outer or not solo_inner or pair == [0.0, 0.0]:
                continue
            shares.append(pair[0] / solo_outer)
    return statistics.median(shares), len(shares)


def simulated_pair_speed(model: str, capacity: float, batch: int = 32, iterations: int = 400) -> float:
    """Speed each of two identical jobs keeps on one shared GPU, as a share of its solo speed."""
    apps = tuple(AppSpec(f"j{i}", model, batch, 1, iterations, (10,)) for i in range(2))
    scenario = Scenario("pair", 1, apps)
    result = simulate(scenario, SimConfig(policy="observe", record=False, contention=ContentionModel(capacity)))
    return 1.0 / max(result.final_sd.values())


def fit_capacity(target: float, model: str = "resnet50") -> float:
    low, high = 1.0, 2.0
    if simulated_pair_speed(model, low) >= target:
        return low
    for _ in range(30):
        middle = (low + high) / 2
        if simulated_pair_speed(model, middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


GAVEL_BATCHES = (16, 32, 64, 128)


def write_gavel_rates(path: Path | None = None) -> Path:
    """Fit every pair of (model, batch) workloads of ``MODEL_COSTS`` x ``GAVEL_BATCHES`` and
    store the rates with the shares they reproduce."""
    from drbalance.sim.interference import RATES, GavelTable, fit_pair, measured_shares

    table = GavelTable.load()
    workloads = [(model, batch) for model in MODEL_COSTS for batch in GAVEL_BATCHES]
    pairs = []
    for index, first in enumerate(workloads):
        for second in workloads[index:]:
            rates = fit_pair(table, first, second)
            pairs.append({"first": list(first), "second": list(second), "rates": list(rates),
                          "gavel_shares": list(measured_shares(table, first, second))})
    target = path or RATES
    target.write_text(json.dumps({"what": "service rates of co-active chunks fitted so that each simulated pair "
                                  "keeps Gavel's measured speed shares (drbalance/sim/interference.py)",
                                  "pairs": pairs}, indent=0))
    return target


def rows(gavel: Path | None) -> list[tuple[str, str, str, str]]:
    table = []
    for model, (_t1, t2, t4) in TITAN_RTX_MS.items():
        costs = MODEL_COSTS[model]
        device12 = costs.device_seconds(12) * 1000
        for gpus, measured in ((2, t2), (4, t4)):
            modelled = device12 + costs.overhead_seconds(gpus) * 1000
            table.append((f"{model}, {gpus} GPUs x 12 img (ms)", f"{measured:.1f}", f"{modelled:.1f}",
                          f"{100 * (modelled - measured) / measured:+.1f}%"))
    b1, s1, b2, s2 = POLLUX_RESNET50
    resnet = model_costs("resnet50")
    modelled_ratio = resnet.device_seconds(b2) / resnet.device_seconds(b1)
    table.append(("resnet50 t(200)/t(20) (Pollux)", f"{s2 / s1:.2f}", f"{modelled_ratio:.2f}",
                  f"{100 * (modelled_ratio - s2 / s1) / (s2 / s1):+.1f}%"))
    measured_pair = CO_LOCATED_SPEED
    label = "co-located pair speed (Gavel README median)"
    if gavel is not None and gavel.exists():
        measured_pair, count = gavel_median_pair_speed(gavel)
        label = f"co-located pair speed (Gavel v100, median of {count})"
    capacity = ContentionModel().co_location_capacity
    for model in ("resnet50", "densenet121", "alexnet"):
        speed = simulated_pair_speed(model, capacity)
        table.append((f"{label}: {model}", f"{measured_pair:.3f}", f"{speed:.3f}",
                      f"{100 * (speed - measured_pair) / measured_pair:+.1f}%"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gavel", type=non_empty_path, default=None,
                        help="gavel_throughputs.json, to recompute its median")
    parser.add_argument("--fit", action="store_true", help="also fit the co-location capacity to the pair speed")
    parser.add_argument("--fit-gavel", action="store_true",
                        help="refit the gavel interference model's pair rates for our models at batch 16-128 and "
                        "rewrite drbalance/sim/gavel_rates.json")
    args = parser.parse_args(argv)
    if args.gavel is not None and not args.gavel.is_file():
        parser.error(f"--gavel: no file {args.gavel} (Gavel's throughputs.json, not shipped with drbalance: "
                     "the pairs it needs are in drbalance/sim/gavel_pairs.json)")
    if args.fit_gavel:
        path = write_gavel_rates()
        print(f"wrote {path}")
        return 0
    print(f"fixed share of the 12-image time (from Pollux): {FIXED_FRACTION_AT_12:.3f}")
    print("| quantity | measured | model | error |\n|---|---|---|---|")
    for row in rows(args.gavel):
        print("| " + " | ".join(row) + " |")
    if args.fit:
        target = gavel_median_pair_speed(args.gavel)[0] if args.gavel else CO_LOCATED_SPEED
        print(f"\nfitted co-location capacity for a pair speed of {target:.3f}: {fit_capacity(target):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
