"""Two sweeps of ``benchmarks.random_mixes`` compared run by run, with an exact McNemar test.

    python -m benchmarks.compare_mixes BEFORE.json AFTER.json
    python -m benchmarks.compare_mixes A1.json B1.json A2.json B2.json   # several sets, then pooled
    python -m benchmarks.compare_mixes BEFORE.json AFTER.json --json comparison.json

Each file is what ``python -m benchmarks.random_mixes --json PATH`` writes (the same seeds, or
some in common: a ``--max-gpus 3`` sweep against the whole 200). A run is one (seed,
interference model, policy, noise seed); it is *worse* when its final max SD or mean SD ends
above ``observe``'s of the same seed and noise (in its own file) by more than
``drbalance.sim.mixes.NOT_WORSE_MARGIN``, issue 9's rule. Per model, per pair of files and pooled
over all pairs, the report counts the runs worse before and after, the runs *fixed* (worse
before, not after) and *broken* (the reverse), the runs whose ends did not change, and the mean
change of the max and mean SD.

Why a test: a single run is chaotic (a 1% longer decision window can leave another layout), so
most variants of ``fair`` fix some misses and break about as many others. McNemar's exact test
asks how likely a split at least this lopsided between fixed and broken would be if each
changed verdict were a fair coin (two-sided, the binomial with p = 1/2 over the discordant
runs): a p-value of 0.05 or more means the counts cannot tell the variant from chance. The
runs that change verdict are the only evidence on the miss rate; runs worse (or not) in both
files say nothing about the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from benchmarks.random_mixes import Run, worse

RunKey = tuple[int, str, str, int]  # seed, interference, policy, noise seed (``run_key``)
SIGNIFICANCE = 0.05


class MixFileError(ValueError):
    """A file that is not a readable ``random_mixes --json`` result."""


@dataclass(frozen=True)
class Ends:
    """One run's final max and mean SD, and whether it ended worse than doing nothing."""

    max_sd: float
    mean_sd: float
    worse: bool


@dataclass
class Tally:
    """Run-by-run counts over a set of paired runs (``add``)."""

    runs: int = 0
    worse_before: int = 0
    worse_after: int = 0
    fixed: int = 0
    broken: int = 0
    unchanged: int = 0  # both ends equal to 1e-9
    max_change: float = 0.0  # sums of after - before; ``summary`` gives the means
    mean_change: float = 0.0
    fixed_runs: list[str] = field(default_factory=list)
    broken_runs: list[str] = field(default_factory=list)

    def merge(self, other: Tally) -> None:
        """Add another tally's counts and sums to this one."""
        counts = ("runs", "worse_before", "worse_after", "fixed", "broken", "unchanged", "max_change", "mean_change")
        for name in counts:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.fixed_runs.extend(other.fixed_runs)
        self.broken_runs.extend(other.broken_runs)

    def add(self, key: RunKey, before: Ends, after: Ends) -> None:
        self.runs += 1
        self.worse_before += before.worse
        self.worse_after += after.worse
        label = run_label(key)
        if before.worse and not after.worse:
            self.fixed += 1
            self.fixed_runs.append(label)
        elif after.worse and not before.worse:
            self.broken += 1
            self.broken_runs.append(label)
        if abs(after.max_sd - before.max_sd) < 1e-9 and abs(after.mean_sd - before.mean_sd) < 1e-9:
            self.unchanged += 1
        self.max_change += after.max_sd - before.max_sd
        self.mean_change += after.mean_sd - before.mean_sd

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.fixed, self.broken)

    def summary(self) -> str:
        if not self.runs:
            return "no runs in common"
        p = self.p_value
        verdict = "cannot be told from chance" if p >= SIGNIFICANCE else (
            "fewer misses" if self.fixed > self.broken else "more misses")
        return (f"{self.runs} runs: worse {self.worse_before} -> {self.worse_after}; fixed {self.fixed}, "
                f"broken {self.broken} (McNemar exact p = {p:.3g}: {verdict}); ends unchanged in "
                f"{self.unchanged}; mean change of max / mean SD "
                f"{self.max_change / self.runs:+.4f} / {self.mean_change / self.runs:+.4f}")


