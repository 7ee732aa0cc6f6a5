"""DR-management policies, registered by name (framework-free; the daemon and simulator share them).

``POLICIES`` is a read-only mapping from name to a zero-argument factory. The daemon's
``--policy``, the simulator's ``--policy`` and the tests all look policies up here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from drbalance.policy.base import AppView, Decision, ObservePolicy, Policy, PolicyConfig, Snapshot, violations
from drbalance.policy.fair import FairPolicy
from drbalance.policy.fsched import FSchedPolicy
from drbalance.policy.paper import PaperPolicy

DEFAULT_POLICY = "fair"
"""The policy the manager and the simulator use unless told otherwise."""

POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({
    "fair": FairPolicy,
    "f-sched": FSchedPolicy,
    "paper": PaperPolicy,
    "observe": ObservePolicy,
})


def make_policy(name: str) -> Policy:
    """A new policy object by name; ValueError names the known policies."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None
    return factory()


__all__ = ["DEFAULT_POLICY", "POLICIES", "AppView", "Decision", "Policy", "PolicyConfig", "Snapshot", "make_policy",
           "violations"]
