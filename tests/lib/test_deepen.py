"""Deepening a sequence (tl_context_deepen, docs/api.md "Deeper depth"): a context made with
keep_loop_states continues its whole sequence at a deeper loop depth from where its loop
stopped, without running the prelude or the iterations already run again.

Checked, for every architecture option and weight type with a loop (a warm state init
excepted, which refuses): the deepened sequence's log-probs and last logits are the float64
oracle's at the deeper depth and, bit for bit on the CPU (within the same-backend bound
elsewhere), those of the sequence appended at that depth from the start; over several
prefill chunks and in several steps; decoding goes on from it as from that sequence; the
options and the calls' errors; the memory it costs."""

import numpy as np
import pytest

import tinyloop
from test_parity import CASES, DEVICE, ON_CPU, SAME, assert_close, case_config, case_tokens, \
    check_against_references
from tinyloop.errors import InvalidArgumentError, UnsupportedError
from tinyloop.fileformat.random_model import make_random_model

LOOP_CASES = [name for name in CASES
              if case_config(name)["n_core"] > 0 and case_config(name).get("state_init") != "warm"]


def assert_same(actual, expected, what):
    """Bit for bit on the CPU (the same rows through the same kernels); within the
    same-backend bound on a device whose kernels may sum in another order."""
    if ON_CPU:
        assert np.array_equal(actual, expected), f"{what}: max |diff| {np.abs(actual - expected).max():.3g}"
    else:
        assert_close(actual, np.asarray(expected, dtype=np.float64), SAME, what)


def from_the_start(model, tokens, depth):
    """(log-probs of tokens[1:], last logits) of the sequence run at `depth` from the start."""
    with model.context() as ctx:
        logits = ctx.append(tokens, depth=depth)
    return model.score(tokens, depth=depth), logits


@pytest.mark.parametrize("name", LOOP_CASES)
def test_a_deepened_sequence_is_the_sequence_run_at_that_depth(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    top = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        expected_logprobs, expected_logits = from_the_start(model, tokens, top)
        with model.context(keep_loop_states=True) as ctx:
            ctx.append(tokens, depth=1)
            logprobs = ctx.score_deeper(top)
            logits = ctx.deepen(top)   # the same depth again: the coda and head only
    assert_same(logprobs, expected_logprobs, f"{name}: deepened log-probs")
    assert_same(logits, expected_logits, f"{name}: deepened last logits")
    check_against_references(files, name, top, logprobs, logits, f"{name} deepened from 1")


@pytest.mark.parametrize("name", ["base", "injection-concat", "injection-none", "huginn-q4", "core-only"])
def test_deepening_in_steps_over_chunks_then_decoding(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    top, split = config["max_depth"], 7
    with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=3) as model:
        with model.context() as plain, model.context(keep_loop_states=True) as ctx:
            expected = plain.append(tokens[:split], depth=top)
            ctx.append(tokens[:split], depth=1)
            for depth in range(2, top):
                ctx.deepen(depth)
            assert_same(ctx.deepen(top), expected, f"{name}: deepened in steps over chunks of 3")
            for t in tokens[split:]:   # appends now run at the new depth
                assert_same(ctx.append([t]), plain.append([t]), f"{name}: decoding after deepening")
            full = model.score(tokens, depth=top)
    # and the decoded sequence against one full-sequence pass at that depth
    with tinyloop.Model(files.path(name), device=DEVICE) as model, \
            model.context(keep_loop_states=True) as ctx:
        ctx.append(tokens, depth=2)
        assert_close(ctx.score_deeper(top), full.astype(np.float64), SAME, f"{name}: deepened vs full")


def test_a_truncated_sequence_deepens_what_it_keeps(files):
    config = case_config("base")
    tokens = case_tokens(config)
    top = config["max_depth"]
    with tinyloop.Model(files.path("base"), device=DEVICE) as model, \
            model.context(keep_loop_states=True) as ctx:
        ctx.append(tokens, depth=2)
        ctx.truncate(5)
        ctx.append(tokens[5:9])
        _, expected = from_the_start(model, tokens[:9], top)
        assert_same(ctx.deepen(top), expected, "truncated, appended, deepened")
        assert len(ctx) == 9


def test_a_one_token_sequence_has_no_log_probs_but_logits(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model, \
            model.context(keep_loop_states=True) as ctx:
        ctx.append([3], depth=1)
        assert ctx.score_deeper(4).shape == (0,)
        with model.context() as plain:
            assert_same(ctx.deepen(4), plain.append([3], depth=4), "one token")


def test_deepening_errors(files, tmp_path):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with model.context() as ctx:
            ctx.append([1, 2, 3], depth=1)
            with pytest.raises(InvalidArgumentError, match="keep_loop_states"):
                ctx.deepen(3)
        with model.context(keep_loop_states=True, max_depth=4) as ctx:
            with pytest.raises(InvalidArgumentError, match="empty"):
                ctx.deepen(3)
            ctx.append([1, 2, 3], depth=3)
            with pytest.raises(InvalidArgumentError, match=r"depth 2 is out of range \[3, 4\]"):
                ctx.deepen(2)
            with pytest.raises(InvalidArgumentError, match=r"depth 5 is out of range \[3, 4\]"):
                ctx.deepen(5)
            assert len(ctx) == 3 and np.isfinite(ctx.deepen(4)).all()   # an error loses nothing
        with pytest.raises(TypeError, match="keep_loop_states must be a bool"):
            model.context(keep_loop_states=1)
    warm = tmp_path / "warm.tinyloop"
    make_random_model(warm, **case_config("init-warm"))
    dense = tmp_path / "dense.tinyloop"
    make_random_model(dense, **case_config("plain-llama"))
    for path, reason in ((warm, "warm state init"), (dense, "no loop")):
        with tinyloop.Model(path, device=DEVICE) as model:
            with pytest.raises(UnsupportedError, match=reason):
                model.context(keep_loop_states=True)


@pytest.mark.parametrize("name", ["base", "injection-none"])
def test_kept_states_are_counted_in_the_memory_report(files, name):
    config = case_config(name)
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        base = model.memory_report()["buffers_bytes"]
        with model.context():
            plain = model.memory_report()["buffers_bytes"] - base
        with model.context(keep_loop_states=True):
            keeping = model.memory_report()["buffers_bytes"] - base
        assert model.memory_report()["buffers_bytes"] == base
    planes = 1 if config.get("injection") == "none" else 2   # the state, and the injection source
    assert keeping - plain == planes * config["max_seq_len"] * config["d_model"] * 4
