"""The plain definition of an app's SD at finish, to check the policies' faster forms against."""

from __future__ import annotations

from drbalance.policy.base import AppView


def predicted_slowdown(view: AppView, iteration_time: float) -> float | None:
    """Eq. 2 at finish if the app ran every remaining iteration in ``iteration_time`` seconds."""
    if view.slowdown is None or view.iteration_time is None:
        return None
    left = max(0, view.iterations_total - view.iteration)
    elapsed = view.slowdown * view.solo_time - left * view.iteration_time
    return (elapsed + left * iteration_time) / view.solo_time
