"""Adaptive depth (docs/model.md, "Adaptive depth"): per-token exit rules in scoring and
decoding, checked against the float64 oracle given the depths the library reports.

The oracle takes each position's depth and fills the K/V slots of the iterations a
position skipped with its last iteration's (the policy the library implements), so for
every rule: scoring with the rule == the oracle at the reported depths; one-token cached
decode with the rule == full scoring with the depths decode reported; and the reported
depths are the ones the rule's own statistic asks for (checked from the oracle's states)."""

import numpy as np
import pytest

import tinyloop
from device import DEVICE, ON_CPU
from reference.ops import next_token_logprobs
from test_parity import (DEVICE_TOLERANCE, TOLERANCES, arithmetic, assert_close, case_config,
                         case_tokens)

KINDS = {"fixed": 0, "kl": 1, "entropy_delta": 2, "latent_delta": 3, "argmax_stable": 4, "gate": 5}
# thresholds at which the random models stop some tokens early and not others
RULES = [("latent_delta", 0.1, 1, 0), ("latent_delta", 0.05, 2, 0), ("kl", 1e-3, 1, 0), ("kl", 1e-4, 2, 0),
         ("entropy_delta", 0.05, 1, 0), ("argmax_stable", 0.0, 1, 3)]
CASES = ["base", "injection-concat", "init-noise", "loop_norm", "sandwich_outer", "q4-g32", "huginn-q4",
         "init-warm"]


def tolerance(config):
    return DEVICE_TOLERANCE if not ON_CPU else TOLERANCES[arithmetic(config)]


def score(model, tokens, depth, rule=None, given=None):
    """(logprobs, depths) through tl_score with the rule or the given depths."""
    native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_score_options *")
    native.lib.tl_score_options_default(opts)
    opts.depth = depth
    if rule is not None:
        kind, threshold, min_depth, patience = rule
        opts.exit.kind, opts.exit.threshold = KINDS[kind], threshold
        opts.exit.min_depth, opts.exit.patience = min_depth, patience
    ids = np.ascontiguousarray(tokens, dtype=np.int32)
    keep = []
    if given is not None:
        given = np.ascontiguousarray(given, dtype=np.int32)
        keep.append(given)
        opts.given_depths = ffi.from_buffer("int32_t[]", given)
    logprobs = np.empty(len(ids) - 1, dtype=np.float32)
    depths = np.zeros(len(ids), dtype=np.int32)
    opts.depths = ffi.from_buffer("int32_t[]", depths, require_writable=True)
    native.check(native.lib.tl_score(model._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), opts,
                                     ffi.from_buffer("float[]", logprobs, require_writable=True)))
    return logprobs, depths


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r[0]}-{r[1]}-min{r[2]}")
def test_scoring_with_a_rule_equals_the_oracle_at_the_depths_it_reports(files, name, rule):
    config = case_config(name)
    depth = config["max_depth"]
    tokens = case_tokens(config)
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        logprobs, depths = score(model, tokens, depth, rule)
    assert depths.min() >= max(rule[2], 1) and depths.max() <= depth
    expected = next_token_logprobs(files.reference(name).logits(tokens, depth, depths=depths), tokens)
    assert_close(logprobs, expected, tolerance(config), f"{name} {rule}")


@pytest.mark.parametrize("name", ["loop_norm", "init-warm"])
def test_some_tokens_exit_early_and_the_rule_decides_from_the_states(files, name):
    """latent_delta's depths: a position stops at the first iteration >= min_depth whose
    relative change of the state is below the threshold (the oracle's states)."""
    config = case_config(name)
    depth, threshold = config["max_depth"], 0.1
    tokens = case_tokens(config)
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        _, depths = score(model, tokens, depth, ("latent_delta", threshold, 1, 0))
    assert 1 <= depths.min() < depths.max(), depths   # the random models give several depths
    states = files.reference(name).iteration_states(tokens, depth, depths=depths)
    for p, stopped in enumerate(depths):
        change = [np.linalg.norm(states[i, p] - states[i - 1, p]) / np.linalg.norm(states[i, p])
                  for i in range(1, depth + 1)]
        first = next((i + 1 for i, c in enumerate(change[:depth - 1]) if c < threshold), depth)
        margin = abs(change[min(stopped, depth) - 1] - threshold)
        if margin > 1e-4:   # a change at the threshold itself may round either way
            assert stopped == first, (p, stopped, first, change)


