"""Resume handles (tl_resume_create / tl_resume_generate, docs/api.md "Resume handles";
Python GenerateResult.resume and Model.resume_generate): the same prompt, or the prompt and
the text generated so far, taken to a deeper loop depth without a new prefill gives what a
fresh generation at the deeper depth gives.

Checked for several architectures and weight types: greedy and seeded sampled tokens equal
a fresh run's; each resumed token's log-probability is within 1e-5 of the fresh sequence's
score; no prompt token is held back (the first token follows the deepened prompt); chained
resumes, a handle outliving its context, prompts after the handle, drafts, paged KV; and the
errors (a closed or reused context, a shallower depth, no kept states, a model without a
loop, an exit rule)."""

import numpy as np
import pytest

import tinyloop
from test_parity import DEVICE, case_config, case_tokens
from tinyloop.errors import InvalidArgumentError, UnsupportedError

CASES = ["base", "injection-concat", "injection-none", "huginn-q4", "q4-g32", "coda2", "core-only"]
GREEDY = dict(temperature=0.0, eos=False)
SAMPLED = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5, eos=False)


def fresh(model, prompt, depth, **options):
    with model.context() as ctx:
        return ctx.generate(prompt, depth=depth, **options)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_resumed_generation_is_a_fresh_one_at_the_deeper_depth(files, name, sampling):
    config = case_config(name)
    prompt = case_tokens(config)[:7].tolist()
    top = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=4) as model, \
            model.context(keep_loop_states=True) as ctx:
        shallow = ctx.generate(prompt, max_tokens=6, depth=1, **sampling)
        deeper = shallow.resume(top)
        expected = fresh(model, prompt, top, max_tokens=6, **sampling)
        assert deeper.tokens == expected.tokens, f"{name}: resumed prompt at depth {top}"
        assert (deeper.prompt_tokens, deeper.cached_tokens) == (7, 7)   # nothing recomputed
        assert deeper.depths == [top] * len(deeper.tokens)


@pytest.mark.parametrize("name", ["base", "huginn-q4", "q4-g32"])
def test_keeping_the_generated_text(files, name):
    config = case_config(name)
    prompt = case_tokens(config)[:5].tolist()
    top = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        with model.context(keep_loop_states=True) as ctx:
            shallow = ctx.generate(prompt, max_tokens=4, depth=2, **SAMPLED)
            deeper = shallow.resume(top, keep_text=True)
        expected = fresh(model, prompt + shallow.tokens, top, max_tokens=4, **SAMPLED)
        assert deeper.tokens == expected.tokens
        assert deeper.prompt_tokens == len(prompt) + len(shallow.tokens)


@pytest.mark.parametrize("name", ["base", "injection-concat", "q4-g32"])
def test_resumed_log_probs_are_the_fresh_scores(files, name):
    config = case_config(name)
    prompt = case_tokens(config)[:6].tolist()
    top = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as model, \
            model.context(keep_loop_states=True) as ctx:
        shallow = ctx.generate(prompt, max_tokens=6, depth=1, **SAMPLED)
        deeper = shallow.resume(top, logprobs=True)
        sequence = prompt + deeper.tokens
        scores = model.score(sequence, depth=top)[len(prompt) - 1:]
    got = np.array([lp.logprob for lp in deeper.logprobs])
    assert got.shape == scores.shape
    assert np.abs(got - scores).max() <= 1e-5, f"{name}: max |diff| {np.abs(got - scores).max():.3g}"


