"""Self-speculative decoding (draft_depth / n_draft). Greedy: the tokens are plain greedy
decoding's for every architecture option, draft depth and draft length; the context ends
as plain decoding leaves it; stops, streams and bad options behave. Sampling: with a
penalty at temperature 0 the tokens are plain decoding's; at temperature > 0 they follow
plain sampling's distribution (a test of counts against the exact distribution).

Why equality is exact here: the drafts only propose, and every returned token is the
argmax of a pass at the full depth. That pass scores several rows at once where plain
decoding runs one row per step, so the two could differ only where two logits tie within
float rounding; these seeded models have no such tie (the test would say so, always).

The models have untied output heads: with the head tied to a random embedding, the
residual stream is close to the input token's embedding and greedy decoding repeats that
token forever, so every draft would be kept and the rejection path never run."""

import numpy as np
import pytest

import tinyloop
from test_draft_vocab import with_frequencies
from test_parity import DEVICE, ON_CPU, case_config
from tinyloop import default_model
from tinyloop.default_model import DEFAULT_MODEL_NAME
from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import copy_file

# loop options that change what a draft shares with the full pass: warm and noise state
# init, concat injection, loop norm, no coda, two codas, a sliding window, quantized weights
CASES = ["base", "init-warm", "init-noise", "injection-concat", "injection-none", "loop_norm",
         "sliding_window", "core2-no-coda", "coda2", "q4-g32", "huginn-q4", "warm-window-q8"]
PROMPT = [5, 17, 3, 88, 41, 9]
GREEDY = dict(temperature=0, eos=False)


def model_file(model_dir, name, tied=False):
    path = model_dir / f"{name}{'-tied' if tied else ''}.tinyloop"
    if not path.exists():
        make_random_model(path, **{**case_config(name), "tied_embeddings": int(tied)})
    return path


@pytest.mark.parametrize("name,tied", [(name, False) for name in CASES] + [("base", True)])
def test_speculative_tokens_are_plain_greedy_tokens(model_dir, name, tied):
    config = case_config(name)
    depth = config["max_depth"]
    with tinyloop.Model(model_file(model_dir, name, tied), device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=30, depth=depth, **GREEDY)
        assert plain.drafted_tokens == 0
        for draft_depth in range(1, depth + 1):
            for n_draft in (1, 3, 8):
                spec = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=draft_depth,
                                      n_draft=n_draft, **GREEDY)
                label = f"{name}: draft depth {draft_depth}, {n_draft} drafts"
                assert spec.tokens == plain.tokens, label
                assert spec.stop_reason == plain.stop_reason == "max_tokens", label
                assert 0 <= spec.accepted_tokens <= spec.drafted_tokens, label
                assert spec.drafted_tokens > 0, label
                if draft_depth == 1 and not tied:   # the rejection path did run
                    assert spec.accepted_tokens < spec.drafted_tokens, label
                if draft_depth == depth and ON_CPU:   # the draft is the full pass itself
                    assert spec.accepted_tokens == spec.drafted_tokens, label


