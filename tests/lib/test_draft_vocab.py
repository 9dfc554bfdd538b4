"""The draft vocabulary (tl_load_options.draft_vocab, docs/api.md): speculative drafts
score only the N most frequent tokens of the file's vocab.frequency.

Checked: a draft's logits at those tokens are the whole-vocabulary draft's (the same rows
of the same head), -inf elsewhere, and its token is their argmax; without a coda, a draft
is the float64 oracle at the draft depth; greedy speculative decoding still gives plain
greedy tokens; the load option's values and the file's bad frequencies give clear errors.
(Sampled drafts with a draft vocabulary: tests/lib/test_speculative.py.)"""

import numpy as np
import pytest

import tinyloop
from reference import ReferenceModel
from test_parity import DEVICE, ON_CPU, SAME, TOLERANCES, arithmetic, assert_close, case_config
from testing_hooks import hooks_of, through_testing_library  # noqa: F401 (autouse: the models load through the testing library)
from tinyloop.errors import FormatError, InvalidArgumentError
from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import copy_file, read_file, tensor_nbytes

PROMPT = [5, 17, 3, 88, 41, 9]
CASES = ["base", "q4-g32", "q2-g64", "huginn-q4", "warm-window-q8", "core2-no-coda", "untied"]


def frequencies(vocab: int, seed: int = 0) -> np.ndarray:
    """Relative frequencies with unseen tokens (0) and ties, as real counts have."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, vocab).astype(np.float64)
    return (counts / counts.sum()).astype(np.float32)


def draft_tokens(frequency: np.ndarray, n: int) -> np.ndarray:
    """The n most frequent tokens, ties to the lower id, ascending: the library's rule."""
    order = np.lexsort((np.arange(len(frequency)), -frequency.astype(np.float64)))
    return np.sort(order[:n])


def with_frequencies(directory, name: str, recommended: int = 0, tied=None):
    """The case's random model with vocab.frequency (and draft.vocab_size when given)."""
    config = case_config(name)
    if tied is not None:
        config["tied_embeddings"] = int(tied)
    tag = f"{name}-{config.get('tied_embeddings', 1)}"
    plain = directory / f"{tag}.tinyloop"
    path = directory / f"{tag}-frequency-{recommended}.tinyloop"
    if not path.exists():
        if not plain.exists():
            make_random_model(plain, **config)
        metadata = {"draft.vocab_size": recommended} if recommended else {}
        copy_file(plain, path, metadata=metadata,
                  tensors={"vocab.frequency": frequencies(config["vocab_size"], config["seed"])})
    return path


def draft_logits(ctx, token: int, draft_depth: int):
    """A draft of `token` after ctx's sequence: (vocab logits, the token it picks)."""
    native = ctx._model._native
    ffi, lib = hooks_of(native)
    logits = np.empty(ctx._model.info.vocab_size, dtype=np.float32)
    picked = ffi.new("int32_t *")
    native.check(lib.tl_testing_draft_logits(ctx._require_open(), token, draft_depth,
                                             ffi.from_buffer("float[]", logits, require_writable=True),
                                             picked))
    return logits, int(picked[0])


