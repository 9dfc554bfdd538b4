"""Parity of the CPU backend (through tinyloop.Model) with the float64 oracle.

Every architecture option is checked against a small base model, every weight dtype
against the same base, and a few combinations of both, at depths 1, default and max.
The oracle reads the same file, so quantized weights are compared on identical
dequantized values: only the backend's arithmetic (f32 accumulation, int16 activations
against quantized weights) is measured. Tolerances are explained in docs/testing.md.

Also checked: KV-cached decode equals full-sequence scoring, chunked prefill equals
one-shot prefill, and the portable (generic) kernels match like the vector ones (and
the AVX-512 VNNI path gives the AVX2 path's floats).

TINYLOOP_TEST_DEVICE (default "cpu") picks the device the models are opened on, e.g.
"cuda" (tools/gpu_check); a device that cannot be opened fails the tests, it does not
skip them. The CPU-kernel tests run only on "cpu".
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from device import DEVICE, ON_CPU
from reference import ReferenceModel
from reference.ops import log_softmax, next_token_logprobs
from tinyloop.fileformat.random_model import make_random_model

BASE = dict(seed=11, vocab_size=96, d_model=64, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128,
            n_pre=1, n_core=1, n_post=1, default_depth=3, max_depth=5, max_seq_len=48)
# group 128 needs every matrix's input width to be a multiple of 128
WIDE = dict(d_model=128, head_dim=32, ffn_dim=256)
N_TOKENS = 12

ARCH_CASES = {
    "base": {},
    "sandwich_outer": dict(norm_placement="sandwich_outer"),
    "sandwich_branch": dict(norm_placement="sandwich_branch"),
    "layernorm": dict(norm_type="layernorm"),
    "layernorm-sandwich_branch": dict(norm_type="layernorm", norm_placement="sandwich_branch"),
    "unit_offset": dict(norm_unit_offset=1),
    "norm_eps": dict(norm_eps=1e-2),
    "rope_interleaved": dict(rope_style="interleaved"),
    "rope_partial-half": dict(rope_dims=8),
    "rope_partial-interleaved": dict(rope_style="interleaved", rope_dims=6),
    "rope_theta": dict(rope_theta=500000.0),
    "rope_freq_factors": dict(rope_freq_factors=1, rope_theta=500000.0),
    "rope_freq_factors-interleaved-partial": dict(rope_freq_factors=1, rope_style="interleaved", rope_dims=6),
    "qkv_bias": dict(qkv_bias=1),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "sliding_window": dict(sliding_window=4),
    "attn_scale": dict(attn_scale=0.4),
    "untied": dict(tied_embeddings=0),
    "embed_scale": dict(embed_scale=8.0),
    "injection-none": dict(injection="none"),
    "injection-concat": dict(injection="concat"),
    "injection-concat-bias": dict(injection="concat", injection_bias=1),
    "init-zeros": dict(state_init="zeros"),
    "init-noise": dict(state_init="noise", noise_sigma=0.7, noise_seed=12345),
    "init-warm": dict(state_init="warm"),
    "loop_norm": dict(loop_norm=1),
    "loop_norm-layernorm": dict(loop_norm=1, norm_type="layernorm"),
    "mha": dict(n_kv_head=4),
    "mqa": dict(n_kv_head=1),
    "plain-llama": dict(n_pre=3, n_core=0, n_post=0, default_depth=0, max_depth=0),
    "core-only": dict(n_pre=0, n_post=0),
    "core2-no-coda": dict(n_pre=2, n_core=2, n_post=0),
    "coda2": dict(n_pre=0, n_core=1, n_post=2),
}

DTYPE_CASES = {
    "f16": dict(dtype="f16"),
    "bf16": dict(dtype="bf16"),
    "q8-g32": dict(dtype="q8", group_size=32),
    "q8-g64": dict(dtype="q8", group_size=64),
    "q8-g128": dict(dtype="q8", group_size=128, **WIDE),
    "q4-g32": dict(dtype="q4", group_size=32),
    "q4-g64": dict(dtype="q4", group_size=64),
    "q4-g128": dict(dtype="q4", group_size=128, **WIDE),
    "q2-g32": dict(dtype="q2", group_size=32),
    "q2-g64": dict(dtype="q2", group_size=64),
    "q2-g128": dict(dtype="q2", group_size=128, **WIDE),
    "q4-search": dict(dtype="q4", group_size=32, quant_method="search"),
    "q4-embed-f16": dict(dtype="q4", group_size=32, embed_dtype="f16"),
    "f32-embed-q8": dict(embed_dtype="q8", group_size=32),
    "bf16-embed-q2-untied": dict(dtype="bf16", embed_dtype="q2", group_size=64, tied_embeddings=0),
}

COMBINED_CASES = {
    # Huginn-like: sandwich_outer blocks, concat injection from a noise state, coda of 2
    "huginn-q4": dict(norm_placement="sandwich_outer", injection="concat", state_init="noise",
                      noise_sigma=1.0, n_pre=2, n_core=2, n_post=2,
                      dtype="q4", group_size=64, tied_embeddings=0),
    # Ouro/Gemma-like: branch norms with (1 + w), GELU, scaled embeddings, loop norm
    "ouro-bf16": dict(norm_placement="sandwich_branch", norm_unit_offset=1, activation="gelu_tanh",
                      embed_scale=8.0, loop_norm=1, injection="none", dtype="bf16"),
    "warm-window-q8": dict(state_init="warm", sliding_window=5, qkv_bias=1, dtype="q8", group_size=32),
    "llama-gqa-interleaved-q2": dict(n_pre=2, n_core=0, n_post=0, default_depth=0, max_depth=0,
                                     rope_style="interleaved", n_kv_head=1, dtype="q2", group_size=32),
    "layernorm-concat-zeros-f16": dict(norm_type="layernorm", injection="concat", injection_bias=1,
                                       state_init="zeros", loop_norm=1, rope_dims=10, dtype="f16"),
}
CASES = {**ARCH_CASES, **DTYPE_CASES, **COMBINED_CASES}

# (atol, rtol) on log-probs and on last-position logits, derived in docs/testing.md from the
# measured worst errors. "float": every matrix the backend multiplies is f32/f16/bf16;
# "quantized": some matrix is q8/q4/q2, and the backend rounds the activations it multiplies
# with it to int16 per block of 32 (a relative step of 1/32767 of the block's largest value).
# Those cases are held to the exact oracle and to the oracle that rounds activations the same
# way; both bounds are 2x the worst error measured on both kernel paths.
TOLERANCES = {"float": (5e-5, 1e-5), "quantized": (1e-3, 1e-4)}
INT16_ACTIVATION_TOLERANCE = (8e-4, 1e-4)
# cached decode and chunked prefill against one-shot scoring by the same backend
SAME_BACKEND_TOLERANCE = (2e-5, 2e-6)
QUANTIZED_DTYPES = ("q8", "q4", "q2")
# Other devices (CUDA) keep activations fp32 against every weight dtype, so every case is
# held to the exact oracle at about the float tolerance; the same bound covers their own
# cached-vs-full comparisons, whose row counts pick different kernels (GEMV vs GEMM,
# split-sequence vs tiled attention) and thus different summation orders.
DEVICE_TOLERANCE = (1e-4, 2e-5)
SAME = SAME_BACKEND_TOLERANCE if ON_CPU else DEVICE_TOLERANCE


def case_config(name: str) -> dict:
    return {**BASE, **CASES[name]}


def arithmetic(config: dict) -> str:
    """"quantized" when the backend multiplies some activation by a quantized matrix; an
    untied embedding is only looked up, never multiplied."""
    dtype = config.get("dtype", "f32")
    embed_dtype = config.get("embed_dtype") or dtype
    head_is_embed = config.get("tied_embeddings", 1)
    if dtype in QUANTIZED_DTYPES or (head_is_embed and embed_dtype in QUANTIZED_DTYPES):
        return "quantized"
    return "float"


def case_depths(config: dict) -> list:
    if config["n_core"] == 0:
        return [0]
    return sorted({1, config["default_depth"], config["max_depth"]})


def case_tokens(config: dict) -> np.ndarray:
    return np.random.default_rng(config["seed"] + 1).integers(
        0, config["vocab_size"], N_TOKENS).astype(np.int32)


def assert_close(actual, expected, tolerance, what):
    atol, rtol = tolerance
    err = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    allowed = atol + rtol * np.abs(expected)
    worst = int(np.argmax(err - allowed))
    assert np.all(err <= allowed), (
        f"{what}: max |error| {err.max():.3g} (at {worst}: got {np.asarray(actual).flat[worst]:.6g}, "
        f"expected {np.asarray(expected).flat[worst]:.6g}; atol {atol}, rtol {rtol})")


class ModelFiles:
    """Writes each case's model once per session and caches its oracle."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._references = {}

    def path(self, name: str) -> Path:
        path = self.directory / f"{name}.tinyloop"
        if not path.exists():
            make_random_model(path, **case_config(name))
        return path

    def reference(self, name: str, int16_activations: bool = False) -> ReferenceModel:
        key = (name, int16_activations)
        if key not in self._references:
            self._references[key] = ReferenceModel.from_file(self.path(name), int16_activations)
        return self._references[key]


