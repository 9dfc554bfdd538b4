"""POST /v1/embeddings (docs/server.md, "Embeddings"): each input's embedding is the mean
over its positions of the model's head input (the final norm's output) at the request's
loop depth, `Model.embed` (C: tl_embed), scaled to unit length unless the request asks
otherwise. A language model's pooled states, not a trained embedding model's: they
serve similarity search within one model and depth, and are no match for a model
trained for embeddings.
"""

from __future__ import annotations

import base64
import numbers

import numpy as np

from ..errors import TinyLoopError
from .api import (RequestError, _is_token_list, _number, check_fields, check_model, flag_field,
                  prompt_token_ids)

EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user",
                    # TinyLoop extensions
                    "depth", "normalize"}
MAX_INPUTS = 256


class EmbeddingRequest:
    def __init__(self, inputs: list, depth: int, normalize: bool, base64_format: bool, model: str):
        self.inputs, self.depth, self.normalize = inputs, depth, normalize
        self.base64, self.model = base64_format, model


def embedding_request(body, model, served, strict: bool = True) -> EmbeddingRequest:
    check_fields(body, EMBEDDING_FIELDS, strict)
    name = check_model(body, served)
    info = model.info
    raw = body.get("input")
    if isinstance(raw, str) or (_is_token_list(raw) and raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise RequestError("input must be a non-empty string, a list of token ids, or a list of those",
                           "input")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input holds {len(items)} items; at most {MAX_INPUTS} are accepted", "input")
    inputs = []
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 and item is raw else f"input[{i}]"
        if isinstance(item, numbers.Integral):
            raise RequestError(f"{param} must be a string or a list of token ids", param)
        ids = prompt_token_ids(item, model, param)
        if len(ids) > info.max_seq_len:
            raise RequestError(f"{param} has {len(ids)} tokens; the model's context is {info.max_seq_len}",
                               param, code="context_length_exceeded")
        inputs.append(ids)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError('encoding_format must be "float" or "base64"', "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and dims != info.d_model:
        raise RequestError(f"dimensions: this model's embeddings have {info.d_model} (no other size is "
                           f"made)", "dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user must be a string", "user")
    depth = _number(body, "depth", 0, lo=0, hi=max(info.max_depth, 0), integer=True)
    return EmbeddingRequest(inputs, depth, flag_field(body, "normalize", True), fmt == "base64", name)


def embed(engine, request: EmbeddingRequest, cancelled=None) -> dict:
    """The response body (run in a worker thread; `cancelled()` is asked between inputs)."""
    data = []
    for i, ids in enumerate(request.inputs):
        if cancelled is not None and cancelled():
            raise RequestError("cancelled", status=499)
        try:
            vector = engine.model.embed(ids, depth=request.depth).astype(np.float32)
        except TinyLoopError as e:
            raise RequestError(str(e), "input") from None
        if request.normalize:
            norm = float(np.linalg.norm(vector))
            if norm > 0:
                vector = vector / norm
        value = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if request.base64
                 else [float(v) for v in vector])
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(ids) for ids in request.inputs)
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