@pytest.mark.parametrize("name", CASES)
def test_draft_logits_are_the_whole_vocabularys_at_its_tokens(model_dir, name):
    config = case_config(name)
    path = with_frequencies(model_dir, name)
    depth = config["max_depth"]
    for n in (1, 7, config["vocab_size"] // 2):
        keep = draft_tokens(frequencies(config["vocab_size"], config["seed"]), n)
        with tinyloop.Model(path, device=DEVICE) as whole, \
                tinyloop.Model(path, device=DEVICE, draft_vocab=n) as model:
            assert model.info.draft_vocab == n and whole.info.draft_vocab == 0
            for draft_depth in (1, depth - 1):
                with whole.context() as a, model.context() as b:
                    a.append(PROMPT, depth=depth)
                    b.append(PROMPT, depth=depth)
                    expected, _ = draft_logits(a, 23, draft_depth)
                    got, token = draft_logits(b, 23, draft_depth)
                    assert len(b) == len(PROMPT)   # the draft left the sequence as it was
                label = f"{name}, {n} tokens, draft depth {draft_depth}"
                outside = np.ones(len(got), dtype=bool)
                outside[keep] = False
                assert np.all(got[outside] == -np.inf), label
                if ON_CPU:   # each head row's dot product does not depend on its neighbours
                    np.testing.assert_array_equal(got[keep], expected[keep], err_msg=label)
                else:
                    assert_close(got[keep], expected[keep], SAME, label)
                assert token == keep[int(np.argmax(got[keep]))], label


@pytest.mark.parametrize("name", ["core2-no-coda", "q4-g32"])
def test_draft_without_a_coda_is_the_oracle_at_the_draft_depth(model_dir, name):
    """With no coda a draft shares every layer with the full depth's earlier positions, so
    it is the oracle's next-token logits at the draft depth, restricted to its tokens."""
    config = {**case_config(name), "n_post": 0}
    path = model_dir / f"{name}-no-coda.tinyloop"
    if not path.exists():
        plain = model_dir / f"{name}-no-coda-plain.tinyloop"
        make_random_model(plain, **config)
        copy_file(plain, path, tensors={"vocab.frequency": frequencies(config["vocab_size"], 3)})
    n = 20
    keep = draft_tokens(frequencies(config["vocab_size"], 3), n)
    reference = ReferenceModel.from_file(path)
    depth = config["max_depth"]
    with tinyloop.Model(path, device=DEVICE, draft_vocab=n) as model, model.context() as ctx:
        ctx.append(PROMPT, depth=depth)
        for draft_depth in range(1, depth + 1):
            got, token = draft_logits(ctx, 23, draft_depth)
            expected = reference.logits(PROMPT + [23], depth=draft_depth)[-1]
            tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else SAME
            assert_close(got[keep], expected[keep], tolerance, f"{name}, draft depth {draft_depth}")
            assert token == keep[int(np.argmax(expected[keep]))]


@pytest.mark.parametrize("name,tied", [("base", True), ("base", False), ("huginn-q4", False),
                                       ("warm-window-q8", True)])
def test_greedy_drafts_give_plain_greedy_tokens(model_dir, name, tied):
    depth = case_config(name)["max_depth"]
    path = with_frequencies(model_dir, name, tied=tied)
    greedy = dict(max_tokens=30, depth=depth, temperature=0, eos=False)
    with tinyloop.Model(path, device=DEVICE) as whole:
        plain = whole.generate(PROMPT, **greedy).tokens
    for n in (1, 9, 40):
        with tinyloop.Model(path, device=DEVICE, draft_vocab=n) as model:
            for draft_depth, n_draft in ((1, 1), (1, 4), (depth - 1, 3)):
                spec = model.generate(PROMPT, draft_depth=draft_depth, n_draft=n_draft, **greedy)
                label = f"{name}, {n} tokens, draft depth {draft_depth}, {n_draft} drafts"
                assert spec.tokens == plain, label
                assert 0 <= spec.accepted_tokens <= spec.drafted_tokens and spec.drafted_tokens > 0, label


def test_generation_drafts_among_the_draft_vocabulary(model_dir):
    """Drafts at the full depth are all kept, unless the draft vocabulary is one token
    the output never holds: then none is."""
    config = case_config("base")
    depth, vocab = config["max_depth"], config["vocab_size"]
    greedy = dict(max_tokens=30, depth=depth, temperature=0, eos=False)
    plain_path = with_frequencies(model_dir, "base")
    with tinyloop.Model(plain_path, device=DEVICE, draft_vocab=0) as model:
        plain = model.generate(PROMPT, **greedy)
        every = model.generate(PROMPT, draft_depth=depth, n_draft=3, **greedy)
    assert every.tokens == plain.tokens and every.accepted_tokens == every.drafted_tokens > 0
    absent = min(set(range(vocab)) - set(plain.tokens))
    frequency = np.full(vocab, 1e-3, dtype=np.float32)
    frequency[absent] = 0.5
    path = model_dir / "one-absent-token.tinyloop"
    copy_file(plain_path, path, tensors={"vocab.frequency": frequency})
    with tinyloop.Model(path, device=DEVICE, draft_vocab=1) as model:
        spec = model.generate(PROMPT, draft_depth=depth, n_draft=3, **greedy)
    assert spec.tokens == plain.tokens and spec.drafted_tokens > 0 and spec.accepted_tokens == 0


def test_load_option_values(model_dir):
    vocab = case_config("base")["vocab_size"]
    bare = model_dir / "bare.tinyloop"
    make_random_model(bare, **case_config("base"))
    recommended = with_frequencies(model_dir, "base", recommended=12)
    unrecommended = with_frequencies(model_dir, "base")
    expected = [  # (file, draft_vocab, tokens the drafts score)
        (bare, 0, 0), (bare, -1, 0),   # -1 without frequencies: the whole vocabulary
        (recommended, -1, 12), (recommended, 0, 0), (recommended, 5, 5),
        (unrecommended, -1, 0), (unrecommended, vocab, 0), (unrecommended, vocab + 100, 0),
    ]
    with read_file(bare) as f:
        head = f.tensors.get("output.weight") or f.tensors["embed.weight"]
        row_bytes = tensor_nbytes(head.dtype, (1, head.shape[1]), head.group_size)
    for path, option, tokens in expected:
        with tinyloop.Model(path, device=DEVICE, draft_vocab=option) as model:
            assert model.info.draft_vocab == tokens, (path.name, option)
            if ON_CPU:   # the drafts' copy of their rows of the head
                assert model.memory_report()["repacked_bytes"] == tokens * row_bytes
    with pytest.raises(InvalidArgumentError, match="vocab.frequency"):
        tinyloop.Model(bare, device=DEVICE, draft_vocab=8)
    with pytest.raises(ValueError, match="draft_vocab must be >= -1"):
        tinyloop.Model(bare, device=DEVICE, draft_vocab=-2)
    # the C layer checks it too
    with tinyloop.Model(bare, device=DEVICE) as model:
        native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_load_options *")
    native.lib.tl_load_options_default(opts)
    opts.draft_vocab = -2
    out = ffi.new("tl_model **")
    status = native.lib.tl_load_model(str(bare).encode(), opts, out)
    assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
    assert "draft_vocab -2 is out of range" in native.last_error() and out[0] == ffi.NULL


@pytest.mark.parametrize("bad,message", [
    (lambda f: np.append(f, np.float32(0.1)), "vocab.frequency: expected shape"),
    (lambda f: np.where(np.arange(len(f)) == 7, np.float32(np.nan), f), "token 7 has frequency nan"),
    (lambda f: np.where(np.arange(len(f)) == 3, np.float32(-1e-3), f), "token 3 has frequency"),
    (lambda f: np.where(np.arange(len(f)) == 0, np.float32(np.inf), f), "token 0 has frequency inf"),
])
def test_bad_frequencies_are_format_errors(model_dir, bad, message):
    """The loader checks the tensor whether or not drafts use it."""
    source = with_frequencies(model_dir, "base")
    path = model_dir / "bad-frequency.tinyloop"
    with read_file(source) as f:
        frequency = f.tensor("vocab.frequency")
    copy_file(source, path, tensors={"vocab.frequency": bad(frequency).astype(np.float32)})
    for option in (0, 4):
        with pytest.raises(FormatError, match=message):
            tinyloop.Model(path, device=DEVICE, draft_vocab=option)


def test_recommended_size_beyond_the_vocabulary_is_a_format_error(model_dir):
    source = with_frequencies(model_dir, "base")
    path = model_dir / "bad-recommendation.tinyloop"
    copy_file(source, path, metadata={"draft.vocab_size": case_config("base")["vocab_size"] + 1})
    with pytest.raises(FormatError, match="draft.vocab_size"):
        tinyloop.Model(path, device=DEVICE)