def _first_new_token_at(tokens, start):
    """The first index >= start whose token does not occur before it."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    pytest.fail(f"no new token from index {start} on in {tokens}")


@pytest.mark.parametrize("name", ["init-warm", "huginn-q4"])
@pytest.mark.parametrize("stop", ["max_tokens", "stop_sequence", "eos", "stream_closed"])
def test_context_ends_as_plain_decoding_leaves_it(model_dir, name, stop):
    """After the generation the context holds what plain decoding's would (the prompt and
    every generated token but a last one that was never fed), so a continuation is the
    same; the stop falls inside a round of drafts."""
    path = model_file(model_dir, name)
    depth = case_config(name)["max_depth"]
    with tinyloop.Model(path, device=DEVICE) as model:
        reference = model.generate(PROMPT, max_tokens=20, depth=depth, **GREEDY).tokens
        options = dict(max_tokens=20, depth=depth, temperature=0, eos=False)
        if stop == "stop_sequence":
            at = _first_new_token_at(reference, 4)
            options.update(stop=[reference[at - 1:at + 1]])
        elif stop == "eos":
            options.update(eos=reference[_first_new_token_at(reference, 5)])
        ends = []
        for speculative in (False, True):
            extra = dict(draft_depth=1, n_draft=6) if speculative else {}
            with model.context() as ctx:
                if stop == "stream_closed":   # the consumer stops pulling after 5 tokens
                    stream = ctx.stream(PROMPT, **options, **extra)
                    tokens = [next(stream) for _ in range(5)]
                    stream.close()
                    reason, drafted = "stream_closed", None
                else:
                    result = ctx.generate(PROMPT, **options, **extra)
                    tokens, reason, drafted = result.tokens, result.stop_reason, result.drafted_tokens
                length = len(ctx)
                follow = ctx.append([int(reference[0])])
            ends.append((tokens, reason, length, follow, drafted))
        (plain_tokens, plain_stop, plain_len, plain_next, _), (tokens, reason, length, follow, drafted) = ends
        assert reason == plain_stop == stop
        assert tokens == plain_tokens and len(tokens) >= 5
        assert drafted is None or drafted > 0
        assert length == plain_len
        np.testing.assert_allclose(follow, plain_next, rtol=1e-5, atol=1e-5)


def test_context_full(model_dir):
    """Drafts never run past the context: generation stops at the same token, for the same
    reason, as plain decoding."""
    path = model_file(model_dir, "base")
    with tinyloop.Model(path, device=DEVICE, max_seq_len=20) as model:
        plain = model.generate(PROMPT, max_tokens=40, **GREEDY)
        spec = model.generate(PROMPT, max_tokens=40, draft_depth=1, n_draft=8, **GREEDY)
    assert plain.stop_reason == spec.stop_reason == "context_full"
    assert spec.tokens == plain.tokens and len(spec.tokens) == 20 - len(PROMPT) + 1


def test_stream_yields_the_same_tokens_and_counts(model_dir):
    path = model_file(model_dir, "huginn-q4")
    with tinyloop.Model(path, device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=25, **GREEDY)
        with model.stream(PROMPT, max_tokens=25, draft_depth=1, n_draft=4, **GREEDY) as stream:
            tokens = list(stream)
        assert tokens == plain.tokens
        result = stream.result
        assert result.tokens == plain.tokens and result.drafted_tokens > 0
        assert result.acceptance_rate == result.accepted_tokens / result.drafted_tokens


def test_bad_speculative_options(model_dir):
    looped = model_file(model_dir, "base")
    dense = model_file(model_dir, "plain-llama")
    with tinyloop.Model(looped, device=DEVICE) as model:
        depth = case_config("base")["default_depth"]
        with pytest.raises(tinyloop.InvalidArgumentError, match="deeper than the generation's"):
            model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=depth + 1)
        with pytest.raises(ValueError, match="n_draft"):
            model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=1, n_draft=33)
        with pytest.raises(ValueError, match="draft_depth"):
            model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=-2)
        with pytest.raises(TypeError, match="draft_depth"):
            model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=1.5)
        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(ValueError, match="draft_p_min"):
                model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=1, draft_p_min=bad)
        # the model stays usable after each refusal
        assert len(model.generate(PROMPT, max_tokens=3, **GREEDY).tokens) == 3
    with tinyloop.Model(dense, device=DEVICE) as model:
        with pytest.raises(tinyloop.UnsupportedError, match="no loop"):
            model.generate(PROMPT, max_tokens=4, temperature=0, draft_depth=1)


def test_the_model_files_recommended_drafting(model_dir):
    """draft_depth -1 and n_draft 0 take the file's draft.depth and draft.n_draft (the
    depth at most the generation's); without them, 1 and 4. Out-of-range values in the
    file are format errors."""
    config = case_config("base")
    depth = config["max_depth"]
    greedy = dict(max_tokens=30, **GREEDY)
    bare = model_file(model_dir, "base")
    advised = model_dir / "advised.tinyloop"
    copy_file(bare, advised, metadata={"draft.depth": 2, "draft.n_draft": 3})

    def counts(result):
        return result.tokens, result.drafted_tokens, result.accepted_tokens

    with tinyloop.Model(advised, device=DEVICE) as model:
        chosen = model.generate(PROMPT, depth=depth, draft_depth=-1, **greedy)
        assert counts(chosen) == counts(model.generate(PROMPT, depth=depth, draft_depth=2, n_draft=3, **greedy))
        assert chosen.drafted_tokens > 0
        # n_draft alone, and a generation shallower than the advised depth
        assert counts(model.generate(PROMPT, depth=depth, draft_depth=1, **greedy)) == \
            counts(model.generate(PROMPT, depth=depth, draft_depth=1, n_draft=3, **greedy))
        assert counts(model.generate(PROMPT, depth=1, draft_depth=-1, **greedy)) == \
            counts(model.generate(PROMPT, depth=1, draft_depth=1, n_draft=3, **greedy))
    with tinyloop.Model(bare, device=DEVICE) as model:
        assert counts(model.generate(PROMPT, depth=depth, draft_depth=-1, **greedy)) == \
            counts(model.generate(PROMPT, depth=depth, draft_depth=1, n_draft=4, **greedy))
    for key, value in (("draft.depth", depth + 1), ("draft.n_draft", 33)):
        bad = model_dir / "bad-advice.tinyloop"
        copy_file(bare, bad, metadata={key: value})
        with pytest.raises(tinyloop.FormatError, match=key):
            tinyloop.Model(bad, device=DEVICE)


@pytest.mark.skipif(not ON_CPU, reason="the drafts' states exist only where one-row steps are "
                                       "not recorded (the CPU backend)")
def test_the_drafts_states_count_in_the_memory_report(model_dir):
    """A drafting stream keeps its drafts' states (2 x n_draft rows of d floats) on the
    context's backend while it is open, counted in buffers_bytes."""
    config = case_config("base")
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model, model.context() as ctx:
        ctx.append(PROMPT)
        before = model.memory_report()["buffers_bytes"]
        stream = ctx.stream([7], max_tokens=8, draft_depth=1, n_draft=5, **GREEDY)
        next(stream)
        held = model.memory_report()["buffers_bytes"] - before
        stream.close()
        assert model.memory_report()["buffers_bytes"] == before
    assert held == 2 * 5 * config["d_model"] * 4


