"""Log-probabilities reported beside tokens: tl_score_top_logprobs (every position's most
likely next tokens) and a generation stream's logprobs / top_logprobs (each generated
token's log-probability and the step's most likely tokens), against the float64 oracle
and against scoring the generated sequence (docs/api.md, "Log-probabilities")."""

import numpy as np
import pytest

import tinyloop
from reference.ops import log_softmax
from test_parity import DEVICE, DEVICE_TOLERANCE, ON_CPU, SAME, TOLERANCES, arithmetic, assert_close, \
    case_config, case_depths
from tinyloop.errors import InvalidArgumentError, UnsupportedError

CASES = ["base", "init-warm", "injection-concat", "coda2", "untied", "q4-g32", "huginn-q4",
         "plain-llama"]
K = 5


def _tolerance(name):
    return TOLERANCES[arithmetic(case_config(name))] if ON_CPU else DEVICE_TOLERANCE


def _check_top(top_ids, top_lps, expected_logp, tolerance, label):
    """top_ids / top_lps (rows x k) are the k largest of each row of expected_logp, best
    first: checked on values, so that near-ties may come in either order."""
    k = top_ids.shape[1]
    assert np.all(np.diff(top_lps, axis=1) <= 0), f"{label}: not best first"
    for r in range(len(top_ids)):
        assert len(set(top_ids[r].tolist())) == k, f"{label}: row {r} repeats a token"
        assert_close(top_lps[r], expected_logp[r][top_ids[r]], tolerance, f"{label}: row {r} values")
        best = np.sort(expected_logp[r])[::-1][:k]
        assert_close(top_lps[r], best, tolerance, f"{label}: row {r} is not the top {k}")


@pytest.mark.parametrize("name", CASES)
def test_score_top_logprobs_matches_reference(files, name):
    """Over 40 tokens (two batches of 32 logit rows), in one prefill chunk and in chunks
    of 7, on the model and on a context: the log-probs are score's bit for bit, the top
    tokens the oracle's."""
    config = case_config(name)
    tokens = np.random.default_rng(config["seed"] + 3).integers(0, config["vocab_size"], 40).astype(np.int32)
    for chunk in (0, 7):
        with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=chunk) as model:
            for depth in case_depths(config):
                label = f"{name} depth {depth}, prefill chunk {chunk or 'default'}"
                logprobs, top_ids, top_lps = model.score_top_logprobs(tokens, K, depth=depth)
                assert np.array_equal(logprobs, model.score(tokens, depth=depth)), label
                assert top_ids.shape == top_lps.shape == (39, K)
                expected = log_softmax(files.reference(name).logits(tokens, depth)[:-1])
                _check_top(top_ids, top_lps, expected, _tolerance(name), label)
                with model.context() as ctx:
                    again = ctx.score_top_logprobs(tokens, K, depth=depth)
                for a, b in zip(again, (logprobs, top_ids, top_lps)):
                    assert np.array_equal(a, b), f"{label}: context"


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, seed=7),
    "penalty": dict(temperature=0.0, repetition_penalty=1.3),
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("name", ["base", "init-warm", "q4-g32", "plain-llama"])
def test_stream_logprobs_are_the_models_distribution(files, name, sampling):
    """The same tokens as without logprobs; each token's log-probability and the step's
    top tokens are those of the generated sequence scored in one pass (the model's own
    distribution, before temperature, filters and penalty) and the oracle's."""
    config = case_config(name)
    prompt = np.random.default_rng(config["seed"] + 4).integers(0, config["vocab_size"], 6).astype(np.int32)
    options = dict(max_tokens=12, eos=False, **SAMPLING[sampling])
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        plain = model.generate(prompt, **options)
        result = model.generate(prompt, logprobs=True, top_logprobs=3, **options)
        assert result.tokens == plain.tokens and len(result.tokens) == 12
        assert plain.logprobs is None
        assert [r.token for r in result.logprobs] == result.tokens
        full = np.concatenate([prompt, np.asarray(result.tokens, dtype=np.int32)])
        scored, top_ids, top_lps = model.score_top_logprobs(full, 3)
        n = len(prompt) - 1
        got = np.array([r.logprob for r in result.logprobs])
        assert_close(got, scored[n:], SAME, f"{name} {sampling}: token logprobs vs scoring")
        for i, r in enumerate(result.logprobs):
            assert_close([lp for _, lp in r.top], top_lps[n + i], SAME, f"step {i} top")
        expected = log_softmax(files.reference(name).logits(full, config["default_depth"])[n:-1])
        _check_top(np.array([[t for t, _ in r.top] for r in result.logprobs]),
                   np.array([[lp for _, lp in r.top] for r in result.logprobs]), expected,
                   _tolerance(name), f"{name} {sampling}: top vs oracle")
        assert_close(got, expected[np.arange(12), full[n + 1:]], _tolerance(name), "vs oracle")
        with model.stream(prompt, logprobs=True, **options) as stream:
            tokens = list(stream)
        assert tokens == plain.tokens
        assert [r.top for r in stream.logprobs] == [()] * 12
        assert [r.logprob for r in stream.logprobs] == [r.logprob for r in result.logprobs]


