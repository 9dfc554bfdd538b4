"""The logit lens as rows a person or a client reads: Model.score_logit_lens gives the
logits after the last token at every loop depth; each row here is one depth's most
likely tokens with their log-probabilities and the distribution's entropy. Shared by
`tinyloop score --logit-lens` and the server's /tinyloop/score."""

from __future__ import annotations

from typing import Callable

import numpy as np


def lens_rows(logits: np.ndarray, top: int, text: Callable[[int], str | None]) -> list:
    """[{"depth", "entropy", "top_logprobs": [{"token", "text", "logprob"}, ...]}, ...], one
    per row of `logits` ([depths, vocab], row d-1 = depth d), best token first (the lower
    id first on ties); `text(token)` names each token."""
    rows = []
    for d, row in enumerate(np.asarray(logits, dtype=np.float64), 1):
        shifted = row - row.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        best = np.argsort(-logprobs, kind="stable")[:top]
        rows.append({"depth": d, "entropy": float(-(np.exp(logprobs) * logprobs).sum()),
                     "top_logprobs": [{"token": int(t), "text": text(int(t)), "logprob": float(logprobs[t])}
                                      for t in best]})
    return rows
