"""Two policies of the same random-mix sweeps compared run by run: misses, final max SD, churn.

    python -m benchmarks.compare_policies HELDOUT.json WIDE.json --policies fair,f-sched --margin 0.02

Each file is what ``python -m benchmarks.random_mixes --policies A,B --json PATH`` writes (both
policies and ``observe`` in one sweep). Per file and interference model, then pooled: the runs
each policy ends *worse* than ``observe`` of the same seed (final max SD or mean SD above it by
more than ``--margin``), the runs one policy misses and the other does not, the median final max
SD, and the churn: DR changes per app per hour of its run, median and 90th percentile over every
app of every run. ``--json`` also writes the table's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

from benchmarks.timing import percentile


def load(path: str) -> tuple[dict, dict]:
    """(observe's runs, every other run), keyed by (seed, interference, noise) and (..., policy)."""
    try:
        with open(path, encoding="utf-8") as source:
            data = json.load(source)
        bases = {(r["seed"], r["interference"], r.get("noise", 0)): r for r in data["observe"]}
        runs = {(r["seed"], r["interference"], r.get("noise", 0), r["policy"]): r for r in data["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"compare_policies: {path} is not a random_mixes --json file: {error}") from None
    return bases, runs


def worse(run: dict, base: dict, margin: float) -> bool:
    return run["max_sd"] > base["max_sd"] + margin or run["mean_sd"] > base["mean_sd"] + margin


def compare(bases: dict, runs: dict, policies: Sequence[str], margin: float, model: str | None) -> dict:
    """The numbers of the module docstring for the runs of ``model`` (None: every model)."""
    first, second = policies
    keys = [key for key in bases if model is None or key[1] == model]
    missing = [key for key in keys for policy in policies if (*key, policy) not in runs]
    if missing:
        raise SystemExit(f"compare_policies: no {missing[0]} run in the file (sweep with --policies "
                         f"{','.join(policies)})")
    row: dict = {"runs": len(keys)}
    misses = {policy: {key for key in keys if worse(runs[(*key, policy)], bases[key], margin)} for policy in policies}
    for policy in policies:
        found = [runs[(*key, policy)] for key in keys]
        churn = [value for run in found for value in run.get("churn", [])]
        row[policy] = {"worse": len(misses[policy]), "median_max_sd": statistics.median(r["max_sd"] for r in found),
                       "churn_median": statistics.median(churn) if churn else None,
                       "churn_p90": percentile(churn, 0.9) if churn else None}
    row[f"worse_{first}_only"] = len(misses[first] - misses[second])
    row[f"worse_{second}_only"] = len(misses[second] - misses[first])
    return row


def _line(label: str, row: dict, policies: Sequence[str]) -> str:
    cells = []
    for policy in policies:
        found = row[policy]
        churn = ("-" if found["churn_median"] is None else
                 f"{found['churn_median']:.1f} / {found['churn_p90']:.1f}")
        cells.append(f"{policy}: worse {found['worse']:3d}, median max SD {found['median_max_sd']:.3f}, "
                     f"churn median / p90 {churn} per hour")
    first, second = policies
    return (f"{label:34} {row['runs']:4d} runs | " + " | ".join(cells)
            + f" | worse only under {first} {row[f'worse_{first}_only']}, only under {second} "
            f"{row[f'worse_{second}_only']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="FILE", help="random_mixes --json files")
    parser.add_argument("--policies", default="fair,f-sched", help="the two policies compared (default fair,f-sched)")
    parser.add_argument("--margin", type=float, default=0.02, help="SD above observe's that counts as worse (0.02)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if len(policies) != 2:
        parser.error(f"--policies takes two policies, A,B; got {args.policies!r}")
    table: dict = {"margin": args.margin, "policies": policies, "files": {}}
    pooled_bases: dict = {}
    pooled_runs: dict = {}
    for path in args.files:
        bases, runs = load(path)
        table["files"][path] = {}
        for model in sorted({key[1] for key in bases}):
            row = table["files"][path][model] = compare(bases, runs, policies, args.margin, model)
            print(_line(f"{path} {model}", row, policies))
        pooled_bases.update({(path, *key): base for key, base in bases.items()})
        pooled_runs.update({(path, *key): run for key, run in runs.items()})
    table["pooled"] = compare(pooled_bases, pooled_runs, policies, args.margin, None)
    print(_line("pooled", table["pooled"], policies))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"command": "python -m benchmarks.compare_policies " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv), **table}, out,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