def _cpu_has(*flags) -> bool:
    """Whether /proc/cpuinfo lists every one of these flags."""
    try:
        listed = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(flag in listed for flag in flags)


def _cpu_has_avx2() -> bool:
    return _cpu_has("avx2", "fma", "f16c")


def _cpu_has_avx512vnni() -> bool:
    return _cpu_has_avx2() and _cpu_has("avx512f", "avx512vl", "avx512bw", "avx512_vnni")


LEVEL_NAMES = ("generic", "avx2", "avx512vnni")


def _cpu_levels() -> tuple:
    """(best, built): the names of the CPU kernel level this CPU and the library run at
    best (before TINYLOOP_CPU) and of the highest one the library has kernels for (the
    test-only tl_testing_cpu_level, libtinyloop/src/testing/testing.h, of the testing
    library: the release library's core, built from the same sources)."""
    from testing_hooks import hooks_of, testing_library
    _, lib = hooks_of(testing_library())
    return LEVEL_NAMES[lib.tl_testing_cpu_level(0)], LEVEL_NAMES[lib.tl_testing_cpu_level(1)]


def _expected(reference: ReferenceModel, tokens, depth):
    """(log-probs of tokens[1:], logits of the last position) from one oracle pass."""
    logits = reference.logits(tokens, depth)
    return next_token_logprobs(logits, tokens), logits[-1]