def test_batched_steps_keep_each_streams_logprobs(files):
    """Streams stepped together (next_batch) report what each reports alone."""
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        alone = [model.generate(p, max_tokens=6, temperature=0, eos=False, logprobs=True,
                                top_logprobs=2) for p in prompts]
        contexts = [model.context() for _ in prompts]
        streams = [c.stream(p, max_tokens=6, temperature=0, eos=False, logprobs=True, top_logprobs=2)
                   for c, p in zip(contexts, prompts)]
        while any(s._handle is not None for s in streams):
            model.next_batch(streams)
        for s, a in zip(streams, alone):
            assert s.tokens == a.tokens
            assert_close([r.logprob for r in s.logprobs], [r.logprob for r in a.logprobs], SAME, "batched")
            assert [[t for t, _ in r.top] for r in s.logprobs] == [[t for t, _ in r.top] for r in a.logprobs]
        for c in contexts:
            c.close()


def test_logprob_errors(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with pytest.raises(UnsupportedError, match="speculative"):
            model.generate([1, 2], max_tokens=4, logprobs=True, draft_depth=1)
        with pytest.raises(ValueError):
            model.generate([1, 2], logprobs=True, top_logprobs=21)
        with pytest.raises(TypeError):
            model.generate([1, 2], logprobs=1)
        with pytest.raises(InvalidArgumentError, match="needs logprobs"):
            model.generate([1, 2], top_logprobs=2)
        with pytest.raises(ValueError):
            model.score_top_logprobs([1, 2, 3], 0)
        with pytest.raises(ValueError):
            model.score_top_logprobs([1], 2)
        native, ffi = model._native, model._native.ffi
        ids = np.asarray([1, 2, 3], dtype=np.int32)
        status = native.lib.tl_score_top_logprobs(model._require_open(), ffi.from_buffer("int32_t[]", ids),
                                                  3, ffi.NULL, 21, ffi.NULL, ffi.NULL, ffi.NULL)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        assert b"top_k 21" in ffi.string(native.lib.tl_last_error())
        out = np.zeros(2, dtype=np.float32)
        status = native.lib.tl_score_top_logprobs(model._require_open(), ffi.from_buffer("int32_t[]", ids),
                                                  3, ffi.NULL, 2, ffi.from_buffer("float[]", out), ffi.NULL,
                                                  ffi.NULL)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        with model.stream([1, 2], max_tokens=3, temperature=0) as stream:
            lp = ffi.new("float *")
            status = native.lib.tl_stream_logprobs(stream._handle, lp, ffi.NULL, ffi.NULL)
            assert b"without logprobs" in ffi.string(native.lib.tl_last_error())
        with model.stream([1, 2], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2) as stream:
            status = native.lib.tl_stream_logprobs(stream._handle, lp, ffi.NULL, ffi.NULL)
            assert b"no token yet" in ffi.string(native.lib.tl_last_error())
            next(stream)
            status = native.lib.tl_stream_logprobs(stream._handle, lp, ffi.NULL, ffi.NULL)
            assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
            assert b"2 alternatives" in ffi.string(native.lib.tl_last_error())


def test_benchmark_tool(tmp_path):
    """tools/bench/logprobs.py on a tiny text model: a row per way, plain first at 1.0
    (the tool fails when logprobs change the tokens)."""
    import json

    import textmodel
    from tool_module import load_tool
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    out = tmp_path / "report.json"
    tool = load_tool("bench/logprobs.py", "bench_logprobs")
    assert tool.main(["--model", str(path), "--threads", "1", "--new-tokens", "6", "--repeat", "1",
                      "--prompt", "Hello", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["way"] for row in rows] == list(tool.WAYS)
    assert rows[0]["vs_plain"] == 1.0 and all(row["decode_tokens_per_s"] > 0 for row in rows)


def test_logprob_entries_carry_token_text(text_model, shipped, files):
    """Each entry and each of its top tokens carries the token's text beside its id; the
    top entries still unpack and compare as (id, logprob) pairs. Without a tokenizer the
    texts are None."""
    from tinyloop import TopLogprob
    options = dict(max_tokens=6, temperature=0, eos=False, logprobs=True, top_logprobs=4)
    result = text_model.generate("Zürich", **options)   # byte tokens: ü spans two
    tokenizer = text_model.tokenizer
    for entry in result.logprobs:
        assert entry.text == tokenizer.token_text(entry.token)
        assert entry.text == (chr(entry.token) if entry.token < 128 else entry.text)
        for top in entry.top:
            assert isinstance(top, TopLogprob) and top.text == tokenizer.token_text(top.id)
            token, logprob = top
            assert (token, logprob) == top == (top.id, top.logprob)
    assert text_model.tokenizer.token_text(0xC3) == "\ufffd"   # a lead byte alone
    reply = shipped.generate("The capital of France is", **options)
    assert "".join(e.text for e in reply.logprobs) == reply.text
    assert all(t.text == shipped.tokenizer.decode([t.id]) or t.text.startswith(" ")
               for e in reply.logprobs for t in e.top)
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        bare = model.generate([1, 2, 3], **options)
        assert all(e.text is None and all(t.text is None for t in e.top) for e in bare.logprobs)
