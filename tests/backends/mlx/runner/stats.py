"""Statistics the sampling tests share."""

from __future__ import annotations

import numpy as np
import torch


def chi2_pvalue(a: list, b: list) -> float:
    """p-value of Pearson's chi-square test that samples a and b share one distribution;
    categories expected fewer than 5 times in either are pooled."""
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    rare = expected.min(0) < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