@pytest.mark.parametrize("prefill_chunk", [1, 2, 3])
def test_rounds_longer_than_a_prefill_chunk(model_dir, prefill_chunk):
    """A round's k + 1 verification rows may exceed the context's chunk: they are then
    verified in chunks, from the start, with the same tokens."""
    depth = case_config("base")["max_depth"]
    greedy = dict(max_tokens=24, depth=depth, **GREEDY)
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model:
        plain = model.generate(PROMPT, **greedy).tokens
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE, prefill_chunk=prefill_chunk) as model:
        for draft_depth, n_draft in ((1, 4), (2, 2), (depth - 1, 8)):
            spec = model.generate(PROMPT, draft_depth=draft_depth, n_draft=n_draft, **greedy)
            assert spec.tokens == plain and spec.drafted_tokens > 0, (prefill_chunk, draft_depth, n_draft)


@pytest.mark.parametrize("name", ["base", "init-warm", "huginn-q4"])
def test_unsure_drafts_are_not_proposed(model_dir, name):
    """draft_p_min stops a round's drafting at a draft whose top token is less likely
    than it: the tokens stay plain greedy decoding's, fewer drafts are proposed as it
    rises, and at 1 none (no random model's softmax puts all its mass on one token)."""
    depth = case_config(name)["max_depth"]
    greedy = dict(max_tokens=30, depth=depth, **GREEDY)
    with tinyloop.Model(model_file(model_dir, name), device=DEVICE) as model:
        plain = model.generate(PROMPT, **greedy).tokens
        drafted = []
        for p_min in (0.0, 0.2, 0.6, 1.0):
            spec = model.generate(PROMPT, draft_depth=1, n_draft=4, draft_p_min=p_min, **greedy)
            assert spec.tokens == plain, (name, p_min)
            assert 0 <= spec.accepted_tokens <= spec.drafted_tokens, (name, p_min)
            drafted.append(spec.drafted_tokens)
        assert drafted[0] > drafted[-1] == 0 and drafted[1] > 0, drafted


SAMPLED_CASES = ["base", "init-warm", "injection-concat", "sliding_window", "coda2", "huginn-q4"]


@pytest.mark.parametrize("name", SAMPLED_CASES)
def test_penalized_greedy_drafts_give_plain_tokens(model_dir, name):
    """Temperature 0 with a repetition penalty goes through speculative sampling with
    distributions that are all on one token: acceptance and the residual must then give
    exactly plain decoding's tokens, the penalty's history included."""
    depth = case_config(name)["max_depth"]
    options = dict(temperature=0, repetition_penalty=1.5, repetition_window=8, eos=False)
    with tinyloop.Model(model_file(model_dir, name), device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=30, depth=depth, **options)
        for draft_depth in (1, depth - 1):
            for n_draft in (1, 4):
                spec = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=draft_depth,
                                      n_draft=n_draft, **options)
                label = f"{name}: draft depth {draft_depth}, {n_draft} drafts"
                assert spec.tokens == plain.tokens, label
                assert 0 <= spec.accepted_tokens <= spec.drafted_tokens and spec.drafted_tokens > 0, label
                if draft_depth == 1:
                    assert spec.accepted_tokens < spec.drafted_tokens, label   # refusals ran


