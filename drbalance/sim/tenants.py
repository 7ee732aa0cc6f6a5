"""Several users' own managers on one server, as the simulator models them: one policy per user.

Where every user of a server runs their own ``drbalance-manager``, each manager's policy knows
only its user's jobs (their records are private to the user) but reads NVML's utilisation of
every GPU, which counts the other users' load too; and it can answer and push DRs only to its
own user's jobs. ``PerUserPolicy`` is that for the simulator: it holds one policy object per
user and gives each a ``Snapshot`` of its user's apps alone, with the utilisation unfiltered.
One policy over every app (a system manager's) is the plain policy object itself.

The daemon never uses this module: a per-user manager runs a plain policy over the apps it sees,
which are its user's. ``deal`` gives a scenario's apps to users (``PerUserPolicy``'s mapping).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

from drbalance.policy.base import Decision, Policy, Snapshot
from drbalance.workload.scenarios import Scenario


class PerUserPolicy:
    """One policy per user; each decides only its user's apps, from a snapshot of those apps.

    ``users``: app name -> user. ``factory``: makes one user's policy (e.g. ``FairPolicy``); each
    user's object keeps its own state, as each user's manager does. A DR pushed to another user's
    app (``Decision.others``) is refused: such a manager cannot reach that app's record.
    """

    name = "per-user"

    def __init__(self, users: Mapping[str, str], factory: Callable[[], Policy]) -> None:
        self.users = MappingProxyType(dict(users))
        self.policies: dict[str, Policy] = {user: factory() for user in sorted(set(self.users.values()))}

    def user_of(self, app: str) -> str:
        """The user an app belongs to; ValueError for an app the mapping does not name."""
        try:
            return self.users[app]
        except KeyError:
            raise ValueError(f"PerUserPolicy: app {app!r} has no user (the mapping names "
                             f"{len(self.users)} apps)") from None

    def view_of(self, user: str, snapshot: Snapshot) -> Snapshot:
        """What ``user``'s manager sees: its user's apps, every GPU's utilisation."""
        own = tuple(view for view in snapshot.apps if self.user_of(view.name) == user)
        return Snapshot(own, snapshot.utilization, snapshot.config)

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        """The decision of the app's user's policy, from that user's view, without pushes to
        other users' apps (those are listed in the details as ``refused_pushes``)."""
        user = self.user_of(app)
        decision = self.policies[user].decide(app, trigger, self.view_of(user, snapshot))
        if decision.app != app:
            raise ValueError(f"PerUserPolicy: user {user!r}'s policy answered for app {decision.app!r}, not {app!r}")
        foreign = sorted(name for name in decision.others if self.users.get(name) != user)
        if not foreign:
            return decision
        others = {name: ratio for name, ratio in decision.others.items() if name not in foreign}
        details = dict(decision.details) | {"refused_pushes": foreign}
        return replace(decision, others=MappingProxyType(others), details=MappingProxyType(details))


def deal(scenario: Scenario, users: int) -> dict[str, str]:
    """The scenario's apps dealt to ``users`` users (``user0``, ``user1``, ...): the apps in an
    order shuffled by ``random.Random(f"{scenario.name}/{users}")``, then dealt round-robin.
    Each app goes to one user; users' app counts differ by at most one (with fewer apps than
    users, some get none). Not by app index alone: round-robin placement puts app i on GPU
    i mod m, and dealing by index too would give each user its own GPUs whenever m is a multiple
    of the user count."""
    if isinstance(users, bool) or not isinstance(users, int) or users < 1:
        raise ValueError(f"users must be a positive integer; got {users!r}")
    names = [app.name for app in scenario.apps]
    random.Random(f"{scenario.name}/{users}").shuffle(names)
    return {name: f"user{index % users}" for index, name in enumerate(names)}
