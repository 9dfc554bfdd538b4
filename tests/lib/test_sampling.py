"""Sampling (docs/sampling.md) on the CPU: the host sampler and the CPU backend's
sample op against the plain reference of tests/reference/sampling.py on many rows
and settings, and generation, which samples through the backend's op, against the
host sampler on the same logits step by step. tests/lib/test_cuda_backend.py holds the
CUDA backend's op to the host sampler the same way."""

import numpy as np
import pytest

import tinyloop
from reference import sampling as reference
from sampling_hook import GENERATION_SETTINGS, SETTINGS, logit_rows, reference_tokens, sample_rows
from testing_hooks import through_testing_library  # noqa: F401 (autouse: the models load through the testing library)
from tinyloop.fileformat.random_model import make_random_model

VOCABS = [1, 2, 7, 160, 1000, 4099]
SEED = 11


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling") / "small.tinyloop"
    make_random_model(path, seed=3, vocab_size=160, d_model=64, n_head=4, n_kv_head=2, head_dim=16,
                      ffn_dim=128, n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=3,
                      max_seq_len=128, tied_embeddings=0)   # tied: it repeats its input
    with tinyloop.Model(path, device="cpu", threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def ctx(model):
    with model.context() as c:
        yield c


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_host_and_cpu_op_match_reference(ctx, vocab, setting):
    settings = SETTINGS[setting]
    rows = logit_rows(vocab * 31 + setting, vocab, 16)
    history = np.random.default_rng(vocab).integers(0, vocab, 50)
    host = sample_rows(ctx, rows, history=history, use_op=False, seed=SEED, **settings)
    op = sample_rows(ctx, rows, history=history, use_op=True, seed=SEED, **settings)
    expected = reference_tokens(reference, rows, settings, history=history, seed=SEED)
    assert host.tolist() == expected
    assert op.tolist() == expected
    assert all(0 <= t < vocab for t in expected)


def test_first_step_skips_earlier_draws(ctx):
    rows = logit_rows(5, 300, 6)
    settings = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=4)
    all_rows = sample_rows(ctx, rows, **settings)
    assert sample_rows(ctx, rows[3:], first_step=3, **settings).tolist() == all_rows[3:].tolist()


def test_draws_follow_the_weights(ctx):
    """Over many draws from one row, each token's frequency is its probability."""
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))
    rows = np.tile(logits, (4000, 1))
    tokens = sample_rows(ctx, rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9)
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    assert np.allclose(freq, [0.5, 0.25, 0.125, 0.125], atol=0.03)
    # top-p 0.7 keeps the two best (0.5 + 0.25 >= 0.7), renormalised
    tokens = sample_rows(ctx, rows, temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=9)
    assert set(tokens.tolist()) == {0, 1}
    assert abs(np.mean(tokens == 0) - 2 / 3) < 0.03


@pytest.mark.parametrize("setting", range(len(GENERATION_SETTINGS)))
def test_generation_through_the_op_matches_host_sampling(model, setting):
    """generate() samples through the CPU backend's op; replaying its sequence and
    sampling each step's logits on the host (the path of a backend without the op)
    picks the same tokens, and so does the reference."""
    options, seed = GENERATION_SETTINGS[setting], 21 + setting
    prompt = np.random.default_rng(setting).integers(0, 160, 12).tolist()
    with model.context() as gen:
        tokens = gen.generate(prompt, max_tokens=24, eos=False, seed=seed, **options).tokens
    assert len(tokens) == 24
    with model.context() as replay:
        logits = replay.append(prompt)
        for k, token in enumerate(tokens):
            history = prompt + tokens[:k]
            host = sample_rows(replay, logits, history=history, first_step=k, use_op=False,
                               seed=seed, **options)
            expected = reference_tokens(reference, [logits], options, history=history, seed=seed,
                                        first_step=k)
            assert host[0] == token == expected[0], f"step {k}"
            logits = replay.append([token])


ADJUSTMENTS = [
    dict(logit_bias={3: 5.0, 17: -100.0, 40: 2.5}),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7, presence_penalty=-0.4),
    dict(frequency_penalty=-2.0, logit_bias={5: 1.0, 9: 0.0}),
]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("adjustment", range(len(ADJUSTMENTS)))
def test_logit_adjustments_follow_the_reference(model, adjustment, sampled):
    """logit_bias and the presence / frequency penalties (step 0 of docs/sampling.md):
    replaying the generated sequence, each step's logits adjusted by the reference and
    sampled by it give the generated token, greedy and sampled (with a repetition
    penalty on top)."""
    adjust = ADJUSTMENTS[adjustment]
    options = (dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.0, repetition_penalty=1.2) if sampled
               else dict(temperature=0.0))
    seed = 31 + adjustment
    prompt = np.random.default_rng(40 + adjustment).integers(0, 160, 10).tolist()
    with model.context() as gen:
        tokens = gen.generate(prompt, max_tokens=20, eos=False, seed=seed, **options, **adjust).tokens
    exercised = False
    with model.context() as replay:
        logits = replay.append(prompt)
        for k, token in enumerate(tokens):
            adjusted = reference.adjust_logits(logits, generated=tokens[:k], **adjust)
            exercised |= not np.array_equal(adjusted, logits)
            expected = reference_tokens(reference, [adjusted], options, history=prompt + tokens[:k],
                                        seed=seed, first_step=k)
            assert token == expected[0], f"step {k}"
            logits = replay.append([token])
    assert exercised, "no step's logits were adjusted: the test would not see the adjustment"
    if "logit_bias" in adjust and adjust["logit_bias"].get(17) == -100.0:
        assert 17 not in tokens


def test_logit_adjustment_errors(model):
    from tinyloop.errors import InvalidArgumentError, UnsupportedError
    with pytest.raises(ValueError):
        model.generate([1, 2], presence_penalty=2.5)
    with pytest.raises(ValueError):
        model.generate([1, 2], logit_bias={160: 1.0})
    with pytest.raises(ValueError):
        model.generate([1, 2], logit_bias={3: 101.0})
    with pytest.raises(TypeError):
        model.generate([1, 2], logit_bias=[(3, 1.0)])
    with pytest.raises(UnsupportedError, match="speculative"):
        model.generate([1, 2], frequency_penalty=0.5, draft_depth=1)
    native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_generate_options *")
    native.lib.tl_generate_options_default(opts)
    ids, values = ffi.new("int32_t[]", [4, 4]), ffi.new("float[]", [1.0, 2.0])
    opts.logit_bias_ids, opts.logit_bias_values, opts.n_logit_bias = ids, values, 2
    out = ffi.new("int32_t[]", 4)
    prompt = ffi.new("int32_t[]", [1, 2])
    status = native.lib.tl_generate(model._require_open(), prompt, 2, opts, out, 4, ffi.NULL)
    assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
    assert b"appears twice" in ffi.string(native.lib.tl_last_error())
    opts.logit_bias_values = ffi.NULL
    status = native.lib.tl_generate(model._require_open(), prompt, 2, opts, out, 4, ffi.NULL)
    assert b"NULL" in ffi.string(native.lib.tl_last_error())
    with pytest.raises(InvalidArgumentError):
        native.check(status)
