"""The exit gate of a looped model (docs/model.md, "Exit gate"): what `score_exit_gate`
returns, with the exit distribution and the checkpoint's exit rule applied to it.

The runtime itself runs every token at the sequence's fixed depth; these values show where a
per-token exit rule (Ouro's "first step whose CDF reaches the threshold") would stop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EXIT_RULES = ("none", "cdf_threshold")


@dataclass(frozen=True)
class ExitGate:
    """lam[i, t]: sigmoid of the gate after iteration t + 1 at position i (float32, [n, depth])."""

    lam: np.ndarray
    rule: str = "none"
    threshold: float = 1.0

    @property
    def p(self) -> np.ndarray:
        """p[i, t] = lam_t prod_{j<t} (1 - lam_j) for t < depth - 1; the last step takes the
        remainder, so every row sums to 1 (float64)."""
        lam = self.lam.astype(np.float64)
        survive = np.concatenate([np.ones((lam.shape[0], 1)), np.cumprod(1.0 - lam, axis=1)[:, :-1]],
                                 axis=1)
        p: np.ndarray = lam * survive
        p[:, -1] = survive[:, -1]
        return p

    @property
    def cdf(self) -> np.ndarray:
        """cdf[i, t] = p[i, 0] + ... + p[i, t] (float64; the last column is 1)."""
        cdf: np.ndarray = np.cumsum(self.p, axis=1)
        return cdf

    def exit_steps(self, threshold: float | None = None) -> np.ndarray:
        """Per position, the 1-based iteration the `cdf_threshold` rule exits at: the first
        whose CDF is >= threshold (default: the file's), else the last. The runtime does not
        apply it (every token runs the full depth); with threshold 1 it is the last step
        unless a CDF reaches 1 exactly."""
        t = self.threshold if threshold is None else float(threshold)
        reached = self.cdf >= t
        reached[:, -1] = True
        steps: np.ndarray = (np.argmax(reached, axis=1) + 1).astype(np.int32)
        return steps
