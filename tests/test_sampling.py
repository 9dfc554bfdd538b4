"""Sampling (docs/sampling.md) on the CPU: the host sampler and the CPU backend's
sample op against the plain reference of tests/reference/sampling.py on many rows
and settings, and generation, which samples through the backend's op, against the
host sampler on the same logits step by step. tests/test_cuda_backend.py holds the
CUDA backend's op to the host sampler the same way."""

import numpy as np
import pytest

import tinyloop
from reference import sampling as reference
from sampling_hook import GENERATION_SETTINGS, SETTINGS, logit_rows, reference_tokens, sample_rows
from tinyloop.random_model import make_random_model

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