def generate(model, prompt, depth, rule, max_tokens):
    """Greedy tl_generate with the rule: (tokens, each token's pass's depth, mean depth)."""
    native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_generate_options *")
    native.lib.tl_generate_options_default(opts)
    opts.max_tokens, opts.depth, opts.temperature, opts.eos_token = max_tokens, depth, 0.0, -2
    kind, threshold, min_depth, patience = rule
    opts.exit.kind, opts.exit.threshold, opts.exit.min_depth, opts.exit.patience = \
        KINDS[kind], threshold, min_depth, patience
    depths = np.zeros(max_tokens, dtype=np.int32)
    opts.token_depths = ffi.from_buffer("int32_t[]", depths, require_writable=True)
    out = np.zeros(max_tokens, dtype=np.int32)
    result = ffi.new("tl_generate_result *")
    native.lib.tl_generate_result_default(result)
    ids = np.ascontiguousarray(prompt, dtype=np.int32)
    native.check(native.lib.tl_generate(model._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), opts,
                                        ffi.from_buffer("int32_t[]", out, require_writable=True), max_tokens,
                                        result))
    n = result.n_tokens
    return out[:n], depths[:n], result.mean_depth


@pytest.mark.parametrize("name", ["base", "injection-concat", "loop_norm", "q4-g32", "init-warm"])
@pytest.mark.parametrize("rule", [RULES[0], RULES[2], RULES[3], RULES[5]], ids=lambda r: f"{r[0]}-{r[1]}")
def test_cached_decode_with_a_rule_equals_full_scoring_at_its_depths(files, name, rule):
    """Greedy decoding with the rule, one cached position at a time: its tokens are the
    argmax of the oracle's logits at the depths every position ran (the prompt's from
    scoring it with the same rule), and full scoring at those depths gives them too."""
    config = case_config(name)
    depth = config["max_depth"]
    prompt = case_tokens(config)[:6]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        tokens, depths, mean = generate(model, prompt, depth, rule, 12)
        _, prompt_depths = score(model, prompt, depth, rule)
        assert depths[0] == prompt_depths[-1]
        sequence = np.concatenate([prompt, tokens[:-1]])
        given = np.concatenate([prompt_depths[:-1], depths])
        logprobs, again = score(model, sequence, depth, given=given)
    assert list(again) == list(given) and abs(mean - depths.mean()) < 1e-9
    logits = files.reference(name).logits(sequence, depth, depths=given)
    assert list(np.argmax(logits[len(prompt) - 1:], axis=1)) == list(tokens)
    assert_close(logprobs, next_token_logprobs(logits, sequence), tolerance(config), f"{name} {rule}")


