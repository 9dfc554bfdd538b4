"""The library's test-only sampling entry point (libtinyloop/src/testing/testing.h,
declared in testing_hooks.py: its contexts are the testing library's), and the logit rows
and sampler settings the sampling tests run through it."""

import numpy as np

from testing_hooks import hooks_of
from tinyloop.model import _GenerateOptions


def sample_rows(ctx, rows, *, history=(), first_step=0, use_op=True, **options):
    """The tokens a generation on ctx's backend picks from each row of `rows` (n x V),
    row i as its (first_step + i)-th sampled step: through the backend's sample op
    (use_op) or the host sampler."""
    model = ctx._model
    native = model._native
    ffi, lib = hooks_of(native)
    rows = np.ascontiguousarray(np.atleast_2d(rows), dtype=np.float32)
    hist = np.ascontiguousarray(history, dtype=np.int32)
    out = np.full(rows.shape[0], -1, dtype=np.int32)
    opts = _GenerateOptions(model, **options)
    native.check(lib.tl_testing_sample_rows(
        ctx._require_open(), ffi.from_buffer("float[]", rows), rows.shape[0], rows.shape[1],
        opts.c, ffi.from_buffer("int32_t[]", hist), len(hist), first_step, 1 if use_op else 0,
        ffi.from_buffer("int32_t[]", out, require_writable=True)))
    return out


def logit_rows(seed, vocab, n):
    """n rows of varied shape: smooth and peaked, heavy ties, infinities, NaN, signed
    zeros, huge values and rows with nothing finite."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = i % 8
        scale = (0.3, 2.0, 8.0)[i % 3]
        x = rng.normal(0.0, scale, vocab).astype(np.float32)
        if kind == 1:    # ties everywhere
            x = np.round(x * 2.0).astype(np.float32) / np.float32(2.0)
        elif kind == 2:  # one or two tokens far ahead
            x[rng.integers(0, vocab, 2)] += np.float32(40.0)
        elif kind == 3:  # masked tokens and NaN
            x[rng.random(vocab) < 0.3] = -np.inf
            x[rng.random(vocab) < 0.05] = np.nan
        elif kind == 4:  # signed zeros and exact ties at the top
            x[rng.random(vocab) < 0.5] = np.float32(-0.0)
            x[rng.random(vocab) < 0.2] = np.float32(0.0)
        elif kind == 5:  # a +inf, huge finite values
            x[rng.integers(0, vocab)] = np.float32(3e38) if i % 16 == 5 else np.inf
            x[rng.integers(0, vocab)] = np.float32(-3e38)
        elif kind == 6 and i % 16 == 6:   # nothing finite
            x[:] = -np.inf
            x[rng.random(vocab) < 0.3] = np.nan
        elif kind == 7:  # NaN at index 0
            x[0] = np.nan
        rows.append(x)
    return np.stack(rows)


# Sampler settings, each a dict of generate() options.
SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=2.5, top_k=0, top_p=0.9, min_p=0.2),
    dict(temperature=1.0, top_k=0, top_p=0.01, min_p=0.0),
    dict(temperature=0.05, top_k=0, top_p=1.0, min_p=0.5),
    dict(temperature=1e-30, top_k=3, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=100000, top_p=0.99, min_p=0.01),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, repetition_penalty=1.3,
         repetition_window=16),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=0.6,
         repetition_window=0),
    dict(temperature=0.0, repetition_penalty=1.5, repetition_window=0),
    dict(temperature=0.0),
]

# Settings for whole generations (a repetition window shorter than the prompt, greedy
# with a penalty, which also samples through the backend's op).
GENERATION_SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.2, top_k=8, top_p=0.9, min_p=0.0, repetition_penalty=1.4,
         repetition_window=6),
    dict(temperature=0.0, repetition_penalty=2.0, repetition_window=0),
]

# generate()'s defaults, for the fields a setting leaves out
DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.0,
                repetition_window=64)


def reference_tokens(reference, rows, settings, *, history=(), seed=0, first_step=0):
    """What tests/reference/sampling.py picks for rows as sample_rows() steps."""
    full = {**DEFAULTS, **settings}
    generator = reference.Generator(seed)
    sampled = full["temperature"] > 0
    for _ in range(first_step if sampled else 0):
        generator.next()
    return [reference.sample(row, history=history, random=generator.next() if sampled else 0,
                             **full) for row in rows]