def _chi_square(counts, probs):
    """Pearson's statistic of counts against probs, the cells of expected count < 5 merged
    into one, with its degrees of freedom."""
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def _next_token_marginal(model, context_probs, depth, sampling):
    """The distribution of the token after one more sampled token: sum over t of
    context_probs[t] times the exact next-token distribution after PROMPT + prefix + [t],
    where context_probs is a list of (prefix + [t], probability)."""
    out = 0.0
    for context, prob in context_probs:
        if prob > 1e-6:
            logits = model.score_last_token(PROMPT + context, depth=depth)
            out = out + prob * _processed(logits, PROMPT + context, sampling)
    return out


def _processed(logits, history, options):
    """The distribution TinyLoop's sampler draws from (docs/sampling.md), in float64: the
    repetition penalty over the window of history, then top-k, temperature, min-p (relative
    to the best token) and top-p (the smallest set of the best tokens holding that mass)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    penalty, window = options.get("repetition_penalty", 1.0), options.get("repetition_window", 0)
    for t in set(history[-window:] if window else history):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    order = np.argsort(-x, kind="stable")
    if 0 < options.get("top_k", 0) < len(x):
        order = order[:options["top_k"]]
    w = np.exp((x[order] - x[order[0]]) / options["temperature"])
    keep = w >= options.get("min_p", 0.0)
    order, w = order[keep], w[keep]
    if options.get("top_p", 1.0) < 1.0:
        kept = int(np.searchsorted(np.cumsum(w), options["top_p"] * w.sum())) + 1
        order, w = order[:kept], w[:kept]
    out = np.zeros(len(x))
    out[order] = w / w.sum()
    return out


SAMPLING = {
    "plain": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
    "truncated, penalized": dict(temperature=1.0, top_k=24, top_p=0.9, min_p=0.02,
                                 repetition_penalty=1.4, repetition_window=0),
}


def check_follows_plain_sampling(model, prompt, runs, depth, options, label, draft_margin=1.0):
    """runs (seeds x 3 generated tokens after prompt): the second token's counts must fit
    its exact marginal at `depth` over the first, and the third's after the most frequent
    first token, within six standard deviations of the chi-square statistic; the same
    counts must be further than draft_margin times that from the draft depth's (1), so
    that drafts kept without the acceptance test would fail."""
    vocab = model.info.vocab_size
    first = _processed(model.score_last_token(prompt, depth=depth), prompt, options)
    t1 = int(np.bincount(runs[:, 0]).argmax())
    after_t1 = _processed(model.score_last_token(prompt + [t1], depth=depth), prompt + [t1], options)
    checks = [  # (what, samples, exact distribution, the same at the draft depth)
        ("token 2", runs[:, 1],
         _next_token_marginal(model, [([t], first[t]) for t in range(vocab)], depth, options),
         _next_token_marginal(model, [([t], first[t]) for t in range(vocab)], 1, options)),
        (f"token 3 after {t1}", runs[runs[:, 0] == t1, 2],
         _next_token_marginal(model, [([t1, t], after_t1[t]) for t in range(vocab)], depth, options),
         _next_token_marginal(model, [([t1, t], after_t1[t]) for t in range(vocab)], 1, options)),
    ]
    for what, samples, full, draft in checks:
        seen = np.bincount(samples, minlength=vocab)
        stat, dof = _chi_square(seen, full)
        limit = dof + 6 * np.sqrt(2 * dof)   # six standard deviations of the statistic
        where = f"{label}{what}: {seen.sum()} samples"
        assert stat < limit, f"{where}: chi-square {stat:.1f} over {limit:.1f} ({dof} dof)"
        draft_stat = _chi_square(seen, draft)[0]
        assert draft_stat > draft_margin * limit, f"{where}: drafts and full depth too alike ({draft_stat:.1f})"


@pytest.mark.parametrize("n_draft,sampling,draft_vocab,p_min",
                         [(n, s, 0, 0.0) for n in (1, 3) for s in SAMPLING]
                         + [(3, s, 30, 0.0) for s in SAMPLING] + [(3, s, 0, 0.2) for s in SAMPLING])
def test_sampled_tokens_follow_plain_sampling(model_dir, n_draft, sampling, draft_vocab, p_min):
    """Speculative sampling returns tokens distributed as plain sampling's. The first
    generated token comes from the prefill; the second is the first round's (a kept draft
    or a draw from the residual) and the third its second draft or the next round's (four
    tokens, so that a round may draft two: a round drafts no more than can be returned). Their
    counts over many seeds must fit the exact distributions at the full depth (the second
    token's marginal over the first; the third's after the most frequent first token),
    which the draft depth's are far from (so drafts kept without the test would fail).
    With a draft vocabulary, drafts never propose the other tokens, which only the
    residual draw can then give; with draft_p_min, a round stops drafting where the
    draft's distribution is flat (a rule on q alone, before its draw)."""
    name = "base"
    config = case_config(name)
    depth = config["max_depth"]
    options, n_runs = SAMPLING[sampling], 8000
    path = with_frequencies(model_dir, name, tied=False) if draft_vocab else model_file(model_dir, name)
    with tinyloop.Model(path, device=DEVICE, draft_vocab=draft_vocab) as model:
        results = [model.generate(PROMPT, seed=seed, draft_depth=1, n_draft=n_draft, max_tokens=4,
                                  depth=depth, eos=False, draft_p_min=p_min, **options)
                   for seed in range(n_runs)]
        runs = np.array([r.tokens for r in results])
        if p_min:   # the rule ran: some rounds stopped early, some drafted
            drafted = sum(r.drafted_tokens for r in results)
            assert 0 < drafted < n_runs * min(n_draft, 3), drafted
        check_follows_plain_sampling(model, PROMPT, runs, depth, options, "", draft_margin=3)


