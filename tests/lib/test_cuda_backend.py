"""The CUDA backend against the CPU backend on the same random models.

Covers every weight dtype and group size, shapes that take each kernel path (GEMV for
up to 8 rows and the tiled GEMM above, one and several GEMM tiles, head_dim 16 to 128,
split-sequence decode attention over long contexts, sliding windows), cached decode
against full scoring on the device, greedy generation (chained on the device and step
by step), sampling on the device (the
backend's sample op against the host sampler token for token, and sampled generation),
batched decode steps (rows at different positions and depths through the batched RoPE,
store and attention kernels, padded to buckets and replayed as CUDA graphs) against
one-row steps, the CPU and full scoring, fp16 KV against f32 KV (contiguous and paged,
forks, prefix caches, trees), and the memory report.

Without a usable CUDA device (the normal case in CI) every test is skipped with the
reason; with TINYLOOP_TEST_DEVICE=cuda (tools/gpu_check) a missing device fails instead.
The oracle comparison on CUDA is tests/lib/test_parity.py with TINYLOOP_TEST_DEVICE=cuda.
"""

import os

import numpy as np
import pytest

import tinyloop
from tinyloop.fileformat.random_model import make_random_model
from sampling_hook import GENERATION_SETTINGS, SETTINGS, logit_rows, sample_rows
from test_parity import DEVICE_TOLERANCE, TOLERANCES
from testing_hooks import through_testing_library  # noqa: F401 (autouse: the models load through the testing library)

CUDA = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")
if not CUDA.startswith("cuda"):
    CUDA = "cuda"
REQUIRED = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu").startswith("cuda")

# CUDA keeps activations fp32; the CPU rounds them against quantized weights, so those
# models are compared at the sum of both backends' bounds to the exact oracle
# (tests/lib/test_parity.py), float models at the CUDA bound.
FLOAT_TOLERANCE = DEVICE_TOLERANCE
QUANTIZED_TOLERANCE = tuple(a + b for a, b in zip(TOLERANCES["quantized"], DEVICE_TOLERANCE))

SMALL = dict(seed=5, vocab_size=160, d_model=128, n_head=4, n_kv_head=2, head_dim=32, ffn_dim=256,
             n_pre=1, n_core=1, n_post=1, default_depth=3, max_depth=4, max_seq_len=96)
DTYPES = {
    "f32": dict(dtype="f32"),
    "f16": dict(dtype="f16"),
    "bf16": dict(dtype="bf16"),
    **{f"{q}-g{g}": dict(dtype=q, group_size=g) for q in ("q8", "q4", "q2") for g in (32, 64, 128)},
    "q4-embed-f16-untied": dict(dtype="q4", group_size=64, embed_dtype="f16", tied_embeddings=0),
}
# Long enough for several GEMM tiles in prefill and many attention splits in decode.
LONG = dict(seed=9, vocab_size=300, d_model=256, n_head=4, n_kv_head=1, head_dim=128, ffn_dim=512,
            n_pre=1, n_core=1, n_post=0, default_depth=2, max_depth=2, max_seq_len=600)
LONG_CASES = {
    "long-f16": dict(dtype="f16"),
    "long-q4-window": dict(dtype="q4", group_size=64, sliding_window=100),
    "long-q2-warm": dict(dtype="q2", group_size=128, state_init="warm"),
}


def _cuda_unusable_reason():
    path = "/nonexistent.tinyloop"
    try:
        tinyloop.Model(path, device=CUDA)
    except tinyloop.UnsupportedError as e:
        return str(e)
    except Exception:   # the device opened; the file then failed, as intended
        return None
    return None


_REASON = _cuda_unusable_reason()


@pytest.fixture(scope="module", autouse=True)
def cuda_device():
    if _REASON is not None:
        if REQUIRED:
            pytest.fail(f"TINYLOOP_TEST_DEVICE={CUDA} but CUDA is not usable: {_REASON}")
        pytest.skip(f"CUDA BACKEND NOT TESTED: {_REASON}")


def _model(model_dir, name, base, overrides):
    path = model_dir / f"{name}.tinyloop"
    if not path.exists():
        make_random_model(path, **{**base, **overrides})
    return path


def _tolerance(config):
    quantized = ("q8", "q4", "q2")
    return QUANTIZED_TOLERANCE if config.get("dtype") in quantized else FLOAT_TOLERANCE


def assert_close(actual, expected, tolerance, what):
    atol, rtol = tolerance
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    err = np.abs(actual - expected)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    assert np.all(err <= atol + rtol * np.abs(expected)), f"{what}: max |error| {err.max():.3g}"


