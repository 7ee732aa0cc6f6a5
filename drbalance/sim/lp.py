"""A small dense linear-programme solver (two-phase simplex, numpy only) for the simulator's bounds.

    minimise c @ x  subject to  a_ub @ x <= b_ub,  a_eq @ x == b_eq,  x >= 0

Meant for the few hundred variables of ``drbalance.sim.sharing_bound``'s programmes, not as a
general solver. Pivoting: Dantzig's rule (the most negative reduced cost), falling back to Bland's
rule (the lowest index) after a run of degenerate pivots, so it cannot cycle. Every solution is
checked against the constraints before it is returned (``LpResult.status == "optimal"`` only if
they hold within ``tolerance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOLERANCE = 1e-9


@dataclass(frozen=True)
class LpResult:
    """``status``: ``optimal``, ``infeasible`` or ``unbounded``; ``x`` and ``objective`` if optimal."""

    status: str
    x: np.ndarray | None = None
    objective: float | None = None


def _pivot(tableau: np.ndarray, row: int, column: int) -> None:
    tableau[row] /= tableau[row, column]
    factors = tableau[:, column].copy()
    factors[row] = 0.0
    tableau -= np.outer(factors, tableau[row])


def _simplex(tableau: np.ndarray, basis: list[int], columns: int, tolerance: float, max_pivots: int) -> str:
    """Pivot the tableau (last row: reduced costs, last column: values) to an optimum over the first
    ``columns`` columns. Returns ``optimal`` or ``unbounded``."""
    degenerate = 0
    for _ in range(max_pivots):
        costs = tableau[-1, :columns]
        if degenerate > 50:  # Bland: the lowest index with a negative reduced cost
            candidates = np.flatnonzero(costs < -tolerance)
            if candidates.size == 0:
                return "optimal"
            entering = int(candidates[0])
        else:
            entering = int(np.argmin(costs))
            if costs[entering] >= -tolerance:
                return "optimal"
        column = tableau[:-1, entering]
        positive = column > tolerance
        if not positive.any():
            return "unbounded"
        ratios = np.full(column.shape, np.inf)
        ratios[positive] = tableau[:-1, -1][positive] / column[positive]
        best = ratios.min()
        ties = np.flatnonzero(ratios <= best + tolerance * max(1.0, abs(best)))
        leaving = int(min(ties, key=lambda r: basis[r]))  # Bland's tie-break on the leaving side
        degenerate = degenerate + 1 if best <= tolerance else 0
        _pivot(tableau, leaving, entering)
        basis[leaving] = entering
    raise RuntimeError(f"simplex did not converge in {max_pivots} pivots")


def solve_lp(c: np.ndarray, a_ub: np.ndarray | None = None, b_ub: np.ndarray | None = None,
             a_eq: np.ndarray | None = None, b_eq: np.ndarray | None = None,
             tolerance: float = TOLERANCE, max_pivots: int = 50_000) -> LpResult:
    """Minimise ``c @ x`` over ``x >= 0`` with the given inequality and equality rows."""
    c = np.asarray(c, dtype=float)
    n = c.size
    a_ub = np.zeros((0, n)) if a_ub is None else np.asarray(a_ub, dtype=float).reshape(-1, n)
    b_ub = np.zeros(0) if b_ub is None else np.asarray(b_ub, dtype=float).reshape(-1)
    a_eq = np.zeros((0, n)) if a_eq is None else np.asarray(a_eq, dtype=float).reshape(-1, n)
    b_eq = np.zeros(0) if b_eq is None else np.asarray(b_eq, dtype=float).reshape(-1)
    if a_ub.shape[0] != b_ub.size or a_eq.shape[0] != b_eq.size:
        raise ValueError(f"solve_lp: {a_ub.shape[0]} inequality rows but {b_ub.size} bounds, "
                         f"{a_eq.shape[0]} equality rows but {b_eq.size} values")
    m_ub, m_eq = a_ub.shape[0], a_eq.shape[0]
    rows = m_ub + m_eq
    # Standard form: [x | slacks | artificials], every right-hand side made >= 0.
    a = np.zeros((rows, n + m_ub))
    a[:m_ub, :n] = a_ub
    a[:m_ub, n:] = np.eye(m_ub)
    a[m_ub:, :n] = a_eq
    b = np.concatenate([b_ub, b_eq])
    flip = b < 0
    a[flip] *= -1.0
    b = np.abs(b)
    needs_artificial = [r for r in range(rows) if r >= m_ub or flip[r]]
    width = n + m_ub + len(needs_artificial)
    tableau = np.zeros((rows + 1, width + 1))
    tableau[:rows, :n + m_ub] = a
    tableau[:rows, -1] = b
    basis = [n + r for r in range(rows)]
    for k, r in enumerate(needs_artificial):
        tableau[r, n + m_ub + k] = 1.0
        basis[r] = n + m_ub + k
    # Phase 1: minimise the sum of the artificials.
    if needs_artificial:
        tableau[-1, n + m_ub:width] = 1.0
        for r in needs_artificial:
            tableau[-1] -= tableau[r]
        _simplex(tableau, basis, width, tolerance, max_pivots)
        if -tableau[-1, -1] > tolerance * max(1.0, float(np.abs(b).max(initial=0.0))) * 1e3:
            return LpResult("infeasible")
        for r in range(rows):  # drive artificials at level zero out of the basis where possible
            if basis[r] >= n + m_ub:
                candidates = np.flatnonzero(np.abs(tableau[r, :n + m_ub]) > 1e-7)
                if candidates.size:
                    _pivot(tableau, r, int(candidates[0]))
                    basis[r] = int(candidates[0])
    # Phase 2: the real objective over the real columns (artificial columns can no longer enter).
    tableau[-1] = 0.0
    tableau[-1, :n] = c
    for r, column in enumerate(basis):
        if column < n + m_ub and tableau[-1, column] != 0.0:
            tableau[-1] -= tableau[-1, column] * tableau[r]
    if _simplex(tableau, basis, n + m_ub, tolerance, max_pivots) == "unbounded":
        return LpResult("unbounded")
    x = np.zeros(width)
    for r, column in enumerate(basis):
        x[column] = tableau[r, -1]
    real = [r for r, column in enumerate(basis) if column < n + m_ub]
    if len(real) == rows:  # recompute the basic solution from the original rows (pivoting drifts)
        try:
            x[basis] = np.linalg.solve(a[:, basis], b)
        except np.linalg.LinAlgError:
            pass
    x = np.maximum(x[:n], 0.0)
    scale = 1e-6 * max(1.0, float(np.abs(np.concatenate([b_ub, b_eq])).max(initial=0.0)))
    if (m_ub and (a_ub @ x - b_ub).max() > scale) or (m_eq and np.abs(a_eq @ x - b_eq).max() > scale):
        raise RuntimeError("simplex returned a point that violates the constraints (numerical trouble)")
    return LpResult("optimal", x, float(c @ x))
