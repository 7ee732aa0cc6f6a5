"""Backward elimination of `fair`'s rules: each rule switched to its neutral behaviour and measured
against `fair` as it is, on the tuning set (docs/policy.md, "Rules").

    python -m benchmarks.rule_elimination rules                          # every rule and its neutral behaviour
    python -m benchmarks.rule_elimination run --out DIR                  # fair as it is (and observe), both sets
    python -m benchmarks.rule_elimination run --out DIR --off swaps      # fair with rules off (comma-separated)
    python -m benchmarks.rule_elimination compare --out DIR --removed A,B --json R/rule_elimination.json
    python -m benchmarks.rule_elimination heldout today=A.json,B.json now=C.json,D.json --json R/heldout.json

The tuning set is ``benchmarks.random_mixes``'s default draw, seeds 0-199, and its wide draw,
seeds 1000-1099, each under both interference models (600 runs), every run from round-robin;
``observe`` of the same seed and model is the reference. ``run`` runs a round: its reference
(``fair`` with the rules of ``--removed`` off; all on: ``fair`` as it is) and every other rule
off besides, in lockstep (``Lockstep``: a variant that decides as the reference throughout had
the reference's run), writing one JSON file per variant and draw into DIR (``observe``,
``fair``, ``off-A+B``).

``compare`` reads them: per variant, the runs worse than ``observe`` by more than 0.02, the
median final max SD and the churn (DR changes per app-hour, median and
90th percentile over every app of every run), each against ``fair`` as it is, and whether the
variant is within the noise band: worse count at most +2, median final max SD at most +0.005,
churn median at most +10%. ``--removed A,B``: the rules already taken out, together (their
variant is the round's reference, and each other variant is measured with them off too).

``heldout`` reads ``benchmarks.random_mixes --json`` files, grouped under labels (the policy
as it was, as it is), and gives the same numbers per label and policy, per draw and model and
pooled, and the acceptance of docs/policy.md for ``fair`` of each label against the first
label's: worse count at most +3, median final max SD at most +0.01, churn median and p90 no
higher.

A rule is switched off by knobs of ``FairConfig``/``PredictorConfig`` or by a subclass that
overrides the methods that make it (``RULES``); nothing here changes `fair` itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any

from benchmarks.random_mixes import DRAWS, Run, churn
from benchmarks.timing import percentile
from drbalance.policy.base import AppView, Decision, Snapshot
from drbalance.policy.fair import FairConfig, FairPolicy, Verdict, _Search
from drbalance.policy.predictor import Predictor, PredictorConfig
from drbalance.ratio import DataRatio
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference

TUNING = {"default": range(0, 200), "wide": range(1000, 1100)}
"""The tuning set: seeds per draw of ``benchmarks.random_mixes``."""

HELD_OUT = {"default": range(200, 400), "wide": range(1100, 1200)}
"""The held-out set (never used to choose a rule's fate)."""

WORSE_BY = 0.02
"""SD: a run is *worse* than ``observe`` of its seed and model when its final max SD or mean SD is
above observe's by more than this (the issue's margin; ``benchmarks.compare_policies``'s default)."""

WORSE_MARGIN = 2
"""Runs: how many more runs worse than ``observe`` a removal may cause and stay within the noise."""
MEDIAN_MARGIN = 0.005
"""SD: how much the median final max SD may rise."""
CHURN_MARGIN = 0.10
"""Share: how much the churn median may rise."""


# --- the rules, each switched off ------------------------------------------------------------------
class _NoNewcomerPlacement:
    def _place_newcomer(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision | None:
        return None


class _NoYield:
    def _yield_split(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision | None:
        return None


class _NoLocks:
    def _locked_gpus(self, app: str, live: set[str]) -> set[int]:
        return set()


class _NoSumWin:
    @staticmethod
    def _sum_win(mean_rise: float, app_count: int, needed: float) -> Verdict | None:
        return None


class _NoRevert:
    def _undo_verdict(self, me: AppView, move: Any, measured: float | None, search: _Search) -> Verdict | None:
        return None


class _NoMeasuredLoss:
    def _measured_loss(self, me: AppView, move: Any, measured: float | None, search: _Search) -> Verdict | None:
        return None


class _NoWindow:
    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        return replace(super().decide(app, trigger, snapshot), next_boundary=None)  # type: ignore[misc]


class _NoQuietFilter:
    def _quiet_gpus(self) -> list[int]:
        load = self._others_load()
        free = [g for g in range(self.config.gpu_count) if g not in self.locked]
        return sorted(free, key=lambda g: (load[g], g))[: self.policy.config.destinations]


class _NoSharingPays:
    def _sharing_pays(self) -> bool:
        return False


class _NoConsolidation:
    def _consolidation_plans(self) -> list[dict[str, DataRatio]]:
        return []


class _NoIdleUse:
    def _use_idle_gpu(self, candidates: list) -> None:
        return None


class _NoRevertByMean:
    def mean_gain(self, changes: Mapping[str, DataRatio]) -> Verdict | None:
        return None


class _NoRelativeSpeeds:
    def _learn_relative_speeds(self, *args: Any) -> None:
        return None


class _OneKappaContext:
    def _look_up_kappa(self, app: str, other: str, crowd: bool) -> float:
        return super()._look_up_kappa(app, other, False)  # type: ignore[misc]

    def _set_kappa(self, pair: tuple[str, str], crowd: bool, value: float | None) -> None:
        super()._set_kappa(pair, False, value)  # type: ignore[misc]


class _NoKappaEstimate:
    def _look_up_kappa(self, app: str, other: str, crowd: bool) -> float:
        pair = (app, other)
        found = self.kappa[False].get(pair)
        if found is None and crowd:
            found = self.kappa[True].get(pair)
        if found is not None:
            return found
        found = None if crowd else self.kappa[True].get(pair)
        self._estimated.append((self.kappa_rows(app)[1 if crowd else 0], other))
        return self.config.interference_prior if found is None else found


@dataclass(frozen=True)
class Rule:
    """One rule of `fair` or its predictor, and how it is switched to its neutral behaviour."""

    neutral: str
    fair_knobs: Mapping[str, Any] = field(default_factory=dict)
    predictor_knobs: Mapping[str, Any] = field(default_factory=dict)
    policy: type | None = None  # overrides of FairPolicy's methods
    search: type | None = None  # overrides of _Search's
    predictor: type | None = None  # overrides of Predictor's


RULES: Mapping[str, Rule] = {
    "tie-band": Rule("a rise of any SD counts against a change (no ties)", {"noise": 0.0}),
    "margin": Rule("a change needs min_gain whatever the measured error", {"error_floor": 1.0}),
    "novel-margin": Rule("no larger margin beside strangers", {"novel_floor": 1.0}),
    "mean-guard": Rule("the mean SD may rise by any amount for a leximax gain", {"mean_slack": 1e9}),
    "sum-win": Rule("with no leximax difference nothing wins (no win by the SDs' sum)", policy=_NoSumWin),
    "closing": Rule("the last windows decide as the others", {"closing_windows": 0.0}),
    "protect": Rule("a judged move does not keep the app put", {"protect_windows": 0}),
    "judge-iterations": Rule("a move is judged after one window, however few iterations", {"judge_iterations": 0}),
    "move-cap": Rule("no cap on moves per epoch", {"max_moves_per_epoch": 10**9}),
    "ban": Rule("an undone DR may be tried again at once", {"ban_windows": 0}),
    "revert": Rule("judged moves are never undone (still learned from)", policy=_NoRevert),
    "revert-by-mean": Rule("a move is undone only if going back wins the objective", search=_NoRevertByMean),
    "measured-loss": Rule("a move of an app alone is judged by the predictor like any", policy=_NoMeasuredLoss),
    "locks": Rule("another app's unjudged move locks no GPU", policy=_NoLocks),
    "quiet-filter": Rule("every unlocked GPU, least loaded first, is a destination", search=_NoQuietFilter),
    "sharing-pays": Rule("with no quiet GPU there is no destination", search=_NoSharingPays),
    "destinations": Rule("every quiet GPU is a destination", {"destinations": 10**9}),
    "spread-limit": Rule("shares move from and to every GPU of a wide app", {"spread_gpus": 0}),
    "swaps": Rule("no swaps", {"swap_partners": 0}),
    "untangle": Rule("no untangling of two split apps", {"untangle_pairs": 0}),
    "consolidation": Rule("no consolidation plans at a crowded start", search=_NoConsolidation),
    "idle-use": Rule("a change must pay by the objective, an idle GPU or not", search=_NoIdleUse),
    "newcomer": Rule("a newcomer keeps its DR until measured", policy=_NoNewcomerPlacement),
    "yield": Rule("no GPU is taken from a split app for a newcomer", policy=_NoYield),
    "newcomer-settle": Rule("a newcomer is placed whenever the others have run", {"newcomer_settled_seconds": 0.0}),
    "window": Rule("decisions at the app's own boundaries (epoch ends), no window of the policy's",
                   policy=_NoWindow),
    "phi": Rule("a chunk's time is proportional to its size", predictor_knobs={"fixed_fraction": 0.0}),
    "overhead-floor": Rule("an unmeasured replica costs overhead_prior alone", predictor_knobs={"overhead_floor": 0.0}),
    "correction": Rule("no per-app correction", predictor_knobs={"correction_bounds": (1.0, 1.0)}),
    "replica-penalty": Rule("rho stays 0", predictor_knobs={"replica_penalty_max": 0.0}),
    "relative-speeds": Rule("a GPU's speed is learned only from an app alone on it", predictor=_NoRelativeSpeeds),
    "crowd-kappa": Rule("one kappa per pair, in pairs and crowds alike", predictor=_OneKappaContext),
    "kappa-estimate": Rule("a pair never measured takes interference_prior", predictor=_NoKappaEstimate),
}
"""Every rule by name (docs/policy.md's table)."""


def variant_policy(off: Iterable[str]) -> FairPolicy:
    """``fair`` with the rules ``off`` switched to their neutral behaviour, together."""
    rules = [RULES[name] for name in sorted(set(off))]
    fair_knobs = {key: value for rule in rules for key, value in rule.fair_knobs.items()}
    predictor_knobs = {key: value for rule in rules for key, value in rule.predictor_knobs.items()}
    search_type = type("VariantSearch", (*[r.search for r in rules if r.search], _Search), {})
    predictor_type = type("VariantPredictor", (*[r.predictor for r in rules if r.predictor], Predictor), {})

    def new_search(self: FairPolicy, snapshot: Snapshot, predictor: Predictor, me: AppView,
                   locked: set[int]) -> _Search:
        return search_type(self, snapshot, predictor, me, locked)

    def new_predictor(self: FairPolicy, gpu_count: int) -> Predictor:
        return predictor_type(gpu_count, self.config.predictor)

    policy_type = type("FairVariant", (*[r.policy for r in rules if r.policy], FairPolicy),
                       {"_new_search": new_search, "_new_predictor": new_predictor})
    config = FairConfig(**fair_knobs, predictor=PredictorConfig(**predictor_knobs))
    return policy_type(config)


LABEL_LIMIT = 120
"""Characters: the longest ``off-A+B`` label; a longer one (a later round's 24 rules off, 280
characters) would make file names past the file system's 255 bytes."""


def label(off: Iterable[str] | None) -> str:
    """A variant's file label: ``observe`` (None), ``fair`` (nothing off) or ``off-A+B``; with
    too many rules for a file name, ``off-<N>-rules-<hash>`` (the first 10 hex digits of the
    SHA-1 of ``A+B``: the same rules, the same label)."""
    if off is None:
        return "observe"
    names = sorted(set(off))
    if not names:
        return "fair"
    joined = "+".join(names)
    if len(joined) + 4 <= LABEL_LIMIT:
        return "off-" + joined
    return f"off-{len(names)}-rules-{hashlib.sha1(joined.encode()).hexdigest()[:10]}"


# --- running ------------------------------------------------------------------------------------------
class Lockstep:
    """The round's reference variant decides; each shadow variant decides too, from the same
    snapshot, until its first decision that differs from the reference's (a DR, pushed DRs, the
    next boundary: all the simulation reads of a decision). A shadow that never differs would
    have run the very same simulation, so its run is the reference's. At a shadow's first
    different decision the process forks (``os.fork``): the child is the simulation as it stands,
    the shadow's decision taken and the shadow deciding from then on, which is the shadow's own
    run from its start; it sends its run back (``finish_fork``) and the parent, having waited
    for it, goes on. The runs are those of each variant simulated on its own, bit for bit."""

    name = "fair"

    def __init__(self, reference: FairPolicy, shadows: Mapping[str, FairPolicy]) -> None:
        self.reference = reference
        self.shadows = dict(shadows)
        self.diverged: set[str] = set()
        self.forked: dict[str, dict[str, Any]] = {}  # in the parent: the runs its forks sent, by shadow
        self.child: tuple[str, int] | None = None  # in a fork: its shadow and the pipe its run goes to

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        decision = self.reference.decide(app, trigger, snapshot)
        for name, shadow in list(self.shadows.items()):
            theirs = shadow.decide(app, trigger, snapshot)
            if (theirs.ratio != decision.ratio or theirs.next_boundary != decision.next_boundary
                    or dict(theirs.others) != dict(decision.others)):
                self.diverged.add(name)
                del self.shadows[name]
                if self._fork(name, shadow):
                    return theirs  # in the child: the shadow's decision, and the shadow's run from here on
        return decision

    def _fork(self, name: str, shadow: FairPolicy) -> bool:
        """Fork; True in the child (the shadow alone decides from now on); in the parent, wait for
        the child's run and keep it, and return False."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            self.reference, self.shadows, self.child = shadow, {}, (name, write)
            return True
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            sent = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not sent:
            raise RuntimeError(f"the simulation of {name} (forked) failed: wait status {status}")
        self.forked[name] = json.loads(sent)
        return False

    def finish_fork(self, run: Run) -> None:
        """In a fork: send the shadow's ``run`` to the parent and end the process (never returns)."""
        name, write = self.child
        with os.fdopen(write, "wb") as pipe:
            pipe.write(json.dumps(vars(replace(run, policy=name))).encode())
        os._exit(0)


def _simulate(draw: str, seed: int, interference: str, policy: FairPolicy | Lockstep | None, name: str) -> Run:
    config = SimConfig(policy="observe" if policy is None else "fair", placement="round-robin", record=False,
                       contention=make_interference(interference))
    result = Simulation(DRAWS[draw](seed), config, policy=policy).run()
    return Run(seed, interference, name, result.sd_spread, result.max_sd, result.mean_sd, 0, churn(result))


def simulate(task: tuple[str, int, str, tuple[str, ...] | None]) -> Run:
    """One run: (draw, seed, interference model, rules off; None: observe)."""
    draw, seed, interference, off = task
    return _simulate(draw, seed, interference, None if off is None else variant_policy(off), label(off))


def run_task(task: tuple[str, int, str, tuple[str, ...], tuple[str, ...], bool]) -> dict[str, Any]:
    """One seed and model of a round: (draw, seed, model, rules removed, rules tried off besides,
    whether to run observe too). Returns every variant's run by label, and which diverged."""
    draw, seed, interference, removed, rules, with_observe = task
    runs: dict[str, Run] = {}
    if with_observe:
        runs["observe"] = _simulate(draw, seed, interference, None, "observe")
    names = {label((*removed, rule)): (*removed, rule) for rule in rules}
    lockstep = Lockstep(variant_policy(removed), {name: variant_policy(off) for name, off in names.items()})
    try:
        reference = _simulate(draw, seed, interference, lockstep, label(removed))
    except BaseException:
        if lockstep.child is not None:
            os._exit(1)  # a fork never returns into the pool's worker
        raise
    if lockstep.child is not None:
        lockstep.finish_fork(reference)
    runs[label(removed)] = reference
    for name in names:
        found = lockstep.forked.get(name)
        runs[name] = (Run(**{**found, "churn": tuple(found["churn"])}) if found is not None
                      else replace(reference, policy=name))
    return {"draw": draw, "seed": seed, "interference": interference, "diverged": sorted(lockstep.diverged),
            "runs": {name: vars(run) for name, run in runs.items()}}


def run_round(out: str, removed: tuple[str, ...], rules: tuple[str, ...], sets: Mapping[str, range],
              workers: int, group: int = 4) -> None:
    """Every run of ``sets`` for the round's reference (``removed`` off) and each of ``rules`` off
    besides, ``group`` rules at a time in their order (each group in lockstep with the reference).
    Each seed and model's runs are appended to ``round-<label>.jsonl`` in ``out`` as they end; a
    round cut short goes on from there, running only the variants, seeds and models missing. A
    variant's file per draw (``<label>-<draw>.json``) is written as soon as its runs of the draw
    are all in."""
    os.makedirs(out, exist_ok=True)
    journal = os.path.join(out, f"round-{label(removed)}.jsonl")
    done = _read_journal(journal)
    reference = label(removed)
    keys = [(draw, seed, interference) for draw, seeds in sets.items() for seed in seeds
            for interference in INTERFERENCE_MODELS]
    observe_missing = {draw: not os.path.exists(os.path.join(out, f"observe-{draw}.json")) for draw in sets}
    chunks = [rules[start:start + max(1, group)] for start in range(0, len(rules), max(1, group))] or [()]
    with ProcessPoolExecutor(max(1, workers)) as pool, open(journal, "a", encoding="utf-8") as sink:
        for chunk in chunks:
            tasks = []
            for draw, seed, interference in keys:
                have = done.get((draw, seed, interference), {}).get("runs", {})
                missing = tuple(rule for rule in chunk if label((*removed, rule)) not in have)
                with_observe = observe_missing[draw] and "observe" not in have
                if missing or with_observe or reference not in have:
                    tasks.append((draw, seed, interference, removed, missing, with_observe))
            for row in pool.map(run_task, tasks):
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                _merge(done, row)
            _write_variants(out, done, sets)


def _read_journal(journal: str) -> dict[tuple[str, int, str], dict[str, Any]]:
    """A round's journal: per (draw, seed, model), every variant's run by label and which diverged.
    A last line cut short (the round was stopped while writing it) is cut off the file."""
    done: dict[tuple[str, int, str], dict[str, Any]] = {}
    if not os.path.exists(journal):
        return done
    with open(journal, "rb") as source:
        data = source.read()
    whole = data[: data.rfind(b"\n") + 1]
    for number, line in enumerate(whole.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                _merge(done, json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise SystemExit(f"rule_elimination: {journal}, line {number}: not a run's row ({error})") from None
    if len(whole) < len(data):
        with open(journal, "r+b") as sink:
            sink.truncate(len(whole))
    return done


def _merge(done: dict[tuple[str, int, str], dict[str, Any]], row: Mapping[str, Any]) -> None:
    entry = done.setdefault((row["draw"], row["seed"], row["interference"]), {"runs": {}, "diverged": set()})
    entry["runs"].update(row["runs"])
    entry["diverged"].update(row["diverged"])


def _write_variants(out: str, done: Mapping[tuple[str, int, str], dict[str, Any]], sets: Mapping[str, range]) -> None:
    """One file per variant and draw whose runs are all in ``done`` (observe's only once)."""
    for draw, seeds in sets.items():
        rows = [done.get((draw, seed, interference)) for seed in seeds for interference in INTERFERENCE_MODELS]
        if any(row is None for row in rows):
            continue
        for name in sorted({name for row in rows for name in row["runs"]}):
            path = os.path.join(out, f"{name}-{draw}.json")
            if os.path.exists(path) and name == "observe":
                continue
            if any(name not in row["runs"] for row in rows):
                continue  # a variant of a group still to run
            diverged = sum(name in row["diverged"] for row in rows)
            with open(path + ".part", "w", encoding="utf-8") as sink:
                json.dump({"variant": name, "draw": draw, "seeds": [seeds.start, seeds.stop],
                           "runs_simulated_on_their_own": diverged, "runs": [row["runs"][name] for row in rows]},
                          sink)
            os.replace(path + ".part", path)


# --- comparing ----------------------------------------------------------------------------------------
def load_runs(out: str, name: str, sets: Mapping[str, range]) -> dict[tuple[str, int, str], Run] | None:
    """A variant's runs keyed by (draw, seed, model), or None if a draw's file is missing."""
    found: dict[tuple[str, int, str], Run] = {}
    for draw in sets:
        path = os.path.join(out, f"{name}-{draw}.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as source:
            for row in json.load(source)["runs"]:
                row["churn"] = tuple(row["churn"])
                found[(draw, row["seed"], row["interference"])] = Run(**row)
    return found


def measure(runs: Mapping[tuple[str, int, str], Run], observe: Mapping[tuple[str, int, str], Run]) -> dict:
    """Worse runs, median final max SD, churn median and p90 (per app-hour), over ``runs``."""
    rates = [value for run in runs.values() for value in run.churn]
    return {"runs": len(runs), "worse": sum(_worse(run, observe[key]) for key, run in runs.items()),
            "median_max_sd": statistics.median(run.max_sd for run in runs.values()),
            "mean_max_sd": statistics.fmean(run.max_sd for run in runs.values()),
            "churn_median": statistics.median(rates), "churn_p90": percentile(rates, 0.9)}


def _worse(run: Run, base: Run) -> bool:
    return run.max_sd > base.max_sd + WORSE_BY or run.mean_sd > base.mean_sd + WORSE_BY


def within_band(got: Mapping[str, float], reference: Mapping[str, float]) -> bool:
    """Whether ``got`` is within the noise band of ``reference`` (the module docstring)."""
    return (got["worse"] <= reference["worse"] + WORSE_MARGIN
            and got["median_max_sd"] <= reference["median_max_sd"] + MEDIAN_MARGIN
            and got["churn_median"] <= reference["churn_median"] * (1.0 + CHURN_MARGIN))


def compare(out: str, removed: Sequence[str], sets: Mapping[str, range]) -> dict:
    """Today's ``fair``, the removed rules together, and each further rule off with them."""
    observe = load_runs(out, "observe", sets)
    today = load_runs(out, "fair", sets)
    if observe is None or today is None:
        raise SystemExit(f"rule_elimination: run observe and fair first (python -m benchmarks.rule_elimination run "
                         f"--out {out})")
    reference = measure(today, observe)
    table: dict = {"fair": reference, "removed": sorted(removed), "variants": {}}
    if removed:
        together = load_runs(out, label(removed), sets)
        table["together"] = None if together is None else measure(together, observe)
        if table["together"] is not None:
            table["together"]["within_band"] = within_band(table["together"], reference)
    for rule in sorted(set(RULES) - set(removed)):
        runs = load_runs(out, label([*removed, rule]), sets)
        if runs is not None:
            row = table["variants"][rule] = measure(runs, observe)
            row["within_band"] = within_band(row, reference)
    return table


ACCEPT_WORSE = 3
"""Runs: held-out runs worse than ``observe`` the cut-down policy may add (docs/policy.md)."""
ACCEPT_MEDIAN = 0.01
"""SD: how much its median final max SD may rise."""


def load_sweeps(paths: Sequence[str]) -> tuple[dict, dict]:
    """``random_mixes --json`` files: observe's runs by (draw, seed, model) and every policy's by
    policy, then (draw, seed, model)."""
    observe: dict[tuple[str, int, str], Run] = {}
    runs: dict[str, dict[tuple[str, int, str], Run]] = {}
    names = {field.name for field in fields(Run)}
    for path in paths:
        with open(path, encoding="utf-8") as source:
            data = json.load(source)
        draw = data.get("draw", "default")
        for row in data["observe"]:
            observe[(draw, row["seed"], row["interference"])] = Run(**{k: v for k, v in row.items() if k in names})
        for row in data["runs"]:
            run = Run(**{k: (tuple(v) if k == "churn" else v) for k, v in row.items() if k in names})
            runs.setdefault(run.policy, {})[(draw, run.seed, run.interference)] = run
    return observe, runs


def heldout(groups: Mapping[str, Sequence[str]]) -> dict:
    """Per label and policy (observe and plan left out): the numbers of ``measure`` per draw and
    model and pooled; for each label's ``fair`` after the first, whether it meets the acceptance
    against the first's."""
    table: dict = {}
    for name, paths in groups.items():
        observe, runs = load_sweeps(paths)
        for policy, found in sorted(runs.items()):
            if policy == "plan":
                continue
            row = table.setdefault(f"{name} {policy}", {})
            for draw, model in sorted({(key[0], key[2]) for key in found}):
                part = {key: run for key, run in found.items() if key[0] == draw and key[2] == model}
                row[f"{draw} {model}"] = measure(part, observe)
            row["pooled"] = measure(found, observe)
    labels = list(groups)
    reference = table.get(f"{labels[0]} fair")
    for name in labels[1:]:
        row = table.get(f"{name} fair")
        if reference is not None and row is not None:
            got, was = row["pooled"], reference["pooled"]
            row["accepted"] = {"worse": got["worse"] <= was["worse"] + ACCEPT_WORSE,
                               "median_max_sd": got["median_max_sd"] <= was["median_max_sd"] + ACCEPT_MEDIAN,
                               "churn_median": got["churn_median"] <= was["churn_median"],
                               "churn_p90": got["churn_p90"] <= was["churn_p90"]}
    return table


def _line(name: str, row: Mapping[str, Any]) -> str:
    band = "" if "within_band" not in row else ("  within band" if row["within_band"] else "  OUT")
    return (f"{name:32s} worse {row['worse']:3d}  median max SD {row['median_max_sd']:.4f}"
            f"  mean {row['mean_max_sd']:.4f}"
            f"  churn median {row['churn_median']:5.1f} p90 {row['churn_p90']:5.1f}{band}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("rules", help="list the rules and their neutral behaviour")
    running = commands.add_parser("run", help="run a round (and observe) on the tuning set")
    running.add_argument("--out", required=True, help="folder for the runs' JSON files")
    running.add_argument("--removed", default="", help="comma-separated rules already removed (default: none)")
    running.add_argument("--rules", default=None, help="comma-separated rules tried off besides (default: every other)")
    running.add_argument("--workers", type=int, default=2, help="simulations in parallel (default 2)")
    running.add_argument("--group", type=int, default=4,
                         help="rules run together in lockstep, in the table's order (default 4: a group's "
                              "files are written when it ends)")
    comparing = commands.add_parser("compare", help="the elimination table from the runs in --out")
    comparing.add_argument("--out", required=True, help="folder of the runs' JSON files")
    comparing.add_argument("--removed", default="", help="comma-separated rules already removed together")
    comparing.add_argument("--json", metavar="PATH", help="also write the table here")
    holding = commands.add_parser("heldout", help="random_mixes --json files compared, label by label")
    holding.add_argument("groups", nargs="+", metavar="LABEL=FILE[,FILE...]", help="the first label is the reference")
    holding.add_argument("--json", metavar="PATH", help="also write the table here")
    args = parser.parse_args(argv)
    if args.command == "rules":
        for name, rule in RULES.items():
            print(f"{name:18s} off: {rule.neutral}")
        return 0
    if args.command == "heldout":
        groups = dict(group.partition("=")[::2] for group in args.groups)
        if any(not files for files in groups.values()):
            parser.error("heldout takes LABEL=FILE[,FILE...] arguments")
        table = heldout({name: files.split(",") for name, files in groups.items()})
        for name, row in table.items():
            for part, numbers in row.items():
                if part != "accepted":
                    print(_line(f"{name}: {part}", numbers))
            if "accepted" in row:
                verdicts = ", ".join(f"{key} {'yes' if met else 'NO'}" for key, met in row["accepted"].items())
                print(f"{name}: accepted {verdicts}")
        _write(args.json, argv, table)
        return 0
    chosen = [name for name in args.removed.split(",") if name]
    tried = [] if args.command != "run" or args.rules is None else [name for name in args.rules.split(",") if name]
    unknown = [name for name in chosen + tried if name not in RULES]
    if unknown:
        parser.error(f"unknown rules {', '.join(unknown)}; known: {', '.join(RULES)}")
    if args.command == "run":
        os.makedirs(args.out, exist_ok=True)
        rules = tuple(tried) if args.rules is not None else tuple(name for name in RULES if name not in chosen)
        run_round(args.out, tuple(sorted(chosen)), rules, TUNING, args.workers, args.group)
        return 0
    table = compare(args.out, chosen, TUNING)
    print(_line("fair (today)", table["fair"]))
    if table.get("together"):
        print(_line("removed together", table["together"]))
    for name, row in table["variants"].items():
        print(_line(name, row))
    _write(args.json, argv, table)
    return 0


def _write(path: str | None, argv: list[str] | None, table: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as sink:
            json.dump({"command": "python -m benchmarks.rule_elimination " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv), **table}, sink,
                      indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