def mcnemar_exact(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value for ``fixed`` and ``broken`` discordant runs: twice the
    smaller binomial tail of n = fixed + broken fair coins, at most 1 (1 when n is 0)."""
    if fixed < 0 or broken < 0:
        raise ValueError(f"counts must be >= 0; got fixed={fixed}, broken={broken}")
    n = fixed + broken
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(fixed, broken) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def run_label(key: RunKey) -> str:
    seed, interference, policy, noise = key
    return f"{seed} {interference} {policy}" + (f" noise {noise}" if noise else "")


def load_runs(path: str) -> dict[RunKey, Ends]:
    """Every policy run of a ``random_mixes --json`` file, judged against ``observe`` of its own file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise MixFileError(f"{path}: cannot read it ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MixFileError(f"{path}: not JSON ({error})") from None
    if not (isinstance(data, dict) and isinstance(data.get("runs"), list) and isinstance(data.get("observe"), list)):
        raise MixFileError(f"{path}: expected an object with lists 'runs' and 'observe' "
                           "(what `python -m benchmarks.random_mixes --json` writes)")
    observe = {(run.seed, run.interference, run.noise): run for run in _runs(path, data["observe"], "observe")}
    judged = {}
    for run in _runs(path, data["runs"], "runs"):
        base = observe.get((run.seed, run.interference, run.noise))
        key = run_key(run)
        if base is None:
            raise MixFileError(f"{path}: run {run_label(key)} has no observe run of the same seed, model and noise")
        judged[key] = Ends(run.max_sd, run.mean_sd, worse(run, base))
    return judged


def run_key(run: Run) -> RunKey:
    return run.seed, run.interference, run.policy, run.noise


def _runs(path: str, items: list, where: str) -> list[Run]:
    """The entries of one list of the file as ``random_mixes.Run`` (as ``random_mixes`` wrote them)."""
    runs = []
    for position, item in enumerate(items):
        try:
            run = Run(int(item["seed"]), str(item["interference"]), str(item["policy"]),
                      float(item.get("spread", 0.0)), float(item["max_sd"]), float(item["mean_sd"]),
                      int(item.get("noise", 0)))
        except (TypeError, KeyError, ValueError) as error:
            raise MixFileError(f"{path}: {where}[{position}] is not a run with seed, interference, policy, "
                               f"max_sd and mean_sd ({error!r})") from None
        if not (math.isfinite(run.max_sd) and math.isfinite(run.mean_sd)):
            raise MixFileError(f"{path}: {where}[{position}] has a max or mean SD that is not a finite number")
        runs.append(run)
    return runs


def compare(before: Mapping[RunKey, Ends], after: Mapping[RunKey, Ends]) -> dict[str, Tally]:
    """Per interference model and ``"all"``: the tally of the runs both hold."""
    tallies: dict[str, Tally] = {"all": Tally()}
    for key in sorted(set(before) & set(after)):
        for name in (key[1], "all"):
            tallies.setdefault(name, Tally()).add(key, before[key], after[key])
    return tallies


def pool(tallies: Sequence[Mapping[str, Tally]]) -> dict[str, Tally]:
    """The tallies of several pairs of files added up, model by model."""
    pooled: dict[str, Tally] = {}
    for per_model in tallies:
        for name, tally in per_model.items():
            pooled.setdefault(name, Tally()).merge(tally)
    return pooled


def render(title: str, tallies: Mapping[str, Tally]) -> list[str]:
    lines = [title]
    for name in sorted(tallies, key=lambda name: (name == "all", name)):
        lines.append(f"  {name}: {tallies[name].summary()}")
    every = tallies.get("all")
    if every is not None:
        if every.fixed_runs:
            lines.append(f"  fixed: {', '.join(every.fixed_runs)}")
        if every.broken_runs:
            lines.append(f"  broken: {', '.join(every.broken_runs)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_mixes",
        description="Compare sweeps of benchmarks.random_mixes run by run: runs fixed and broken, and "
                    "McNemar's exact test of whether the difference in misses is more than chance.")
    parser.add_argument("files", nargs="+", metavar="BEFORE AFTER",
                        help="pairs of random_mixes --json files: before, after (several pairs: each, then pooled)")
    parser.add_argument("--json", metavar="PATH", help="also write the tallies here")
    args = parser.parse_args(argv)
    if len(args.files) % 2:
        parser.error(f"files come in pairs (BEFORE AFTER); got {len(args.files)}")
    pairs = list(zip(args.files[::2], args.files[1::2]))
    try:
        loaded = [(before, after, load_runs(before), load_runs(after)) for before, after in pairs]
    except MixFileError as error:
        print(f"compare_mixes: {error}", file=sys.stderr)
        return 2
    results = []
    lines = []
    for before, after, runs_before, runs_after in loaded:
        tallies = compare(runs_before, runs_after)
        if not tallies["all"].runs:
            print(f"compare_mixes: {before} and {after} have no run in common (seed, model, policy, noise)",
                  file=sys.stderr)
            return 2
        results.append(tallies)
        lines.extend(render(f"{before} -> {after}", tallies))
    if len(results) > 1:
        lines.extend(render("pooled over every pair", pool(results)))
    print("\n".join(lines))
    if args.json:
        document = {"pairs": [{"before": before, "after": after,
                               "tallies": {name: {**asdict(tally), "p_value": tally.p_value}
                                           for name, tally in tallies.items()}}
                              for (before, after, _, _), tallies in zip(loaded, results)]}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
