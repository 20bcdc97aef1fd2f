"""Statistics for sampler tests: a two-sample chi-square test of equal distributions."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Two-sample chi-square test that ``a`` and ``b`` (counts per outcome) come from one distribution.

    Returns ``(statistic, degrees of freedom, p-value)``. Outcomes whose expected count is below
    ``min_expected`` in either sample are pooled into one cell (a coarser partition keeps the test valid).
    The p-value is the chi-square survival function, ``Q(dof / 2, stat / 2)`` (regularised upper gamma).
    """
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ValueError(f"chi_square_homogeneity: both samples need outcomes, got {na} and {nb}")
    n = na + nb
    cells, pooled = [], [0, 0]
    for key in sorted(set(a) | set(b)):
        ca, cb = a.get(key, 0), b.get(key, 0)
        tot = ca + cb
        if min(tot * na / n, tot * nb / n) < min_expected:
            pooled[0] += ca
            pooled[1] += cb
        else:
            cells.append((ca, cb))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        for c, ns in ((ca, na), (cb, nb)):
            e = tot * ns / n
            stat += (c - e) ** 2 / e
    dof = len(cells) - 1
    if dof < 1:
        return stat, dof, 1.0
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p
