"""Linear programmes for the simulator's bounds: a thin wrapper over SciPy's HiGHS solver.

    minimise c @ x  subject to  a_ub @ x <= b_ub,  a_eq @ x == b_eq,  x >= 0

``drbalance.sim.sharing_bound`` solves a few hundred variables per programme. The wrapper only
fixes the variable bounds (``x >= 0``), names the outcome, and checks the returned point against
the constraints, so a numerical failure is an error rather than a wrong bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

FEASIBILITY = 1e-6
"""Largest constraint violation accepted in a returned point, relative to the largest right-hand side."""

_STATUS = {0: "optimal", 2: "infeasible", 3: "unbounded"}


@dataclass(frozen=True)
class LpResult:
    """``status``: ``optimal``, ``infeasible`` or ``unbounded``; ``x`` and ``objective`` if optimal."""

    status: str
    x: np.ndarray | None = None
    objective: float | None = None


def _rows(matrix: object, values: object, n: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.zeros((0, n)) if matrix is None else np.asarray(matrix, dtype=float).reshape(-1, n)
    b = np.zeros(0) if values is None else np.asarray(values, dtype=float).reshape(-1)
    if a.shape[0] != b.size:
        raise ValueError(f"solve_lp: {a.shape[0]} constraint rows but {b.size} right-hand sides")
    return a, b


def solve_lp(c: object, a_ub: object = None, b_ub: object = None, a_eq: object = None,
             b_eq: object = None) -> LpResult:
    """Minimise ``c @ x`` over ``x >= 0`` with the given inequality and equality rows."""
    c = np.asarray(c, dtype=float).reshape(-1)
    a_ub, b_ub = _rows(a_ub, b_ub, c.size)
    a_eq, b_eq = _rows(a_eq, b_eq, c.size)
    result = linprog(c, A_ub=a_ub if b_ub.size else None, b_ub=b_ub if b_ub.size else None,
                     A_eq=a_eq if b_eq.size else None, b_eq=b_eq if b_eq.size else None,
                     bounds=(0, None), method="highs")
    status = _STATUS.get(result.status)
    if status is None:
        raise RuntimeError(f"solve_lp: the solver stopped without an answer ({result.message})")
    if status != "optimal":
        return LpResult(status)
    x = np.maximum(np.asarray(result.x, dtype=float), 0.0)
    scale = FEASIBILITY * max(1.0, float(np.abs(np.concatenate([b_ub, b_eq])).max(initial=0.0)))
    if (b_ub.size and (a_ub @ x - b_ub).max() > scale) or (b_eq.size and np.abs(a_eq @ x - b_eq).max() > scale):
        raise RuntimeError("solve_lp: the solver returned a point that violates the constraints")
    return LpResult("optimal", x, float(c @ x))