def _tokens(seed, vocab, n):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("n_tokens", [5, 40, 70])   # GEMV, one GEMM tile, two GEMM tiles
def test_scores_match_cpu(model_dir, name, n_tokens):
    config = {**SMALL, **DTYPES[name]}
    path = _model(model_dir, name, SMALL, DTYPES[name])
    tokens = _tokens(n_tokens, SMALL["vocab_size"], n_tokens)
    with tinyloop.Model(path, device="cpu") as cpu, tinyloop.Model(path, device=CUDA) as gpu:
        for depth in (1, SMALL["max_depth"]):
            assert_close(gpu.score(tokens, depth=depth), cpu.score(tokens, depth=depth),
                         _tolerance(config), f"{name} depth {depth} log-probs")
            assert_close(gpu.score_last_token(tokens, depth=depth),
                         cpu.score_last_token(tokens, depth=depth), _tolerance(config),
                         f"{name} depth {depth} last logits")


# Wide inputs for the GEMV: eight rows of 1536 floats are exactly the 48 KB a block may
# use without opting in, before its static shared memory (that launch once failed);
# 2048 needs the opt-in.
WIDE_FFN = dict(seed=13, vocab_size=160, d_model=128, n_head=4, n_kv_head=2, head_dim=32,
                n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=2, max_seq_len=32)


@pytest.mark.parametrize("ffn_dim", [1536, 2048])
@pytest.mark.parametrize("dtype", ["q4", "f16"])
def test_gemv_on_wide_rows_for_every_row_count(model_dir, ffn_dim, dtype):
    overrides = dict(ffn_dim=ffn_dim, dtype=dtype, group_size=64 if dtype == "q4" else 32)
    path = _model(model_dir, f"wide-{ffn_dim}-{dtype}", WIDE_FFN, overrides)
    tokens = _tokens(ffn_dim, WIDE_FFN["vocab_size"], 8)
    with tinyloop.Model(path, device="cpu") as cpu, tinyloop.Model(path, device=CUDA) as gpu:
        for n in range(1, 9):
            assert_close(gpu.score_last_token(tokens[:n]), cpu.score_last_token(tokens[:n]),
                         _tolerance(overrides), f"ffn {ffn_dim} {dtype}, {n} rows")


@pytest.mark.parametrize("name", list(LONG_CASES))
def test_long_prefill_and_split_decode(model_dir, name):
    """A 500-token prefill (several GEMM and attention tiles), then 30 decode steps whose
    attention is split over the sequence (16-17 splits), against the CPU and against
    full scoring at several steps."""
    config = {**LONG, **LONG_CASES[name]}
    path = _model(model_dir, name, LONG, LONG_CASES[name])
    tokens = _tokens(3, LONG["vocab_size"], 530)
    depth = LONG["default_depth"]
    with tinyloop.Model(path, device="cpu") as cpu, tinyloop.Model(path, device=CUDA) as gpu:
        full_gpu = gpu.score_last_token(tokens, depth=depth)
        assert_close(full_gpu, cpu.score_last_token(tokens, depth=depth), _tolerance(config),
                     f"{name} last logits")
        with gpu.context() as ctx:
            ctx.append(tokens[:500], depth=depth)
            for i in range(500, len(tokens)):
                step = ctx.append([int(tokens[i])], depth=depth)
                if i in (505, 511, 512, 520):
                    assert_close(step, gpu.score_last_token(tokens[:i + 1], depth=depth), FLOAT_TOLERANCE,
                                 f"{name} cached decode vs full scoring at {i + 1} keys")
        assert_close(step, full_gpu, FLOAT_TOLERANCE, f"{name} cached decode vs full scoring")


