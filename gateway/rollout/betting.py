"""Anytime-valid one-sided tests of a bounded mean by betting (an e-process per test).

H0: E[X | past] <= m for X >= `lower`. A gambler who bets a fixed fraction `lam` of their
wealth on X - m holds wealth prod_i (1 + lam (X_i - m)); under H0 that product is a
nonnegative supermartingale (1 + lam (X - m) >= 0 when lam <= 1 / (m - lower)), so by Ville's
inequality it ever reaches 1/alpha with probability at most alpha, however often it is looked
at. The e-process here is the average of such wealths over a fixed grid of bets (an average of
test supermartingales is one): Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting", JRSS-B 2023 (the grid mixture is their Section 5 "hedged" idea without
prediction); Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform, nonparametric,
nonasymptotic confidence sequences", Annals of Statistics 2021 (the same guarantee by
mixture boundaries); Lindon, Sanden and Shirikian, KDD 2022 (anytime-valid tests in
deployment canaries).

Why a fixed grid rather than a predictable, adaptive bet: with constant bets, a test's state is
one sum of log(1 + lam_j (X_i - m)) per bet, which does not depend on the order of the
samples. Replicas of the gateway each add their own samples' increments to one shared sum
(gateway/rollout/store.py), and a restarted gateway carries on from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the bets, as fractions of the largest bet the null allows (1 / (m - lower))
BET_FRACTIONS: tuple[float, ...] = (0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.4, 0.6, 0.9)


@dataclass(frozen=True)
class MeanTest:
    """H0: the mean of X is at most `null_mean`, for X never below `lower`."""

    null_mean: float
    lower: float

    def __post_init__(self) -> None:
        if not self.null_mean > self.lower:
            raise ValueError("the null mean must lie above the variable's lower bound")

    @property
    def bets(self) -> np.ndarray:
        """(J,) the fixed bets lam_j."""
        return np.asarray(BET_FRACTIONS) / (self.null_mean - self.lower)

    def increments(self, x: np.ndarray) -> np.ndarray:
        """(T, J) log-wealth increments log(1 + lam_j (x_t - m)) of the samples `x` (T,)."""
        x = np.asarray(x, dtype=float).reshape(-1, 1)
        return np.log1p((x - self.null_mean) * self.bets)


def log_e_value(log_wealth: np.ndarray) -> np.ndarray:
    """The log of the grid-average e-value from the per-bet log-wealths (..., J)."""
    log_wealth = np.asarray(log_wealth, dtype=float)
    top = log_wealth.max(axis=-1, keepdims=True)
    mean = np.exp(log_wealth - top).mean(axis=-1)
    return np.squeeze(top, axis=-1) + np.log(mean)


def num_bets() -> int:
    return len(BET_FRACTIONS)
