"""tl_score_with_consistency_escalation (Model.score_with_consistency_escalation): the
depth it stops at follows its rule on the independent oracle's predictions, and its
scores are score_with_uncertainty's at that depth, bit for bit; bad options are clear
errors at both the Python and the C layer."""

import numpy as np
import pytest

import tinyloop
from test_parity import DEVICE, DEVICE_TOLERANCE, ON_CPU, TOLERANCES, arithmetic, \
    assert_close, case_config
from reference.ops import log_softmax

N = 40          # tokens scored: 39 predictions, so one changed argmax is 1/39 of them
CASES = ["base", "huginn-q4", "init-warm"]


def _tokens(config):
    return np.random.default_rng(config["seed"] + 3).integers(0, config["vocab_size"], N).astype(np.int32)


def _oracle_depth(argmax_at, min_depth, max_depth, max_changed):
    """The rule on the oracle's greedy predictions: min_depth, then doubling (capped)
    while more than max_changed of them change; None when a share is so close to
    max_changed that one prediction decided by rounding could tip it."""
    depth, before = min_depth, argmax_at(min_depth)
    while depth < max_depth:
        depth = min(2 * depth, max_depth)
        now = argmax_at(depth)
        share = float(np.mean(now != before))
        if abs(share - max_changed) < 1.5 / (N - 1):
            return None
        if share <= max_changed:
            break
        before = now
    return depth


@pytest.mark.parametrize("name", CASES)
def test_escalation_follows_the_oracle(files, name):
    config = case_config(name)
    tokens = _tokens(config)
    reference = files.reference(name)
    logits = {d: reference.logits(tokens, d)[:-1] for d in range(1, config["max_depth"] + 1)}
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE
    for d, rows in logits.items():   # every argmax is decided well beyond rounding
        top2 = np.sort(rows, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2 * tolerance[0], f"{name} depth {d}: a near tie"
    checked = 0
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        for min_depth, max_depth in ((1, config["max_depth"]), (1, 0), (2, config["max_depth"])):
            cap = max_depth or config["default_depth"]
            for max_changed in (0.0, 0.05, 0.2, 0.5, 1.0):
                expected = _oracle_depth(lambda d: logits[d].argmax(-1), min_depth, cap, max_changed)
                if expected is None:
                    continue
                label = f"{name}, depths {min_depth}..{max_depth}, max_changed {max_changed}"
                logprobs, entropies, depth = model.score_with_consistency_escalation(
                    tokens, min_depth=min_depth, max_depth=max_depth, max_changed=max_changed)
                assert depth == expected, label
                same_depth = model.score_with_uncertainty(tokens, depth=depth)
                assert np.array_equal(logprobs, same_depth[0]), label
                assert np.array_equal(entropies, same_depth[1]), label
                logp = log_softmax(logits[depth])
                assert_close(logprobs, logp[np.arange(N - 1), tokens[1:]], tolerance, label)
                checked += 1
    assert checked >= 10, f"{name}: only {checked} settings were far enough from a tie to check"


def test_escalation_bounds(files):
    config = case_config("huginn-q4")   # its predictions keep changing with depth
    tokens = _tokens(config)
    with tinyloop.Model(files.path("huginn-q4"), device=DEVICE) as model:
        assert model.score_with_consistency_escalation(tokens, min_depth=2, max_depth=2)[2] == 2
        # every share of changes is allowed: the second depth scored ends it
        assert model.score_with_consistency_escalation(tokens, max_changed=1.0)[2] == 2
        assert model.score_with_consistency_escalation(tokens, min_depth=3, max_depth=5,
                                                       max_changed=1.0)[2] == 5
        # none is: the cap ends it
        assert model.score_with_consistency_escalation(tokens, max_depth=5, max_changed=0.0)[2] == 5


def test_escalation_argument_errors(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        for kwargs, error in [(dict(min_depth=0), ValueError), (dict(max_depth=-1), ValueError),
                              (dict(max_changed=-0.1), ValueError), (dict(max_changed=1.5), ValueError),
                              (dict(max_changed=float("nan")), ValueError), (dict(min_depth=True), TypeError)]:
            with pytest.raises(error):
                model.score_with_consistency_escalation([1, 2, 3], **kwargs)
        with pytest.raises(ValueError):
            model.score_with_consistency_escalation([3])
        # the C layer checks what only it knows (the model's depths) and what Python did
        with pytest.raises(tinyloop.InvalidArgumentError, match="max_depth 9 is out of range"):
            model.score_with_consistency_escalation([1, 2, 3], max_depth=9)
        with pytest.raises(tinyloop.InvalidArgumentError, match="min_depth 4 is out of range"):
            model.score_with_consistency_escalation([1, 2, 3], min_depth=4)   # default depth 3
        with pytest.raises(ValueError, match="out of range"):
            model.score_with_consistency_escalation([1, 2, 500])
        native, ffi = model._native, model._native.ffi
        opts = ffi.new("tl_escalation_options *")
        native.lib.tl_escalation_options_default(opts)
        assert (opts.min_depth, opts.max_depth) == (1, 0) and abs(opts.max_changed - 0.05) < 1e-7
        opts.max_changed = float("nan")
        ids = np.asarray([1, 2, 3], dtype=np.int32)
        out = np.zeros(2, dtype=np.float32)
        depth = ffi.new("int32_t *")
        status = native.lib.tl_score_with_consistency_escalation(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), 3, opts,
            ffi.from_buffer("float[]", out, require_writable=True),
            ffi.from_buffer("float[]", out, require_writable=True), depth)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        assert b"max_changed" in ffi.string(native.lib.tl_last_error())
        native.lib.tl_escalation_options_default(opts)
        status = native.lib.tl_score_with_consistency_escalation(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), 3, opts,
            ffi.from_buffer("float[]", out, require_writable=True), ffi.NULL, depth)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        assert b"entropies" in ffi.string(native.lib.tl_last_error())
        many = np.ones(case_config("base")["max_seq_len"] + 1, dtype=np.int32)
        status = native.lib.tl_score_with_consistency_escalation(
            model._require_open(), ffi.from_buffer("int32_t[]", many), len(many), opts,
            ffi.from_buffer("float[]", np.zeros(len(many), np.float32), require_writable=True),
            ffi.from_buffer("float[]", np.zeros(len(many), np.float32), require_writable=True), depth)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_CONTEXT_FULL"
        bad = np.asarray([1, 2, 500], dtype=np.int32)   # the first pass checks the tokens
        status = native.lib.tl_score_with_consistency_escalation(
            model._require_open(), ffi.from_buffer("int32_t[]", bad), 3, opts,
            ffi.from_buffer("float[]", out, require_writable=True),
            ffi.from_buffer("float[]", out, require_writable=True), depth)
        assert ffi.string(native.lib.tl_status_name(status)) != b"TL_OK"
        assert b"500" in ffi.string(native.lib.tl_last_error())
        # one token predicts nothing: the first depth, without a pass
        opts.min_depth = 2
        status = native.lib.tl_score_with_consistency_escalation(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), 1, opts, ffi.NULL, ffi.NULL, depth)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_OK" and depth[0] == 2
    with tinyloop.Model(files.path("plain-llama"), device=DEVICE) as model:
        with pytest.raises(tinyloop.UnsupportedError, match="no loop"):
            model.score_with_consistency_escalation([1, 2, 3])