@pytest.mark.parametrize("name", list(LONG_CASES))
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_long_prefill_and_split_decode(model_dir, name, page_size):
    """Paged KV (kv_page_size) on the long models: a 500-token prefill through the tiled
    kernel, then 30 decode steps, recorded once and replayed (CUDA graphs) across page
    boundaries with the split-sequence kernel reading through the device page table,
    equal to the contiguous cache on CUDA and to the paged cache on the CPU."""
    config = {**LONG, **LONG_CASES[name]}
    path = _model(model_dir, name, LONG, LONG_CASES[name])
    tokens = _tokens(3, LONG["vocab_size"], 530)
    depth = LONG["default_depth"]
    rows = {}
    for device, pages in (("cpu", page_size), (CUDA, 0), (CUDA, page_size)):
        with tinyloop.Model(path, device=device, kv_page_size=pages) as model:
            with model.context() as ctx:
                out = [ctx.append(tokens[:500], depth=depth)]
                out += [ctx.append([int(tokens[i])]) for i in range(500, len(tokens))]
                if pages:
                    assert model.memory_report()["kv_pages_in_use"] == -(-len(tokens) // pages)
            rows[(device, pages)] = np.array(out)
    assert_close(rows[(CUDA, page_size)], rows[(CUDA, 0)], FLOAT_TOLERANCE, f"{name} paged vs contiguous on CUDA")
    assert_close(rows[(CUDA, page_size)], rows[("cpu", page_size)], _tolerance(config), f"{name} CUDA vs CPU, paged")


def test_paged_forks_and_chained_greedy_decoding(model_dir):
    """Forks share pages on the device and copy the shared one on write; greedy chained
    decoding (steps enqueued ahead, page-table updates between them) gives the contiguous
    cache's tokens, and tree speculation reads tree rows through the table."""
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    prompt = _tokens(2, SMALL["vocab_size"], 21)
    g = dict(temperature=0.0, eos=False)
    with tinyloop.Model(path, device=CUDA) as plain:
        expected = plain.generate(prompt, max_tokens=40, **g).tokens
        tree = plain.generate(prompt, max_tokens=40, draft_depth=1, tree=(3, 2), **g).tokens
        with plain.context() as ctx:
            ctx.append(prompt)
            after = [ctx.append([t]) for t in (7, 8, 9)]
    with tinyloop.Model(path, device=CUDA, kv_page_size=8) as gpu:
        assert gpu.generate(prompt, max_tokens=40, **g).tokens == expected
        assert gpu.generate(prompt, max_tokens=40, draft_depth=1, tree=(3, 2), **g).tokens == tree
        with gpu.context() as ctx:
            ctx.append(prompt)
            pages = gpu.memory_report()["kv_pages_in_use"]
            with ctx.fork() as fork:
                assert gpu.memory_report()["kv_pages_in_use"] == pages
                got = [fork.append([t]) for t in (7, 8, 9)]
                assert gpu.memory_report()["kv_pages_in_use"] == pages + 1   # the shared partial page
                mine = [ctx.append([t]) for t in (7, 8, 9)]
    assert_close(got, after, FLOAT_TOLERANCE, "a fork on paged KV")
    assert_close(mine, after, FLOAT_TOLERANCE, "its parent after the fork")


# Paged KV through the fused decode kernels, which write K/V rows through the device page
# table: the q/k/v GEMV whose epilogue rotates q and k and stores k and v (f16/q8/q4
# weights, no qkv bias, up to 8 rows), and the RoPE + store kernel after separate
# projections (f32 weights, a qkv bias, prefill chunks of more than 8 rows). Each page
# holds every virtual layer's rows (five slots here), GQA groups two heads, and the
# rotary pairs are half, interleaved and partial.
FUSED_PAGED = {
    "q4-g64": dict(dtype="q4", group_size=64),
    "f16-interleaved-partial": dict(dtype="f16", rope_style="interleaved", rope_dims=12),
    "q8-half-partial": dict(dtype="q8", group_size=32, rope_dims=20),
    "f32": dict(dtype="f32"),
    "q4-qkv-bias": dict(dtype="q4", group_size=64, qkv_bias=1),
}
FUSED_PAGE_SIZES = [1, 4, 16, 64]
# Appends of a sequence of 75 positions: a prefill of 13 rows (GEMM, then RoPE + store),
# steps of one row (recorded and replayed), then chunks of 3 and 8 rows (the GEMV's
# multi-row epilogue, whose rows straddle page boundaries), then one-row steps past 64.
FUSED_APPENDS = [13] + [1] * 20 + [3, 8] + [1] * 31


def _appended(model, tokens, sizes, depth):
    """The last logits after each append of `sizes` tokens, and the pages then in use."""
    rows, at = [], 0
    with model.context() as ctx:
        for size in sizes:
            rows.append(ctx.append(tokens[at:at + size], depth=depth))
            at += size
        pages = model.memory_report()["kv_pages_in_use"]
    return np.array(rows), pages


@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("page_size", FUSED_PAGE_SIZES)
@pytest.mark.parametrize("name", list(FUSED_PAGED))
def test_paged_fused_decode_matches_contiguous(model_dir, monkeypatch, name, page_size, graphs):
    """Prefill, one-row steps and multi-row chunks on a paged slot, crossing page
    boundaries, with CUDA graphs on and off: equal to the contiguous cache on CUDA, to
    the paged cache on the CPU, and (the last step) to full-sequence scoring; greedy
    generation gives the contiguous cache's tokens."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
    config = {**SMALL, **FUSED_PAGED[name]}
    path = _model(model_dir, f"fused-{name}", SMALL, FUSED_PAGED[name])
    n = sum(FUSED_APPENDS)
    tokens = _tokens(n, SMALL["vocab_size"], n)
    depth = SMALL["max_depth"]
    label = f"{name}, pages of {page_size}, graphs {graphs}"
    with tinyloop.Model(path, device=CUDA) as plain:
        contiguous, _ = _appended(plain, tokens, FUSED_APPENDS, depth)
        expected_tokens = plain.generate(tokens[:9], max_tokens=60, depth=depth, temperature=0.0, eos=False).tokens
    with tinyloop.Model(path, device="cpu", kv_page_size=page_size) as cpu:
        on_cpu, _ = _appended(cpu, tokens, FUSED_APPENDS, depth)
    with tinyloop.Model(path, device=CUDA, kv_page_size=page_size) as gpu:
        paged, pages = _appended(gpu, tokens, FUSED_APPENDS, depth)
        full = gpu.score_last_token(tokens, depth=depth)
        generated = gpu.generate(tokens[:9], max_tokens=60, depth=depth, temperature=0.0, eos=False).tokens
    assert pages == -(-n // page_size), label
    assert_close(paged, contiguous, FLOAT_TOLERANCE, f"{label}: paged vs contiguous on CUDA")
    assert_close(paged, on_cpu, _tolerance(config), f"{label}: CUDA vs CPU, paged")
    assert_close(paged[-1], full, FLOAT_TOLERANCE, f"{label}: cached decode vs full scoring")
    assert generated == expected_tokens, label


@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("page_size", FUSED_PAGE_SIZES)
@pytest.mark.parametrize("name", ["q4-g64", "f32"])
def test_paged_fused_forks_copy_on_write(model_dir, monkeypatch, name, page_size, graphs):
    """A parent decodes (its steps recorded, then replayed), forks, and both go on with
    different tokens in steps of one row and chunks of three: the parent's first write
    into the shared partly filled page copies it, and its replayed steps must then write
    the copy (the fused kernels read the table on the device), the fork its own rows.
    Each equals a fresh contiguous run of its own sequence, and the pages wholly before
    the fork stay shared."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
    path = _model(model_dir, f"fused-{name}", SMALL, FUSED_PAGED[name])
    depth = SMALL["max_depth"]
    vocab = SMALL["vocab_size"]
    before = [10, 1, 1, 1]                   # 13 positions, then the fork
    after = [1, 1, 3, 1, 1, 3, 1, 1, 1, 1]   # 14 more on each side
    seq_a = _tokens(30, vocab, 28)           # the parent's, with one more step once alone
    seq_b = np.concatenate([seq_a[:13], _tokens(31, vocab, 14)])
    label = f"{name}, pages of {page_size}, graphs {graphs}"
    with tinyloop.Model(path, device=CUDA) as plain:
        expect_a, _ = _appended(plain, seq_a, before + after + [1], depth)
        expect_b, _ = _appended(plain, seq_b, before + after, depth)
    with tinyloop.Model(path, device=CUDA, kv_page_size=page_size) as gpu:
        with gpu.context() as parent:
            rows_a, at = [], 0
            for size in before:
                rows_a.append(parent.append(seq_a[at:at + size], depth=depth))
                at += size
            held = gpu.memory_report()["kv_pages_in_use"]
            with parent.fork() as child:
                assert gpu.memory_report()["kv_pages_in_use"] == held, "a fork takes no page"
                rows_b = list(rows_a)
                for size in after:
                    rows_a.append(parent.append(seq_a[at:at + size]))
                    rows_b.append(child.append(seq_b[at:at + size]))
                    at += size
                own = -(-at // page_size) - 13 // page_size   # from the fork's partly filled page on
                assert gpu.memory_report()["kv_pages_in_use"] == 13 // page_size + 2 * own, label
            rows_a.append(parent.append(seq_a[at:at + 1]))   # alone again
    assert_close(rows_a, expect_a, FLOAT_TOLERANCE, f"{label}: the parent")
    assert_close(rows_b, expect_b, FLOAT_TOLERANCE, f"{label}: the fork")


def test_greedy_generation_matches_cpu(model_dir):
    path = _model(model_dir, "f32", SMALL, DTYPES["f32"])
    prompt = _tokens(1, SMALL["vocab_size"], 8)
    with tinyloop.Model(path, device="cpu") as cpu, tinyloop.Model(path, device=CUDA) as gpu:
        a = cpu.generate(prompt, max_tokens=24, temperature=0.0, eos=False)
        b = gpu.generate(prompt, max_tokens=24, temperature=0.0, eos=False)
    assert a.tokens == b.tokens


def _greedy_runs(gpu, prompt):
    """Greedy generations stopped every way, and contexts continued after them: the
    tokens, the contexts' lengths and their next logits."""
    g = dict(temperature=0.0)
    free = gpu.generate(prompt, max_tokens=20, eos=False, **g).tokens
    out = {"max_tokens": free,
           "eos": gpu.generate(prompt, max_tokens=20, eos=free[6], **g).tokens,
           "stop": gpu.generate(prompt, max_tokens=20, eos=False, stop=[free[9:11]], **g).tokens}
    with gpu.context() as ctx:
        out["ctx_tokens"] = ctx.generate(prompt, max_tokens=5, eos=False, **g).tokens
        out["ctx_tokens"] += ctx.generate([int(free[0])], max_tokens=9, eos=free[4], **g).tokens
        out["ctx_length"] = len(ctx)
        out["ctx_logits"] = ctx.append([3])
    with gpu.context() as ctx:   # a stream dropped while a step runs ahead
        stream = ctx.stream(prompt, max_tokens=20, eos=False, **g)
        out["dropped_tokens"] = [next(stream) for _ in range(3)]
        stream.close()
        out["dropped_length"] = len(ctx)
        out["dropped_logits"] = ctx.append([3])
    return out


def test_chained_greedy_decoding_matches_step_by_step(model_dir, monkeypatch):
    """Greedy decoding chains its steps on the device and runs one step ahead of the
    host (generate.c); with TINYLOOP_CUDA_CHAIN=0 it goes step by step. Both must give
    the same tokens and leave contexts alike (length, next logits) whatever stops them."""
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    prompt = _tokens(2, SMALL["vocab_size"], 8)
    runs = {}
    for chain in ("1", "0"):
        monkeypatch.setenv("TINYLOOP_CUDA_CHAIN", chain)
        with tinyloop.Model(path, device=CUDA) as gpu:
            runs[chain] = _greedy_runs(gpu, prompt)
    chained, stepped = runs["1"], runs["0"]
    assert len(stepped["eos"]) < 20 and len(stepped["stop"]) < 20   # the stops did stop
    for key, value in stepped.items():
        if key.endswith("logits"):
            assert_close(chained[key], value, FLOAT_TOLERANCE, key)
        else:
            assert chained[key] == value, key


# Vocabularies from one token to past 256k: one and many slices of ids per thread, rows
# of several batched passes.
SAMPLING_VOCABS = [1, 7, 160, 5000, 50_000, 262_147]


@pytest.fixture(scope="module")
def sampling_contexts(model_dir):
    """A CPU and a CUDA context: the sampling hook samples rows of any vocabulary size
    with their backends, whatever the model."""
    path = _model(model_dir, "f32", SMALL, DTYPES["f32"])
    with tinyloop.Model(path, device="cpu") as cpu, tinyloop.Model(path, device=CUDA) as gpu:
        with cpu.context() as cpu_ctx, gpu.context() as gpu_ctx:
            yield cpu_ctx, gpu_ctx


@pytest.mark.parametrize("vocab", SAMPLING_VOCABS)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_device_sampling_matches_host(sampling_contexts, vocab, setting):
    """The CUDA sample op picks the host sampler's token on the same logits, row after
    row of one seeded stream: ties, infinities, NaN, every cut, penalty lists longer
    than one kernel's batch (600 history tokens, window 0)."""
    cpu_ctx, gpu_ctx = sampling_contexts
    settings = SETTINGS[setting]
    rows = logit_rows(vocab * 31 + setting, vocab, 6 if vocab > 10_000 else 24)
    history = np.random.default_rng(vocab).integers(0, vocab, 600)
    host = sample_rows(cpu_ctx, rows, history=history, use_op=False, seed=7, **settings)
    device = sample_rows(gpu_ctx, rows, history=history, use_op=True, seed=7, **settings)
    assert device.tolist() == host.tolist()


@pytest.mark.parametrize("setting", range(len(GENERATION_SETTINGS)))
def test_sampled_generation_on_device(model_dir, setting):
    """generate() on CUDA samples each token on the device. Replaying its sequence on
    CUDA gives every step's logits, and the host sampler picks the same token from
    them. (Comparing with generation on the CPU would not be robust: the backends'
    logits differ in the last bits, which moves a draw that lands next to a boundary
    between two tokens.)"""
    options, seed = GENERATION_SETTINGS[setting], 40 + setting
    path = _model(model_dir, "f32-untied", SMALL, dict(dtype="f32", tied_embeddings=0))
    prompt = _tokens(4, SMALL["vocab_size"], 10).tolist()
    with tinyloop.Model(path, device=CUDA) as gpu, tinyloop.Model(path, device="cpu") as cpu:
        with gpu.context() as ctx:
            tokens = ctx.generate(prompt, max_tokens=32, eos=False, seed=seed, **options).tokens
        assert len(tokens) == 32
        with gpu.context() as replay, cpu.context() as host:
            logits = replay.append(prompt)
            for k, token in enumerate(tokens):
                picked = sample_rows(host, logits, history=prompt + tokens[:k], first_step=k,
                                     use_op=False, seed=seed, **options)
                assert picked[0] == token, f"step {k}"
                logits = replay.append([token])


# ---- batched steps and fp16 KV ---------------------------------------------------------------
# A batched decode step (tl_context_append_batch, generate_batch) runs RoPE, the K/V store
# and attention of all its rows in one launch each (backend.h: rope_store_rows,
# attention_rows), padded to a bucket of 1, 2, 4, 8, ... rows and recorded as one CUDA
# graph per bucket (batch_step_begin). fp16 KV (kv_dtype "f16") rounds keys and values to
# fp16 where they are stored; its results are held to the f32 path within this bound
# (log-probs and logits, absolute + relative: docs/api.md, "KV dtype").
KV_F16_TOLERANCE = (5e-2, 2e-2)
# (depth, length) of the rows of one step: sequences at different positions and depths
# (the call runs the deepest first, each row leaving the loop at its depth); five rows
# are padded to eight, eleven (tensor-core / tiled GEMM projections) to sixteen.
BATCH_SETUPS = {
    5: [(4, 9), (3, 3), (4, 30), (1, 14), (2, 6)],
    11: [(4, 9), (3, 3), (4, 30), (1, 14), (2, 6), (3, 21), (4, 1), (3, 12), (2, 27), (4, 5), (1, 2)],
}
BATCH_STEPS = 3
# (kv_page_size, kv_dtype): every dtype on two, a few dtypes on all four
BATCH_KV = [(0, "f32"), (8, "f16")]
BATCH_KV_ALL = [(0, "f32"), (0, "f16"), (8, "f32"), (8, "f16")]


def _kv_id(kv):
    return f"pages{kv[0]}-{kv[1]}"


def _batched_rows(model, tokens, setup):
    """Contexts at the setup's (depth, length) stepped BATCH_STEPS times together: the
    rows' logits of every step (steps x rows x vocab)."""
    contexts = []
    try:
        for depth, n in setup:
            contexts.append(model.context())
            contexts[-1].append(tokens[:n], depth=depth)
        return np.array([model.append_batch(contexts, [int(tokens[n + s]) for _, n in setup])
                         for s in range(BATCH_STEPS)], dtype=np.float64)
    finally:
        for ctx in contexts:
            ctx.close()


def _rows_alone(model, tokens, setup):
    """The same steps, each sequence on its own (one-row steps)."""
    out = []
    for depth, n in setup:
        with model.context() as ctx:
            ctx.append(tokens[:n], depth=depth)
            out.append([ctx.append([int(tokens[n + s])], depth=depth) for s in range(BATCH_STEPS)])
    return np.array(out, dtype=np.float64).transpose(1, 0, 2)


def _check_batched_steps(path, config, setup, kv, label):
    page_size, kv_dtype = kv
    tokens = _tokens(70 + len(setup), config["vocab_size"], 40)
    label = f"{label}, {len(setup)} rows, pages {page_size}, kv {kv_dtype}"
    with tinyloop.Model(path, device=CUDA, kv_page_size=page_size, kv_dtype=kv_dtype) as gpu:
        assert gpu.info.kv_dtype == kv_dtype
        batched = _batched_rows(gpu, tokens, setup)
        batched_again = _batched_rows(gpu, tokens, setup)   # the bucket's graph replayed
        alone = _rows_alone(gpu, tokens, setup)
        full = np.array([gpu.score_last_token(tokens[:n + BATCH_STEPS], depth=depth) for depth, n in setup])
    with tinyloop.Model(path, device="cpu", kv_page_size=page_size) as cpu:
        on_cpu = _rows_alone(cpu, tokens, setup)
    same = FLOAT_TOLERANCE if kv_dtype == "f32" else KV_F16_TOLERANCE
    against_f32 = _tolerance(config) if kv_dtype == "f32" else tuple(
        a + b for a, b in zip(_tolerance(config), KV_F16_TOLERANCE))
    assert_close(batched_again, batched, same, f"{label}: a replayed batched step")
    assert_close(batched, alone, same, f"{label}: batched vs one-row steps on CUDA")
    assert_close(batched, on_cpu, against_f32, f"{label}: batched on CUDA vs the CPU (f32 KV)")
    assert_close(batched[-1], full, same, f"{label}: batched decode vs full scoring")


@pytest.mark.parametrize("kv", BATCH_KV, ids=_kv_id)
@pytest.mark.parametrize("name", list(DTYPES))
def test_batched_steps_match_one_row_cpu_and_scoring(model_dir, name, kv):
    """Five sequences at different positions and depths, three batched steps (padded to
    eight rows, recorded, then replayed), for every weight dtype: each row equals the
    sequence stepped alone, the CPU and full-sequence scoring."""
    path = _model(model_dir, name, SMALL, DTYPES[name])
    _check_batched_steps(path, {**SMALL, **DTYPES[name]}, BATCH_SETUPS[5], kv, name)


@pytest.mark.parametrize("kv", BATCH_KV_ALL, ids=_kv_id)
@pytest.mark.parametrize("name", ["f32", "f16", "q4-g64", "q2-g128"])
def test_batched_steps_of_many_rows(model_dir, name, kv):
    """Eleven rows (projections on the GEMM, padded to sixteen), contiguous and paged,
    f32 and fp16 KV."""
    path = _model(model_dir, name, SMALL, DTYPES[name])
    _check_batched_steps(path, {**SMALL, **DTYPES[name]}, BATCH_SETUPS[11], kv, name)


@pytest.mark.parametrize("dtype", ["q4", "f16"])
def test_batched_steps_on_wide_rows(model_dir, dtype):
    """Eight-row GEMVs whose activations need more than the default shared memory: one
    kernel serves rows of 1536 floats (q/k/v, the head) and of 2048 (down), and a recorded
    step launches both when it ends, so the kernel's opt-in must allow the larger."""
    overrides = dict(d_model=1536, ffn_dim=2048, dtype=dtype, group_size=64 if dtype == "q4" else 32)
    path = _model(model_dir, f"wide-batch-{dtype}", WIDE_FFN, overrides)
    setup = [(2, 9), (1, 3), (2, 20), (1, 14), (2, 6)]
    _check_batched_steps(path, {**WIDE_FFN, **overrides}, setup, (0, "f32"), f"wide {dtype}")


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("kv", [(0, "f32"), (8, "f16")], ids=_kv_id)
def test_batched_generation_replays_bucket_graphs(model_dir, monkeypatch, graphs, kv):
    """generate_batch of 3, 8 and 12 prompts (buckets of 4, 8 and 16 rows, the greedy
    tokens of every row from one argmax launch), twice each, with CUDA graphs on and off,
    and a batch that shrinks as sequences stop on EOS: every prompt gets the tokens it
    gets alone. With fp16 KV a batched and a one-row step each round their own keys and
    values, so a near tie may go the other way: there the tokens must agree on most of
    their length."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
    page_size, kv_dtype = kv
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    vocab = SMALL["vocab_size"]
    prompts = [_tokens(80 + i, vocab, 3 + 2 * i).tolist() for i in range(12)]
    g = dict(temperature=0.0)
    with tinyloop.Model(path, device=CUDA, kv_page_size=page_size, kv_dtype=kv_dtype) as gpu:
        alone = [gpu.generate(p, max_tokens=20, eos=False, **g).tokens for p in prompts]
        eos = alone[0][6]
        stopping = [gpu.generate(p, max_tokens=20, eos=eos, **g).tokens for p in prompts]
        runs = []
        for b in (3, 8, 12, 12, 3):
            runs.append((alone[:b], [r.tokens for r in gpu.generate_batch(prompts[:b], max_tokens=20, eos=False, **g)]))
        runs.append((stopping, [r.tokens for r in gpu.generate_batch(prompts, max_tokens=20, eos=eos, **g)]))
    for expected, got in runs:
        if kv_dtype == "f32":
            assert got == expected
        else:
            agree = sum(_common_prefix(a, b) for a, b in zip(got, expected))
            assert agree >= 0.75 * sum(len(a) for a in expected), (got, expected)


@pytest.mark.parametrize("name", list(LONG_CASES))
@pytest.mark.parametrize("page_size", [0, 16])
def test_f16_kv_against_f32(model_dir, name, page_size):
    """A 500-token prefill and 30 decode steps (split attention, window, warm start) with
    fp16 KV: within KV_F16_TOLERANCE of the f32 cache, cached decode against fp16 full
    scoring, and half the KV bytes in the memory report."""
    path = _model(model_dir, name, LONG, LONG_CASES[name])
    tokens = _tokens(3, LONG["vocab_size"], 530)
    depth = LONG["default_depth"]
    rows, kv_bytes = {}, {}
    for kv_dtype in ("f32", "f16"):
        with tinyloop.Model(path, device=CUDA, kv_page_size=page_size, kv_dtype=kv_dtype) as gpu:
            with gpu.context() as ctx:
                out = [ctx.append(tokens[:500], depth=depth)]
                out += [ctx.append([int(tokens[i])]) for i in range(500, len(tokens))]
                assert gpu.info.kv_dtype == kv_dtype
                kv_bytes[kv_dtype] = gpu.memory_report()["kv_cache_bytes"]
            rows[kv_dtype] = np.array(out)
            if kv_dtype == "f16":
                full = gpu.score_last_token(tokens, depth=depth)
    assert kv_bytes["f16"] * 2 == kv_bytes["f32"] > 0
    assert_close(rows["f16"], rows["f32"], KV_F16_TOLERANCE, f"{name}, pages {page_size}: f16 vs f32 KV")
    assert_close(rows["f16"][-1], full, KV_F16_TOLERANCE, f"{name}, pages {page_size}: f16 cached vs full")


@pytest.mark.parametrize("page_size", [0, 8])
def test_f16_kv_forks_prefixes_and_trees(model_dir, page_size):
    """The copies of an fp16 cache (forks, copy on write, prefix caches and their loads,
    tree speculation's accepted rows) keep its elements: each continues as the same
    sequence appended afresh."""
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    vocab, depth = SMALL["vocab_size"], SMALL["default_depth"]
    prompt, more = _tokens(90, vocab, 21), _tokens(91, vocab, 6)
    g = dict(temperature=0.0, eos=False)
    with tinyloop.Model(path, device=CUDA, kv_page_size=page_size, kv_dtype="f16") as gpu:
        with gpu.context() as fresh:
            fresh.append(prompt, depth=depth)
            expected = [fresh.append([int(t)]) for t in more]
        with gpu.context() as ctx:
            ctx.append(prompt, depth=depth)
            with ctx.fork() as fork:
                got_fork = [fork.append([int(t)]) for t in more]
            got_parent = [ctx.append([int(t)]) for t in more]
        with gpu.prefix_cache(prompt, depth=depth) as cache, gpu.context(prefix=cache) as loaded:
            got_prefix = [loaded.append([int(t)]) for t in more]
        plain = gpu.generate(prompt, max_tokens=24, **g).tokens
        tree = gpu.generate(prompt, max_tokens=24, draft_depth=1, tree=(3, 2), **g).tokens
    for what, got in (("fork", got_fork), ("parent", got_parent), ("prefix", got_prefix)):
        assert_close(got, expected, KV_F16_TOLERANCE, f"pages {page_size}: f16 {what}")
    assert _common_prefix(tree, plain) >= 12, (tree, plain)


def test_kv_dtype_default_and_memory(model_dir):
    """f16 is CUDA's default, and halves the KV bytes of f32."""
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    kv = {}
    for asked, expected in (("default", "f16"), ("f32", "f32")):
        with tinyloop.Model(path, device=CUDA, kv_dtype=asked) as gpu, gpu.context() as ctx:
            assert gpu.info.kv_dtype == expected
            ctx.append(_tokens(2, SMALL["vocab_size"], 4))
            kv[expected] = gpu.memory_report()["kv_cache_bytes"]
    assert kv["f16"] * 2 == kv["f32"] > 0


def test_memory_report_counts_device_allocations(model_dir):
    path = _model(model_dir, "q4-g64", SMALL, DTYPES["q4-g64"])
    with tinyloop.Model(path, device=CUDA) as gpu:
        assert gpu.info.device_index >= 0 and "cuda" in gpu.info.device_name
        before = gpu.memory_report()
        assert before["device_bytes"] >= before["weights_bytes"] > 0
        with gpu.context() as ctx:
            ctx.append(_tokens(2, SMALL["vocab_size"], 4))
            during = gpu.memory_report()
            assert during["device_bytes"] >= before["device_bytes"] + during["kv_cache_bytes"]
            assert gpu.vram_usage_bytes() == during["device_bytes"]
        assert gpu.memory_report()["device_bytes"] < during["device_bytes"]


def test_out_of_range_device_is_a_clear_error(model_dir):
    path = _model(model_dir, "f32", SMALL, DTYPES["f32"])
    with pytest.raises(tinyloop.UnsupportedError, match="cuda:999"):
        tinyloop.Model(path, device="cuda:999")