def check_against_references(files, name, depth, logprobs, last_logits, label):
    """The backend's log-probs and last logits against the exact oracle and, for quantized
    models, against the oracle with int16 activations."""
    config = case_config(name)
    tokens = case_tokens(config)
    checks = [(files.reference(name), TOLERANCES[arithmetic(config)], "oracle")]
    if not ON_CPU:
        checks = [(files.reference(name), DEVICE_TOLERANCE, "oracle")]
    elif arithmetic(config) == "quantized":
        checks.append((files.reference(name, int16_activations=True), INT16_ACTIVATION_TOLERANCE,
                       "int16-activation oracle"))
    for reference, tolerance, which in checks:
        expected_logprobs, expected_last = _expected(reference, tokens, depth)
        assert_close(logprobs, expected_logprobs, tolerance, f"{label} depth {depth} log-probs vs {which}")
        assert_close(last_logits, expected_last, tolerance, f"{label} depth {depth} last logits vs {which}")


# ------------------------------------------------------------------ backend vs oracle

@pytest.mark.parametrize("name", list(CASES))
def test_scores_and_last_logits_match_reference(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        for depth in case_depths(config):
            check_against_references(files, name, depth, model.score(tokens, depth=depth),
                                     model.score_last_token(tokens, depth=depth), name)


UNCERTAINTY_CASES = ["base", "init-warm", "injection-concat", "coda2", "q4-g32", "huginn-q4",
                     "plain-llama"]


@pytest.mark.parametrize("name", UNCERTAINTY_CASES)
def test_uncertainty_is_the_entropy_of_each_prediction(files, name):
    """score_with_uncertainty: score's log-probs (the same pass, bit for bit) and the
    entropy of each position's softmax, against the oracle's logits, over 40 tokens (two
    batches of 32 logit rows) in one prefill chunk and in chunks of 7, on a model and on
    a context."""
    config = case_config(name)
    tokens = np.random.default_rng(config["seed"] + 2).integers(0, config["vocab_size"], 40).astype(np.int32)
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE
    for chunk in (0, 7):
        with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=chunk) as model:
            for depth in case_depths(config):
                label = f"{name} depth {depth}, prefill chunk {chunk or 'default'}"
                logp = log_softmax(files.reference(name).logits(tokens, depth)[:-1])
                expected = -(np.exp(logp) * logp).sum(axis=-1)
                logprobs, entropies = model.score_with_uncertainty(tokens, depth=depth)
                assert np.array_equal(logprobs, model.score(tokens, depth=depth)), label
                assert_close(entropies, expected, tolerance, f"{label}: entropies")
                with model.context() as ctx:
                    in_context = ctx.score_with_uncertainty(tokens, depth=depth)
                assert np.array_equal(in_context[0], logprobs), f"{label}: context log-probs"
                assert np.array_equal(in_context[1], entropies), f"{label}: context entropies"