def test_chained_resumes_and_a_handle_that_outlives_its_context(files):
    config = case_config("base")
    tokens = case_tokens(config).tolist()
    prompt = tokens[:6]
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with model.context(keep_loop_states=True) as ctx:
            result = ctx.generate(prompt, max_tokens=5, depth=1, **SAMPLED)
            for depth in (2, 3, 5):
                result = result.resume(depth)
                assert result.tokens == fresh(model, prompt, depth, max_tokens=5, **SAMPLED).tokens
            ctx.reset()
            ctx.append(tokens[:8], depth=2)
            handle = ctx.resume_handle()
        assert (len(handle), handle.depth) == (8, 2) and handle.bytes > 0
        with handle:
            alone = model.resume_generate(handle, depth=4, max_tokens=5, **SAMPLED)   # a context of its own
            assert alone.tokens == fresh(model, tokens[:8], 4, max_tokens=5, **SAMPLED).tokens
            after = model.resume_generate(handle, tokens[8:10], depth=4, max_tokens=5, **SAMPLED)
            assert after.tokens == fresh(model, tokens[:10], 4, max_tokens=5, **SAMPLED).tokens
            assert (after.prompt_tokens, after.cached_tokens) == (10, 8)
            with model.context(keep_loop_states=True) as other:
                on = model.resume_generate(handle, depth=3, context=other, max_tokens=5, **SAMPLED)
                assert on.tokens == fresh(model, tokens[:8], 3, max_tokens=5, **SAMPLED).tokens
                assert on.resume(5).tokens == fresh(model, tokens[:8], 5, max_tokens=5, **SAMPLED).tokens


def test_resuming_with_drafts_and_paged_kv(files):
    config = case_config("base")
    prompt = case_tokens(config)[:6].tolist()
    top = config["max_depth"]
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4) as model, \
            model.context(keep_loop_states=True) as ctx:
        shallow = ctx.generate(prompt, max_tokens=8, depth=1, **GREEDY)
        drafted = shallow.resume(top, draft_depth=1, n_draft=3)
        assert drafted.tokens == fresh(model, prompt, top, max_tokens=8, **GREEDY).tokens


def test_resume_errors(files):
    config = case_config("base")
    prompt = case_tokens(config)[:6].tolist()
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with pytest.raises(InvalidArgumentError, match="keep_loop_states"):
            model.generate(prompt, max_tokens=2, depth=2).resume(4)
        with model.context() as ctx:
            with pytest.raises(InvalidArgumentError, match="keep_loop_states"):
                ctx.generate(prompt, max_tokens=2, depth=2).resume(4)
            with pytest.raises(InvalidArgumentError, match="keep_loop_states"):
                ctx.resume_handle()
        with model.context(keep_loop_states=True) as ctx:
            result = ctx.generate(prompt, max_tokens=2, depth=3)
            with pytest.raises(InvalidArgumentError, match="shallower than the handle's depth 3"):
                result.resume(2)
            with pytest.raises(UnsupportedError, match="exit rule"):
                result.resume(4, exit="kl:1e-3")
            ctx.append([1])
            with pytest.raises(InvalidArgumentError, match="used after this generation"):
                result.resume(4)
            with pytest.raises(InvalidArgumentError, match="empty"):
                ctx.reset()
                ctx.resume_handle()
        with pytest.raises(InvalidArgumentError, match="closed"):
            result.resume(4)
    with tinyloop.Model(files.path("plain-llama"), device=DEVICE) as dense:
        with pytest.raises(UnsupportedError, match="no loop"):
            dense.generate(prompt, max_tokens=2).resume(1)


def test_the_c_calls_check_their_arguments(files):
    tokens = case_tokens(case_config("base")).tolist()
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with model.context(keep_loop_states=True) as ctx:
            ctx.append(tokens[:5], depth=3)
            with pytest.raises(InvalidArgumentError, match="longer than the context's sequence of 5"):
                ctx.resume_handle(6)
            handle = ctx.resume_handle(4)
        with handle:
            assert (len(handle), handle.depth) == (4, 3)
            with pytest.raises(InvalidArgumentError, match="shallower than the handle's depth 3"):
                model.resume_generate(handle, depth=2, max_tokens=2)
            with pytest.raises(ValueError, match="depth"):
                model.resume_generate(handle, depth=6, max_tokens=2)
            with model.context() as plain:
                with pytest.raises(InvalidArgumentError, match="keep_loop_states"):
                    model.resume_generate(handle, depth=4, context=plain, max_tokens=2)
            # the same depth: only the coda and the head run again
            same = model.resume_generate(handle, depth=3, max_tokens=3, **GREEDY)
            assert same.tokens == fresh(model, tokens[:4], 3, max_tokens=3, **GREEDY).tokens