@pytest.mark.parametrize("stop", ["max_tokens", "stream_closed"])
def test_sampled_drafts_leave_the_context_as_plain_decoding(model_dir, stop):
    """After a sampled run with drafts the context holds the prompt and every returned
    token but the last (never fed): a continuation scores as after appending those."""
    name = "huginn-q4"
    depth = case_config(name)["max_depth"]
    options = dict(max_tokens=20, depth=depth, temperature=0.9, eos=False, seed=3, draft_depth=1,
                   n_draft=6)
    with tinyloop.Model(model_file(model_dir, name), device=DEVICE) as model:
        with model.context() as ctx:
            if stop == "stream_closed":
                stream = ctx.stream(PROMPT, **options)
                tokens = [next(stream) for _ in range(5)]
                stream.close()
            else:
                tokens = ctx.generate(PROMPT, **options).tokens
            length = len(ctx)
            follow = ctx.append([7])
        with model.context() as fresh:
            fresh.append(PROMPT + tokens[:-1], depth=depth)
            expected = fresh.append([7])
        assert length == len(PROMPT) + len(tokens) - 1
        np.testing.assert_allclose(follow, expected, rtol=1e-4, atol=1e-4)


def test_sampled_speculation_is_seeded(model_dir):
    options = dict(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02,
                   repetition_penalty=1.2, eos=False, draft_depth=1, n_draft=3)
    with tinyloop.Model(model_file(model_dir, "huginn-q4"), device=DEVICE) as model:
        check_seeded(model, options)


def check_seeded(model, options):
    """A sampled speculative generation: seed 7 twice gives the same tokens, seed 8 others,
    drafts were verified, and a stream gives seed 7's tokens. Returns seed 7's result."""
    a = model.generate(PROMPT, seed=7, **options)
    b = model.generate(PROMPT, seed=7, **options)
    c = model.generate(PROMPT, seed=8, **options)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert a.drafted_tokens > 0 and 0 <= a.accepted_tokens <= a.drafted_tokens
    with model.stream(PROMPT, seed=7, **options) as stream:
        assert list(stream) == a.tokens
    return a


