"""What a system manager lets each user have: connections, live jobs, notices; and the order in
which it answers notices, so that no user delays another.

Every limit is per user (uid, as the kernel gives it: ``drbalance.ipc.peer``). A user past a
limit is refused (a ``REFUSED`` message saying which limit) and the other users are not
affected. Pending notices are kept at most one per job (a newer notice of a job replaces its
older one: the manager would decide again from the same records anyway) and answered in
round-robin order over the users that have one pending, so a user who floods the manager waits
behind themselves: another user's notice waits for at most one decision per other user with a
notice pending.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class UserLimits:
    """Per-user limits of a system manager (``drbalance-manager --system``; docs/operations.md).

    ``jobs``: live jobs attached at once (64: the scale at which decisions are measured,
    ``benchmarks.bench_policy``, 64 jobs x 16 GPUs). ``connections``: open connections at once
    (jobs, ``drbalance status`` views, jobs reconnecting: twice the jobs). ``notices_per_second``:
    notices taken per second, with a burst of one second's worth (a job sends one at each
    boundary, about once a second at most; 50 covers 64 jobs at 1.3 s each). ``attach_seconds``:
    a connection that has neither attached a job nor asked for the status within this long is
    closed (a job attaches at once).
    """

    jobs: int = 64
    connections: int = 128
    notices_per_second: float = 50.0
    attach_seconds: float = 5.0

    def __post_init__(self) -> None:
        for name in ("jobs", "connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"the per-user limit {name} must be an integer >= 1; got {value!r}")
        for name in ("notices_per_second", "attach_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"the per-user limit {name} must be a positive number; got {value!r}")


class TokenBucket:
    """``rate`` events per second with a burst of ``rate`` (one second's worth)."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.updated = now

    def take(self, now: float) -> bool:
        """Whether one more event is within the rate at ``now`` (monotonic seconds)."""
        self.tokens = min(self.rate, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Admission:
    """Counts per user and the limits' verdicts (each ``*_refusal`` returns why not, or None)."""

    def __init__(self, limits: UserLimits) -> None:
        self.limits = limits
        self.connections: dict[int, int] = {}
        self.jobs: dict[int, int] = {}
        self.buckets: dict[int, TokenBucket] = {}
        self.refused_notices: dict[int, int] = {}  # per user: notices over the rate, for the log

    def connection_refusal(self, uid: int) -> str | None:
        if self.connections.get(uid, 0) >= self.limits.connections:
            return f"this user has {self.limits.connections} connections open to the system manager (its limit)"
        self.connections[uid] = self.connections.get(uid, 0) + 1
        return None

    def connection_closed(self, uid: int) -> None:
        _decrement(self.connections, uid)

    def job_refusal(self, uid: int) -> str | None:
        if self.jobs.get(uid, 0) >= self.limits.jobs:
            return f"this user has {self.limits.jobs} jobs attached to the system manager (its limit)"
        self.jobs[uid] = self.jobs.get(uid, 0) + 1
        return None

    def job_left(self, uid: int) -> None:
        _decrement(self.jobs, uid)

    def notice_refusal(self, uid: int, now: float) -> str | None:
        bucket = self.buckets.get(uid)
        if bucket is None:
            bucket = self.buckets[uid] = TokenBucket(self.limits.notices_per_second, now)
        if bucket.take(now):
            return None
        self.refused_notices[uid] = self.refused_notices.get(uid, 0) + 1
        return f"this user sent more than {self.limits.notices_per_second:g} notices per second (its limit)"

    def forget_idle(self, uid: int) -> None:
        """Drop what is kept about a user with no connection left."""
        if not self.connections.get(uid):
            self.buckets.pop(uid, None)


def _decrement(counts: dict[int, int], uid: int) -> None:
    left = counts.get(uid, 0) - 1
    if left > 0:
        counts[uid] = left
    else:
        counts.pop(uid, None)


class NoticeQueue(Generic[T]):
    """Pending notices (any value ``T``): one per job key (the latest), served round-robin over users."""

    def __init__(self) -> None:
        self._users: deque[int] = deque()  # users with a notice pending, in serving order
        self._pending: dict[int, OrderedDict[str, T]] = {}

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._pending.values())

    def put(self, uid: int, key: str, item: T) -> None:
        """Queue ``item`` for job ``key`` of user ``uid``, replacing one still pending for that job."""
        jobs = self._pending.get(uid)
        if jobs is None:
            jobs = self._pending[uid] = OrderedDict()
            self._users.append(uid)
        jobs.pop(key, None)
        jobs[key] = item

    def pop(self) -> tuple[str, T] | None:
        """The next notice: the oldest of the user whose turn it is (None when none is pending)."""
        while self._users:
            uid = self._users.popleft()
            jobs = self._pending.get(uid)
            if not jobs:
                self._pending.pop(uid, None)
                continue
            key, item = jobs.popitem(last=False)
            if jobs:
                self._users.append(uid)  # back of the line: every other user with one goes first
            else:
                del self._pending[uid]
            return key, item
        return None

    def drop(self, uid: int, key: str) -> None:
        """Forget the notice pending for job ``key`` (it left)."""
        jobs = self._pending.get(uid)
        if jobs is not None:
            jobs.pop(key, None)
