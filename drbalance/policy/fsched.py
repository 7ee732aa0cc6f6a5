"""``f-sched``: the F-scheduling thesis's policy (seeds/seo2020-f-scheduling-thesis.txt, Listing 1)
on drbalance's predictor and candidate moves.

The thesis gives whole GPUs to jobs: it keeps the variance of the jobs' slow-downs below a bound
and, within that bound, picks the allocation with the largest total throughput (greedily, one
GPU at a time); when no candidate keeps the variance under the bound, the one with the least
variance wins. It does not move a job during a protected period after a (re)start, and applies
a new allocation only if total throughput rises by at least a minimum (1 step/s in the thesis).

Here the same rule judges DR changes, with everything else (predictor, candidates, protected
period, moves owed by swaps, locks, reverts) shared with ``fair``:

- variance: of the predicted SDs at finish of all apps (``variance_bound``, default 0.01, i.e. a
  standard deviation of 0.1);
- throughput: the sum over apps of solo iteration time / predicted iteration time, i.e. how many
  apps' worth of solo speed the server delivers;
- a change is taken if it keeps (or brings) the variance under the bound and raises throughput by
  at least ``min_gain`` (default 0.02 of one app's solo speed), or, with the variance over the
  bound, if it lowers the variance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from drbalance.policy.fair import FairConfig, FairPolicy, Verdict, _Search


@dataclass(frozen=True)
class FSchedConfig(FairConfig):
    """``fair``'s settings plus the thesis's variance bound (SD units squared)."""

    variance_bound: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.variance_bound >= 0:
            raise ValueError(f"variance_bound must be >= 0; got {self.variance_bound!r}")


class FSchedPolicy(FairPolicy):
    """Maximise predicted throughput while the variance of predicted SDs stays under a bound."""

    name = "f-sched"

    def __init__(self, config: FSchedConfig | None = None) -> None:
        super().__init__(config or FSchedConfig())

    def judge(self, search: _Search, before: Mapping[str, float], after: Mapping[str, float],
              movers: int = 1, novel: bool = False) -> Verdict | None:
        """Under the variance bound: the throughput gain (ranked first); over it: the fall of the
        variance (ranked after every change that ends under the bound). ``movers`` and ``novel``
        are not used."""
        bound = getattr(self.config, "variance_bound", FSchedConfig.variance_bound)
        sds = search.all_sds()
        old_variance = _variance(sds)
        new_variance = _variance({**sds, **search.sds(after)})
        throughput_gain = sum(_speed(search, name, seconds) for name, seconds in after.items()) - sum(
            _speed(search, name, seconds) for name, seconds in before.items())
        if new_variance < bound:
            if throughput_gain >= self.config.min_gain or old_variance >= bound:
                return Verdict(throughput_gain, (1.0, throughput_gain, old_variance - new_variance))
            return None
        if old_variance - new_variance >= self.config.min_gain * self.config.min_gain:
            return Verdict(old_variance - new_variance, (0.0, old_variance - new_variance, throughput_gain))
        return None


def _speed(search: _Search, name: str, seconds: float) -> float:
    """The app's speed as a share of its solo speed."""
    view = search.views[name]
    solo = view.solo_time / max(1, view.iterations_total)
    return solo / seconds if seconds > 0 else 0.0


def _variance(values: Mapping[str, float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values.values()) / len(values)
    try:
        return sum((value - mean) ** 2 for value in values.values()) / len(values)
    except OverflowError:  # SDs from a record's extreme (finite) times: float ** raises where * gives inf
        return math.inf