@pytest.mark.parametrize("name", ["base", "loop_norm", "q4-g32"])
def test_streams_stepped_together_exit_as_they_would_alone(files, name):
    """tl_stream_next_batch over streams with different rules (and one fixed): each gives
    the tokens and depths of its own generation; the rows that exit drop out of the
    batch's later iterations."""
    config = case_config(name)
    depth = config["max_depth"]
    tokens = case_tokens(config)
    prompts = [tokens[:3], tokens[2:8], tokens[1:2], tokens[5:9]]
    rules = [RULES[2], ("fixed", 0.0, 0, 0), RULES[5], RULES[3]]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        alone = [generate(model, p, depth, r, 10)[:2] for p, r in zip(prompts, rules)]
        native, ffi = model._native, model._native.ffi
        streams, keep = [], []
        for p, rule in zip(prompts, rules):
            opts = ffi.new("tl_generate_options *")
            native.lib.tl_generate_options_default(opts)
            opts.max_tokens, opts.depth, opts.temperature, opts.eos_token = 10, depth, 0.0, -2
            opts.exit.kind, opts.exit.threshold, opts.exit.min_depth, opts.exit.patience = \
                KINDS[rule[0]], rule[1], rule[2], rule[3]
            ids = np.ascontiguousarray(p, dtype=np.int32)
            keep.append((opts, ids))
            out = ffi.new("tl_stream **")
            native.check(native.lib.tl_stream_start(model._require_open(), ffi.NULL, ffi.from_buffer("int32_t[]", ids),
                                                    len(ids), opts, out))
            streams.append(out[0])
        got = [([], []) for _ in streams]
        n = len(streams)
        arr = ffi.new("tl_stream *[]", streams)
        toks, reasons, statuses = ffi.new("int32_t[]", n), ffi.new("tl_stop_reason[]", n), ffi.new("tl_status[]", n)
        depth_out = ffi.new("int32_t *")
        try:
            for _ in range(10):
                native.check(native.lib.tl_stream_next_batch(arr, n, toks, reasons, statuses))
                for i in range(n):
                    assert statuses[i] == 0
                    if toks[i] >= 0:
                        native.check(native.lib.tl_stream_token_depth(streams[i], depth_out))
                        got[i][0].append(toks[i])
                        got[i][1].append(depth_out[0])
        finally:
            for st in streams:
                native.lib.tl_stream_free(st)
    for (tokens_alone, depths_alone), (tokens_batch, depths_batch) in zip(alone, got):
        assert list(tokens_alone) == tokens_batch
        assert list(depths_alone) == depths_batch


@pytest.mark.parametrize("options,ring", [({"kv_page_size": 4, "prefill_chunk": 5}, None),
                                          ({"kv_policy": "share_last"}, 1), ({"kv_policy": "ring", "kv_ring_slots": 2}, 2)],
                         ids=["paged", "share_last", "ring2"])
def test_exits_under_paged_and_shared_kv(files, options, ring):
    """The skipped slots are filled through a page table, and under a policy that shares
    loop slots the exited token's last K/V stands in the slots its later iterations map to;
    decoding a sequence is a call per token (docs/model.md)."""
    name = "base"
    config = case_config(name)
    depth = config["max_depth"]
    prompt = case_tokens(config)[:6]
    with tinyloop.Model(files.path(name), device=DEVICE, **options) as model:
        tokens, depths, _ = generate(model, prompt, depth, RULES[2], 10)
        _, prompt_depths = score(model, prompt, depth, RULES[2])
        sequence = np.concatenate([prompt, tokens[:-1]])
        given = np.concatenate([prompt_depths[:-1], depths])
    calls = [len(prompt)] + [1] * (len(tokens) - 1) if "prefill_chunk" not in options else \
        [5, 1] + [1] * (len(tokens) - 1)
    logits = files.reference(name).logits(sequence, depth, kv_ring=ring, calls=calls if ring else None,
                                          depths=given)
    assert list(np.argmax(logits[len(prompt) - 1:], axis=1)) == list(tokens)


def test_bad_rules_are_refused_by_name(files):
    config = case_config("base")
    tokens = case_tokens(config)[:8]
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        for rule, words in [(("gate", 0.9, 1, 0), "exit gate"), (("kl", -1.0, 1, 0), "threshold"),
                            (("kl", float("nan"), 1, 0), "threshold")]:
            with pytest.raises(tinyloop.TinyLoopError, match=words):
                score(model, tokens, config["max_depth"], rule)
        with pytest.raises(tinyloop.TinyLoopError, match="given depth"):
            score(model, tokens, config["max_depth"], given=np.full(len(tokens), config["max_depth"] + 1))
    with tinyloop.Model(files.path("plain-llama"), device=DEVICE) as model:
        with pytest.raises(tinyloop.TinyLoopError, match="no loop"):
            score(model, case_tokens(case_config("plain-llama"))[:8], 0, ("kl", 0.1, 1, 0))
