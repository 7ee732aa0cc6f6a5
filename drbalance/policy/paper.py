"""The paper's DR management (Kim & Kim 2022, Alg. 1 and 2), with its open edge cases decided.

See docs/policy.md for the algorithm, each branch's name, and every edge-case decision. A branch
that keeps the DR returns the app's own DR unchanged (whatever its total); a branch that moves
data returns a DR with the configured total.
"""

from __future__ import annotations

import math

from drbalance.policy.base import AppView, Decision, Snapshot, current_ratio, violations
from drbalance.ratio import DataRatio

SD_TIE_TOLERANCE = 1e-9


def round_half_up(value: float) -> int:
    return math.floor(value + 0.5)




class PaperPolicy:
    """Alg. 1 (exclusive mode, keep, choose a branch) and Alg. 2 (DR_Update_Util, DR_Update_SD)."""

    name = "paper"

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        config = snapshot.config
        me = snapshot.app(app)
        ratio = current_ratio(me, config)
        if ratio is None:
            return Decision.of(app, me.ratio, "bad-dr", gpus=len(me.ratio), server_gpus=config.gpu_count)
        if len(snapshot.apps) <= config.gpu_count:
            decision = self.exclusive(me, ratio, snapshot)
        else:
            decision = self.balance(me, ratio, snapshot)
        return self.within_constraints(me, decision, snapshot)

    @staticmethod
    def within_constraints(me: AppView, decision: Decision, snapshot: Snapshot) -> Decision:
        """The paper knows no constraints: a DR it proposes that the app may not take (a GPU it
        cannot use, a DDP rank below its minimum, a share above a memory cap) becomes a keep."""
        if decision.ratio == me.ratio:
            return decision
        problems = violations(me, decision.ratio, snapshot.config)
        if not problems:
            return decision
        return Decision.of(me.name, me.ratio, "constrained", wanted=decision.ratio.to_list(),
                         wanted_branch=decision.branch, problems=problems)

    # --- Alg. 1, lines 2-10 ----------------------------------------------------------------------
    def exclusive(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision:
        """Apps <= GPUs: give the app a GPU of its own, the least utilised one nobody else uses."""
        config = snapshot.config
        others_per_gpu = gpu_occupancy(snapshot, exclude=me.name)
        used = ratio.used
        if len(used) == 1 and others_per_gpu[used[0]] == 0:
            return Decision.of(me.name, me.ratio, "exclusive-keep", gpu=used[0])
        fewest = min(others_per_gpu)
        candidates = [g for g in range(config.gpu_count) if others_per_gpu[g] == fewest]
        gpu = min(candidates, key=lambda g: (_util_or(snapshot, g, math.inf), g))
        return Decision.of(me.name, DataRatio.single(config.gpu_count, gpu, config.dr_total), "exclusive",
                         gpu=gpu, others_on_gpu=fewest, util=snapshot.utilization[gpu])

    # --- Alg. 1, lines 11-23 ---------------------------------------------------------------------
    def balance(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision:
        config = snapshot.config
        if me.slowdown is None:
            return Decision.of(me.name, me.ratio, "no-sd")
        unknown = [app.name for app in snapshot.apps if app.slowdown is None]
        if unknown:  # SD_max and SD_max^diff are undefined until every app has measured its SD
            return Decision.of(me.name, me.ratio, "incomplete-sd", waiting_for=unknown)
        known = [app.slowdown for app in snapshot.apps if app.slowdown is not None]
        sd_max, sd_min = max(known), min(known)
        spread = sd_max - sd_min
        if me.slowdown < sd_max - SD_TIE_TOLERANCE:
            return Decision.of(me.name, me.ratio, "not-max", sd=me.slowdown, sd_max=sd_max)
        # balance() runs only with more apps than GPUs (>= 2), all with an SD: spread is defined
        if spread < config.sd_threshold:
            return Decision.of(me.name, me.ratio, "below-threshold", spread=spread, sd_threshold=config.sd_threshold)
        utils = snapshot.utilization
        if all(value is not None for value in utils):
            used = ratio.used
            gpu_max = max(used, key=lambda g: (utils[g], -g))
            gpu_min = min(range(config.gpu_count), key=lambda g: (utils[g], g))
            gap = utils[gpu_max] - utils[gpu_min]
            if gap > config.util_threshold:
                return self.update_by_util(me, ratio, snapshot, gpu_max, gpu_min, gap)
            return self.update_by_sd(me, ratio, snapshot, sd_max, sd_min, util_gap=gap)
        return self.update_by_sd(me, ratio, snapshot, sd_max, sd_min, util_gap=None)

    # --- Alg. 2, lines 1-12 ----------------------------------------------------------------------
    def update_by_util(
        self, me: AppView, ratio: DataRatio, snapshot: Snapshot, gpu_max: int, gpu_min: int, gap: float
    ) -> Decision:
        """Spread the app over its GPUs plus the idlest one, in proportion to remaining capacity."""
        config = snapshot.config
        targets = sorted(set(ratio.used) | {gpu_min})
        remaining = {g: min(100.0, max(0.0, 100.0 - snapshot.utilization[g])) for g in targets}
        if sum(remaining.values()) <= 0:
            remaining = dict.fromkeys(targets, 1.0)  # every GPU saturated: spread evenly
        weights = [remaining.get(g, 0.0) for g in range(config.gpu_count)]
        new = DataRatio.from_weights(weights, config.dr_total)
        return Decision.of(me.name, new, "util", gpu_max=gpu_max, gpu_min=gpu_min, util_gap=gap,
                         remaining={str(g): remaining[g] for g in targets})

    # --- Alg. 2, lines 13-19 ---------------------------------------------------------------------
    def update_by_sd(
        self, me: AppView, ratio: DataRatio, snapshot: Snapshot, sd_max: float, sd_min: float,
        util_gap: float | None,
    ) -> Decision:
        """Move r units of the app's largest share to the GPU whose apps suffer least."""
        config = snapshot.config
        src = max(ratio.used, key=lambda g: (ratio[g], _util_or(snapshot, g, -math.inf), -g))
        averages = average_sd_per_gpu(snapshot)
        destinations = [g for g in range(config.gpu_count) if g != src]
        if not destinations:
            return Decision.of(me.name, me.ratio, "sd-no-destination", src=src)
        dest = min(destinations, key=lambda g: (averages[g], _util_or(snapshot, g, math.inf), g))
        sd = me.slowdown
        if sd <= 1.0:
            return Decision.of(me.name, me.ratio, "sd-not-slowed", sd=sd, src=src, dest=dest)
        e_mbr = (sd - 1.0) / ratio[src]
        wanted = (sd - (sd_max + sd_min) / 2.0) / e_mbr
        moved = max(0, min(ratio[src], round_half_up(wanted)))
        details = dict(src=src, dest=dest, e_mbr=e_mbr, r_exact=wanted, r=moved, util_gap=util_gap,
                       dest_avg_sd=averages[dest])
        if moved == 0:
            return Decision.of(me.name, me.ratio, "sd-zero-move", **details)
        shares = list(ratio.shares)
        shares[src] -= moved
        shares[dest] += moved
        return Decision.of(me.name, DataRatio(shares, config.dr_total), "sd", **details)


def gpu_occupancy(snapshot: Snapshot, exclude: str | None = None) -> list[int]:
    """Number of apps (other than ``exclude``) with a non-zero share on each GPU."""
    counts = [0] * snapshot.config.gpu_count
    for app in snapshot.apps:
        if app.name == exclude or len(app.ratio) != snapshot.config.gpu_count:
            continue
        for gpu in app.ratio.used:
            counts[gpu] += 1
    return counts


def average_sd_per_gpu(snapshot: Snapshot) -> list[float]:
    """Mean SD of the apps on each GPU (DESIGN's "average SD of the apps running on it").

    A GPU nobody uses counts 0.0 (nobody suffers there: the best destination). A GPU whose apps
    have no SD yet counts as the mean SD of all apps with one (unknown, so neither best nor worst).
    """
    gpus = snapshot.config.gpu_count
    sums, counts, occupied = [0.0] * gpus, [0] * gpus, [False] * gpus
    known = []
    for app in snapshot.apps:
        if len(app.ratio) != gpus:
            continue
        if app.slowdown is not None:
            known.append(app.slowdown)
        for gpu in app.ratio.used:
            occupied[gpu] = True
            if app.slowdown is not None:
                sums[gpu] += app.slowdown
                counts[gpu] += 1
    neutral = sum(known) / len(known) if known else 0.0
    return [s / c if c else (neutral if busy else 0.0) for s, c, busy in zip(sums, counts, occupied)]


def _util_or(snapshot: Snapshot, gpu: int, default: float) -> float:
    value = snapshot.utilization[gpu]
    return default if value is None else value
