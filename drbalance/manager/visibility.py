"""What each user may see of a system manager's jobs.

A system manager balances every user's jobs; a user asking for its status (``drbalance status``,
over the socket: the kernel says who asks) sees their own jobs by name and everyone else's only as
anonymous load: the GPUs a job uses (its DR), its SD and state, never its name, pid, user or
progress. The administrator (root, or the manager's own user) sees every job by name; so does
everyone when the manager runs with ``--show-names``. The Prometheus metrics cannot tell who
reads them, so they name no job unless ``--show-names`` is given (``metric_label``).
"""

from __future__ import annotations

from typing import Any

ANONYMOUS = "(another user's job)"
PRIVATE_FIELDS = ("faults", "fault_counts", "log")
"""Status fields only the administrator sees (they may name another user's job or a path)."""


def is_admin(uid: int, manager_uid: int) -> bool:
    return uid in (0, manager_uid)


def status_for(status: dict[str, Any], viewer: int, manager_uid: int, show_names: bool) -> dict[str, Any]:
    """``status`` (every job; each app carries its owner's ``uid``) as user ``viewer`` may see it."""
    admin = is_admin(viewer, manager_uid)
    seen = {key: value for key, value in status.items() if key != "apps" and (admin or key not in PRIVATE_FIELDS)}
    seen["viewer_uid"] = viewer
    seen["apps"] = [app if app.get("uid") == viewer else named(app) if admin or show_names else anonymous(app)
                    for app in status["apps"]]
    return seen


def named(app: dict[str, Any]) -> dict[str, Any]:
    """Another user's app shown by name: ``user/app``."""
    return {**app, "name": f"{app.get('user_login', app.get('uid'))}/{app.get('name')}"}


def anonymous(app: dict[str, Any]) -> dict[str, Any]:
    """An app of another user as load only: its DR (the GPUs it uses), SD and state."""
    return {"name": ANONYMOUS, "anonymous": True, "pid": 0, "epoch": 0, "epochs": 0, "iteration": 0,
            "iterations_total": 0, "sd": app.get("sd"), "sd_estimated": app.get("sd_estimated"),
            "sd_bound": app.get("sd_bound"), "dr": app.get("dr", []), "state": app.get("state"),
            "steered": app.get("steered"), "quiet_for": app.get("quiet_for"), "updated_ago": app.get("updated_ago")}


def metric_label(app: str, user: str, serial: int, show_names: bool) -> str:
    """The ``app`` label of a job's metrics: ``user/app`` with ``--show-names``, else ``job<serial>``
    (a number the manager gives each attached job, the same for its whole life)."""
    return f"{user}/{app}" if show_names else f"job{serial}"