def test_uncertainty_arguments(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with pytest.raises(ValueError):
            model.score_with_uncertainty([3])
        native, ffi = model._native, model._native.ffi
        ids = np.asarray([1, 2, 3], dtype=np.int32)
        out = np.zeros(2, dtype=np.float32)
        status = native.lib.tl_score_with_uncertainty(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), 3, ffi.NULL,
            ffi.from_buffer("float[]", out, require_writable=True), ffi.NULL)
        assert ffi.string(native.lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        assert b"entropies" in ffi.string(native.lib.tl_last_error())
        logprobs, entropies = model.score_with_uncertainty([1, 2, 3])
        assert entropies.shape == (2,) and np.all(entropies >= 0)
        assert np.all(entropies <= np.log(case_config("base")["vocab_size"]) + 1e-4)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU kernels")
def test_default_cpu_path_is_the_best_supported(files):
    """The library picks the best level its build has and the CPU runs (TINYLOOP_CPU
    unset): AVX-512 VNNI, else AVX2, else portable, as /proc/cpuinfo says."""
    best, built = _cpu_levels()
    if _cpu_has_avx512vnni() and built == "avx512vnni":
        assert best == "avx512vnni"
    elif _cpu_has_avx2():
        assert best == "avx2"
    else:
        assert best == "generic"
    if _cpu_has_avx512vnni() and built != "avx512vnni":
        warnings.warn("this library was built without the AVX-512 VNNI kernels (the compiler "
                      "lacks the flags) on a CPU that has the instructions")
    if os.environ.get("TINYLOOP_CPU") in (None, ""):
        with tinyloop.Model(files.path("base"), device="cpu") as model:
            assert f"({best})" in model.info.device_name, model.info.device_name


# ------------------------------------------------------------------ the generic kernels

GENERIC_CASES = ["base", "init-warm", "injection-concat-bias", "layernorm", *DTYPE_CASES,
                 "huginn-q4"]

_GENERIC_SCRIPT = """
import json, sys
import numpy as np
import tinyloop
out = {}
for job in json.loads(sys.argv[1]):
    with tinyloop.Model(job["path"], device="cpu") as model:
        tokens = np.array(job["tokens"], dtype=np.int32)
        out[job["name"]] = {
            "device": model.info.device_name,
            "score": model.score(tokens, depth=job["depth"]).tolist(),
            "last": model.score_last_token(tokens, depth=job["depth"]).tolist(),
        }
print(json.dumps(out))
"""


def _cpu_path_results(files, cpu_env):
    """Scores of GENERIC_CASES on the CPU path TINYLOOP_CPU=cpu_env selects (None: the
    best one). The variable is read once per process, so this runs in a child process."""
    jobs = []
    for name in GENERIC_CASES:
        config = case_config(name)
        jobs.append(dict(name=name, path=str(files.path(name)), tokens=case_tokens(config).tolist(),
                         depth=config["default_depth"]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("TINYLOOP_CPU", None)
    if cpu_env:
        env["TINYLOOP_CPU"] = cpu_env
    proc = subprocess.run([sys.executable, "-c", _GENERIC_SCRIPT, json.dumps(jobs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return jobs, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU kernels")
def test_generic_kernels_match_reference(files):
    jobs, results = _cpu_path_results(files, "generic")
    for job in jobs:
        got = results[job["name"]]
        assert "generic" in got["device"], got["device"]
        check_against_references(files, job["name"], job["depth"], got["score"], got["last"],
                                 f"generic {job['name']}")


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU kernels")
def test_avx512vnni_kernels_equal_avx2_bit_for_bit(files):
    """The AVX-512 VNNI build of the vector kernels computes the AVX2 build's int32 sums
    (vpdpwssd = madd + add), so every score and logit is the same float, every dtype."""
    if _cpu_levels()[0] != "avx512vnni":
        pytest.skip("LOUD SKIP: no AVX-512 VNNI on this CPU or in this build, so its kernel "
                    "path cannot run here")
    jobs, best = _cpu_path_results(files, None)
    _, avx2 = _cpu_path_results(files, "avx2")
    for job in jobs:
        name = job["name"]
        assert "avx512vnni" in best[name]["device"] and "avx2" in avx2[name]["device"]
        assert best[name]["score"] == avx2[name]["score"], name
        assert best[name]["last"] == avx2[name]["last"], name


# ------------------------------------------------------------------ cache and chunking

CACHE_CASES = ["base", "init-warm", "init-noise", "sliding_window", "injection-concat",
               "core2-no-coda", "plain-llama", "bf16", "q8-g32", "q4-g64", "q2-g32", "huginn-q4"]


@pytest.mark.parametrize("name", CACHE_CASES)
def test_cached_decode_equals_full_sequence(files, name):
    """A 5-token prefill then one token at a time through a context gives, at every
    position, the logits of the full-sequence pass (and the oracle's)."""
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"] if config["n_core"] else 0
    same = SAME
    reference_logits = files.reference(name).logits(tokens, depth)
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        full_scores = model.score(tokens, depth=depth)
        full_last = model.score_last_token(tokens, depth=depth)
        with model.context() as ctx:
            step_logits = [None] * 4 + [ctx.append(tokens[:5], depth=depth)]
            for t in tokens[5:]:
                step_logits.append(ctx.append([int(t)], depth=depth))
            assert len(ctx) == len(tokens)
    for pos in range(4, len(tokens)):
        assert_close(step_logits[pos], reference_logits[pos],
                     TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE,
                     f"{name} cached logits at {pos} vs reference")
        if pos + 1 < len(tokens):
            cached_lp = log_softmax(np.asarray(step_logits[pos], dtype=np.float64))[tokens[pos + 1]]
            assert_close([cached_lp], [full_scores[pos]], same, f"{name} cached log-prob at {pos}")
    assert_close(step_logits[-1], full_last.astype(np.float64), same, f"{name} cached last logits")


@pytest.mark.parametrize("name", ["base", "init-warm", "sliding_window", "q4-g32", "coda2"])
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_one_shot(files, name, chunk):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["default_depth"]
    same = SAME
    with tinyloop.Model(files.path(name), device=DEVICE) as one_shot, \
            tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=chunk) as chunked:
        assert_close(chunked.score(tokens, depth=depth), one_shot.score(tokens, depth=depth).astype(np.float64),
                     same, f"{name} chunk {chunk} log-probs")
        assert_close(chunked.score_last_token(tokens, depth=depth),
                     one_shot.score_last_token(tokens, depth=depth).astype(np.float64),
                     same, f"{name} chunk {chunk} last logits")


@pytest.mark.parametrize("name", ["base", "init-warm", "init-noise", "init-zeros", "huginn-q4",
                                  "coda2", "core-only", "core2-no-coda", "loop_norm",
                                  "injection-none", "injection-concat", "sandwich_branch",
                                  "sliding_window"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_logit_lens_is_every_depths_last_logits(files, name, chunk):
    """tl_score_logit_lens: row d-1 is score_last_token at depth d (bit for bit on the CPU)
    and the oracle's; the shared pass (one chunk: 12 tokens, or exactly 5 of them with
    chunk 5) and the pass per depth (warm init, or several chunks); one token, also right
    after a greedy generation (which leaves a chained token on a GPU)."""
    config = case_config(name)
    tokens = case_tokens(config)
    same = (0.0, 0.0) if ON_CPU else SAME
    with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=chunk) as model:
        for ids in (tokens, tokens[:5], tokens[:1]):
            lens = model.score_logit_lens(ids)
            assert lens.shape == (config["max_depth"], config["vocab_size"])
            for depth in range(1, config["max_depth"] + 1):
                assert_close(lens[depth - 1], model.score_last_token(ids, depth=depth).astype(np.float64),
                             same, f"{name} lens of {len(ids)} at depth {depth}")
                assert_close(lens[depth - 1], files.reference(name).logits(ids, depth)[-1],
                             TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE,
                             f"{name} lens of {len(ids)} at depth {depth} vs reference")
        assert np.array_equal(model.score_logit_lens(tokens, max_depth=2), model.score_logit_lens(tokens)[:2])
        model.generate(tokens[:4], max_tokens=3, temperature=0)
        after = model.score_logit_lens(tokens[7:8])
        assert_close(after[0], model.score_last_token(tokens[7:8], depth=1).astype(np.float64), same,
                     f"{name} one-token lens after a generation")
        with pytest.raises(tinyloop.InvalidArgumentError, match="max_depth"):
            model.score_logit_lens(tokens, max_depth=config["max_depth"] + 1)
    with tinyloop.Model(files.path("plain-llama"), device=DEVICE) as dense:
        with pytest.raises(tinyloop.UnsupportedError, match="no loop"):
            dense.score_logit_lens(tokens[:3], max_depth=1)
