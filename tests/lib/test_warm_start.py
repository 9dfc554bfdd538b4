"""Warm start chosen at run time (the state_init load and context option, docs/model.md
"Warm start"): every position after the first starts its loop from the previous one's
final loop state, the first as the file's own init says, on any looped model.

Checked: scores and last logits against the float64 oracle with the same warm start
(ReferenceModel.with_warm_start) for inits prelude, zeros, noise and several architectures
and dtypes; cached decode against full scoring; the context option against the load
option; batched steps, forks and linear speculation; and the combinations that are
refused, naming the option (deepening, tree speculation, a model without a loop, a prefix
cache of the other init)."""

import numpy as np
import pytest

import tinyloop
from test_parity import DEVICE, SAME, TOLERANCES, DEVICE_TOLERANCE, ON_CPU, arithmetic, assert_close, \
    case_config, case_tokens
from reference.ops import log_softmax, next_token_logprobs
from tinyloop.errors import InvalidArgumentError, UnsupportedError

WARM_CASES = ["base", "init-zeros", "init-noise", "injection-concat", "injection-none", "sliding_window",
              "coda2", "q4-g32", "huginn-q4", "init-warm"]


def oracle_tolerance(config):
    return TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE


@pytest.mark.parametrize("name", WARM_CASES)
def test_warm_start_matches_the_oracle(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    reference = files.reference(name).with_warm_start()
    with tinyloop.Model(files.path(name), device=DEVICE, state_init="warm") as model:
        for depth in (1, config["max_depth"]):
            logits = reference.logits(tokens, depth)
            tolerance = oracle_tolerance(config)
            assert_close(model.score(tokens, depth=depth), next_token_logprobs(logits, tokens), tolerance,
                         f"{name} warm depth {depth} log-probs")
            assert_close(model.score_last_token(tokens, depth=depth), logits[-1], tolerance,
                         f"{name} warm depth {depth} last logits")


def test_warm_start_changes_a_prelude_model_and_not_a_warm_file(files):
    tokens = case_tokens(case_config("base"))
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain, \
            tinyloop.Model(files.path("base"), device=DEVICE, state_init="warm") as warm:
        assert np.abs(plain.score(tokens, depth=4) - warm.score(tokens, depth=4)).max() > 1e-3
    with tinyloop.Model(files.path("init-warm"), device=DEVICE) as declared, \
            tinyloop.Model(files.path("init-warm"), device=DEVICE, state_init="warm") as chosen:
        assert np.array_equal(declared.score(tokens, depth=4), chosen.score(tokens, depth=4))


@pytest.mark.parametrize("name", ["base", "init-noise", "q4-g32", "huginn-q4"])
def test_cached_decode_equals_full_scoring(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE, state_init="warm", prefill_chunk=4) as model:
        full = model.score(tokens, depth=depth)
        full_last = model.score_last_token(tokens, depth=depth)
        with model.context() as ctx:
            steps = [None] * 4 + [ctx.append(tokens[:5], depth=depth)]
            for t in tokens[5:]:
                steps.append(ctx.append([int(t)]))
    for pos in range(4, len(tokens) - 1):
        lp = log_softmax(np.asarray(steps[pos], dtype=np.float64))[tokens[pos + 1]]
        assert_close([lp], [full[pos]], SAME, f"{name} warm cached log-prob at {pos}")
    assert_close(steps[-1], full_last.astype(np.float64), SAME, f"{name} warm cached last logits")


def test_the_context_option_overrides_the_load_option(files):
    tokens = case_tokens(case_config("base"))
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain, \
            tinyloop.Model(files.path("base"), device=DEVICE, state_init="warm") as warm:
        with plain.context(state_init="warm") as a, warm.context() as b, warm.context(state_init="file") as c, \
                plain.context() as d:
            assert np.array_equal(a.append(tokens, depth=3), b.append(tokens, depth=3))
            assert np.array_equal(c.append(tokens, depth=3), d.append(tokens, depth=3))
            with plain.context(state_init="warm") as fresh:
                assert np.array_equal(fresh.score(tokens, depth=3), warm.score(tokens, depth=3))
            # a fork carries the warm states: it goes on as the original does
            with a.fork() as forked:
                assert np.array_equal(forked.append([5]), a.append([5]))
        with pytest.raises(ValueError, match="state_init"):
            plain.context(state_init="zeros")
    with pytest.raises(ValueError, match="state_init"):
        tinyloop.Model(files.path("base"), device=DEVICE, state_init="cold")


def test_warm_start_in_batched_steps_and_generation(files):
    config = case_config("q4-g32")
    tokens = case_tokens(config)
    with tinyloop.Model(files.path("q4-g32"), device=DEVICE) as model:
        warm = [model.context(state_init="warm"), model.context(state_init="warm"), model.context()]
        alone = [model.context(state_init="warm"), model.context(state_init="warm"), model.context()]
        try:
            for i, ctx in enumerate(warm + alone):
                ctx.append(tokens[:3 + (i % 3)], depth=4)
            batched = model.append_batch(warm, [7, 8, 9])
            for i, ctx in enumerate(alone):
                assert_close(batched[i], ctx.append([7 + i]).astype(np.float64), SAME, f"batched row {i}")
        finally:
            for ctx in warm + alone:
                ctx.close()
        # linear speculation with warm rows: plain greedy decoding's tokens
        with model.context(state_init="warm") as a, model.context(state_init="warm") as b:
            plain = a.generate(tokens[:5].tolist(), max_tokens=8, depth=4, temperature=0.0, eos=False)
            drafted = b.generate(tokens[:5].tolist(), max_tokens=8, depth=4, temperature=0.0, eos=False,
                                 draft_depth=1, n_draft=3)
        assert drafted.tokens == plain.tokens


def test_refused_combinations_name_the_option(files):
    tokens = case_tokens(case_config("base")).tolist()
    with tinyloop.Model(files.path("base"), device=DEVICE, state_init="warm") as model:
        with pytest.raises(UnsupportedError, match="state_init warm"):
            model.context(keep_loop_states=True)
        with pytest.raises(UnsupportedError, match="state_init warm"):
            model.generate(tokens[:4], max_tokens=4, depth=4, temperature=0.0, draft_depth=1, tree=(2, 1))
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with pytest.raises(UnsupportedError, match="state_init warm"):
            model.context(keep_loop_states=True, state_init="warm")
        with model.prefix_cache(tokens[:4], depth=3) as cache, model.context(state_init="warm") as ctx:
            with pytest.raises(InvalidArgumentError, match="state_init warm"):
                ctx.load_prefix(cache)
        with model.context(state_init="warm") as ctx:   # a prefix of a warm context loads into one
            ctx.append(tokens[:4], depth=3)
            with ctx.prefix_cache() as cache, model.context(state_init="warm") as other:
                other.load_prefix(cache)
                assert np.array_equal(other.append(tokens[4:6]), ctx.append(tokens[4:6]))
    with pytest.raises(UnsupportedError, match="state_init warm"):
        tinyloop.Model(files.path("plain-llama"), device=DEVICE, state_init="warm")


def test_the_toml_key_and_the_cli_flag():
    from tinyloop.cli import build_parser
    from tinyloop.config import parse_config
    from tinyloop.errors import ConfigError
    assert parse_config('[model]\nstate_init = "warm"\n').load_options()["state_init"] == "warm"
    assert "state_init" not in parse_config("[model]\n").load_options()
    with pytest.raises(ConfigError, match="model.state_init"):
        parse_config('[model]\nstate_init = "cold"\n')
    args = build_parser().parse_args(["score", "text.txt", "--state-init", "warm"])
    assert args.state_init == "warm"


def test_the_model_info_names_it(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain, \
            tinyloop.Model(files.path("base"), device=DEVICE, state_init="warm") as warm:
        assert (plain.info.state_init, warm.info.state_init) == ("file", "warm")


def test_the_logit_lens_and_escalation_run_a_pass_per_depth(files):
    config = case_config("q4-g32")
    tokens = case_tokens(config)
    with tinyloop.Model(files.path("q4-g32"), device=DEVICE, state_init="warm") as model:
        lens = model.score_logit_lens(tokens, max_depth=3)
        for depth in (1, 2, 3):
            assert_close(lens[depth - 1], model.score_last_token(tokens, depth=depth).astype(np.float64), SAME,
                         f"warm logit lens at depth {depth}")
        logprobs, _, used = model.score_with_consistency_escalation(tokens, min_depth=1, max_depth=4)
        assert_close(logprobs, model.score(tokens, depth=used).astype(np.float64), SAME, "warm escalation")
