"""POST /tinyloop/score (docs/server.md, "Depth scoring"): TinyLoop's looped-model scoring
calls, which have no OpenAI endpoint, as one extension endpoint. `method` picks the call:

- "logit_lens": `Model.score_logit_lens`, the next-token distribution after the input at
  every loop depth 1..max_depth, each depth's most likely tokens;
- "consistency_escalation": `Model.score_with_consistency_escalation`, the input scored
  at deeper and deeper depths until the greedy predictions settle, with the depth it
  stopped at and each position's log-probability and entropy there.
"""

from __future__ import annotations

import numpy as np

from ..errors import TinyLoopError
from ..logit_lens import lens_rows
from .api import (RequestError, _number, check_fields, check_model, prompt_token_ids,
                  token_text)

METHODS = ("logit_lens", "consistency_escalation")
SCORE_FIELDS = {"model", "input", "method", "max_depth", "top_logprobs",   # logit_lens
                "min_depth", "max_changed"}                               # + consistency_escalation
_ESCALATION_ONLY = ("min_depth", "max_changed")
_MAX_TOP = 20


class ScoreRequest:
    def __init__(self, method: str, ids: list, options: dict, model: str):
        self.method, self.ids, self.options, self.model = method, ids, options, model

    @property
    def depth(self) -> int:
        """The deepest depth the request may run (for the access log)."""
        return self.options["max_depth"]


def score_request(body, model, served, strict: bool = True) -> ScoreRequest:
    check_fields(body, SCORE_FIELDS, strict)
    name = check_model(body, served)
    method = body.get("method")
    if method not in METHODS:
        raise RequestError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}",
                           "method")
    info = model.info
    if info.n_core == 0:
        raise RequestError("this model has no loop: there are no depths to score", "method")
    ids = prompt_token_ids(body.get("input"), model, "input")
    if len(ids) > info.max_seq_len:
        raise RequestError(f"input has {len(ids)} tokens; the model's context is {info.max_seq_len}",
                           "input", code="context_length_exceeded")
    deepest = max(info.max_depth, 1)
    if method == "logit_lens":
        given = [f for f in _ESCALATION_ONLY if f in body]
        if given:
            raise RequestError(f"{given[0]} applies to method 'consistency_escalation'", given[0])
        options = {"max_depth": _number(body, "max_depth", 0, lo=0, hi=deepest, integer=True) or deepest,
                   "top": _number(body, "top_logprobs", 5, lo=1, hi=_MAX_TOP, integer=True)}
        return ScoreRequest(method, ids, options, name)
    if "top_logprobs" in body:
        raise RequestError("top_logprobs applies to method 'logit_lens'", "top_logprobs")
    if len(ids) < 2:
        raise RequestError("consistency_escalation scores predictions: input needs at least 2 tokens",
                           "input")
    options = {"min_depth": _number(body, "min_depth", 1, lo=1, hi=deepest, integer=True),
               "max_depth": _number(body, "max_depth", 0, lo=0, hi=deepest, integer=True)
               or info.default_depth,
               "max_changed": _number(body, "max_changed", 0.05, lo=0.0, hi=1.0)}
    if options["min_depth"] > options["max_depth"]:
        raise RequestError(f"min_depth {options['min_depth']} is above max_depth {options['max_depth']}",
                           "min_depth")
    return ScoreRequest(method, ids, options, name)


def score(engine, request: ScoreRequest) -> dict:
    """The response body (run in a worker thread)."""
    model = engine.model
    try:
        if request.method == "logit_lens":
            logits = model.score_logit_lens(request.ids, max_depth=request.options["max_depth"])
            tokenizer = _tokenizer(model)
            body = {"object": "tinyloop.logit_lens",
                    "depths": lens_rows(logits, request.options["top"],
                                        lambda t: None if tokenizer is None else token_text(tokenizer, t)[0])}
        else:
            o = request.options
            logprobs, entropies, depth = model.score_with_consistency_escalation(
                request.ids, min_depth=o["min_depth"], max_depth=o["max_depth"], max_changed=o["max_changed"])
            body = {"object": "tinyloop.consistency_escalation", "depth": depth,
                    "perplexity": float(np.exp(-np.mean(logprobs, dtype=np.float64))),
                    "logprobs": [float(v) for v in logprobs], "entropies": [float(v) for v in entropies]}
    except TinyLoopError as e:
        raise RequestError(str(e), "input") from None
    n = len(request.ids)
    return dict(body, model=request.model, usage={"prompt_tokens": n, "total_tokens": n})


def _tokenizer(model):
    """The model's tokenizer, or None for a file without one (token ids only)."""
    try:
        return model.tokenizer
    except TinyLoopError:
        return None