def test_c_call_takes_its_own_draft_arguments(model_dir):
    """tl_generate_speculative(draft_depth, n_draft) is tl_generate with those options."""
    path = model_file(model_dir, "base")
    with tinyloop.Model(path, device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=12, **GREEDY)
        native, ffi = model._native, model._native.ffi
        opts = ffi.new("tl_generate_options *")
        native.lib.tl_generate_options_default(opts)
        opts.temperature, opts.max_tokens, opts.eos_token = 0.0, 12, -2
        ids = np.asarray(PROMPT, dtype=np.int32)
        out = np.zeros(12, dtype=np.int32)
        result = ffi.new("tl_generate_result *")
        native.lib.tl_generate_result_default(result)
        native.check(native.lib.tl_generate_speculative(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), opts, 2, 3,
            ffi.from_buffer("int32_t[]", out, require_writable=True), len(out), result))
        assert out.tolist() == plain.tokens and result.n_drafted > 0
        status = native.lib.tl_generate_speculative(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), opts, 0, 3,
            ffi.from_buffer("int32_t[]", out, require_writable=True), len(out), result)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"


@pytest.mark.skipif(not (default_model.MODELS_DIR / f"{DEFAULT_MODEL_NAME}.tinyloop").exists(),
                    reason="the trained default model is not in this installation")
def test_shipped_model_speculative_equals_greedy():
    """The trained model, real text: drafts at depth 1 and 2 give the default depth's
    greedy tokens, and a good share of drafts is kept (measured on this prompt with the
    tenth run's file: 0.30 at depth 1, 0.60 at depth 2, three drafts per round)."""
    path = default_model.packaged_model_path()
    with tinyloop.Model(path, threads=2) as model:
        prompt = "The state of our union is strong, and"
        plain = model.generate(prompt, max_tokens=48, **GREEDY)
        for draft_depth in (1, 2):
            spec = model.generate(prompt, max_tokens=48, draft_depth=draft_depth, n_draft=3,
                                  **GREEDY)
            assert spec.tokens == plain.tokens, f"draft depth {draft_depth}"
            assert spec.acceptance_rate > 0.2, f"draft depth {draft_depth}: {spec.acceptance_rate}"


def test_benchmark_tool_runs_and_checks_tokens(tmp_path):
    """tools/bench/speculative.py on a tiny model: a report with a row per config, the
    plain row at speedup 1 (the tool itself fails when a speculative run's tokens differ)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench" / "speculative.py"
    out = tmp_path / "report.json"
    for temperature in (0.0, 0.8):
        subprocess.run([sys.executable, str(tool), "--model", str(path), "--threads", "1",
                        "--new-tokens", "8", "--repeat", "1", "--drafts", "1:2,1:4",
                        "--temperature", str(temperature), "--json", str(out)],
                       check=True, timeout=300, capture_output=True)
        report = json.loads(out.read_text())
        assert report["temperature"] == temperature and report["device"].startswith("cpu")
        assert [row["config"] for row in report["rows"]] == ["plain", "draft depth 1, 2 drafts",
                                                             "draft depth 1, 4 drafts"]
        assert report["rows"][0]["speedup"] == 1.0 and report["rows"][0]["acceptance"] is None
        assert all(0 <= row["acceptance"] <= 1 for row in report["rows"][1:])
        assert set(report["step_ms"]) == {"1", str(report["depth"])}


def test_gpu_check_report_shows_the_speculative_rows(tmp_path):
    """tools/gpu/report.py puts tools/bench/speculative.py's rows (gpu_check's `speculative`
    step) into gpu_check.json and a table of gpu_check.md, one line per config."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    tools = Path(__file__).resolve().parents[2] / "tools"
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    steps = tmp_path / "out" / "steps"
    steps.mkdir(parents=True)
    subprocess.run([sys.executable, str(tools / "bench" / "speculative.py"), "--model", str(path),
                    "--threads", "1", "--new-tokens", "8", "--repeat", "1", "--drafts", "1:2",
                    "--json", str(steps / "speculative.result.json")],
                   check=True, timeout=300, capture_output=True)
    (steps / "speculative.json").write_text(json.dumps({"name": "speculative", "rc": 0, "seconds": 1,
                                                         "timed_out": False}))
    subprocess.run([sys.executable, str(tools / "gpu" / "report.py"), str(tmp_path / "out"),
                    "--device", "cpu"], check=True, timeout=60, capture_output=True)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [row["config"] for row in report["speculative"]["rows"]] == ["plain", "draft depth 1, 2 drafts"]
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "self-speculative decoding of text.tinyloop, depth" in md
    table = [line for line in md.splitlines() if line.startswith("| plain |") or line.startswith("| draft depth")]
    assert len(table) == 2 and table[0].split("|")[3].strip() == "1.000"
    assert report["steps"]["speculative"]["rc"] == 0
