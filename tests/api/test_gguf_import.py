"""GGUF import of Llama 3.x RoPE scaling, the qwen2 architecture and K-quants.

Expected values come from a direct numpy HF model (test_convert.hf_llama_logits) and, for the
K-quant block layouts, from the `gguf` package's dequantizers (the format's Python
implementation, a test dependency): random K-quant blocks are decoded both ways."""

import numpy as np
import pytest

import tinyloop
from tinyloop.convert import ggml_blocks
from tinyloop.convert.from_gguf import convert_gguf
from tinyloop.errors import FormatError
from tinyloop.fileformat.tinyloop_file import read_file

from reference import ReferenceModel
from reference.ops import next_token_logprobs
from test_convert import (CFG, F32, GGUF_F32, GGUF_STRING, HEAD_DIM, gguf_name, hf_llama_logits,
                          llama_metadata, permute_for_interleaved, random_llama, write_gguf)

Q4_K, Q5_K, Q6_K = 12, 13, 14
TOKENS = [5, 17, 260, 99, 3, 120, 42, 7, 11, 200, 64, 9, 150, 33, 1, 280, 77, 8, 45, 230, 19, 2, 101, 55]


def llama3_inv_freq(theta, head_dim, factor=8.0, low=1.0, high=4.0, original_context=64):
    """HF's `rope_type: llama3` frequencies (modeling_rope_utils), float64."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > original_context / low, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original_context / high) & (wavelen <= original_context / low)
    return np.where(medium, smoothed, scaled)


def gguf_tensors(w: dict, permute: bool) -> list:
    tensors = []
    for key, value in w.items():
        if permute and key != "embed" and key[1] in ("q", "k"):
            value = permute_for_interleaved(value, CFG["heads"] if key[1] == "q" else CFG["kv_heads"])
        tensors.append((gguf_name(key), F32, value.shape, value.tobytes()))
    return tensors


def assert_runtime_matches_reference(path, tokens, quantized=False):
    """The C library's log-probs of the converted file against the float64 oracle, with the
    parity tests' tolerances (tests/lib/test_parity.py: quantized matrices are multiplied
    with int16-rounded activations on the CPU)."""
    expected = next_token_logprobs(ReferenceModel.from_file(path).logits(tokens), tokens)
    with tinyloop.Model(str(path)) as model:
        got = model.score(np.asarray(tokens, np.int32))
    atol, rtol = (1e-3, 1e-4) if quantized else (5e-5, 1e-5)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------ RoPE scaling

def test_llama3_rope_freqs_become_frequency_factors(tmp_path):
    rng = np.random.default_rng(21)
    w = random_llama(rng)
    inv_freq = llama3_inv_freq(CFG["theta"], HEAD_DIM)
    default = CFG["theta"] ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    factors = (default / inv_freq).astype(np.float32)   # what llama.cpp's converter stores
    assert len(set(np.round(factors, 3))) > 2            # unchanged, smoothed and scaled pairs
    tensors = gguf_tensors(w, permute=True) + [("rope_freqs.weight", F32, factors.shape, factors.tobytes())]
    write_gguf(tmp_path / "l3.gguf", llama_metadata(), tensors)
    convert_gguf(tmp_path / "l3.gguf", tmp_path / "l3.tinyloop", show_progress=False)

    with read_file(tmp_path / "l3.tinyloop") as f:
        np.testing.assert_array_equal(f.tensor("rope.freq_factors"), factors)
    got = ReferenceModel.from_file(tmp_path / "l3.tinyloop").logits(TOKENS)
    expected = hf_llama_logits(w, TOKENS, inv_freq=default / factors.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)
    # and the scaling is not a no-op at these positions
    assert np.abs(hf_llama_logits(w, TOKENS) - expected).max() > 1e-3
    assert_runtime_matches_reference(tmp_path / "l3.tinyloop", TOKENS)


def test_linear_rope_scaling_divides_every_frequency(tmp_path):
    rng = np.random.default_rng(22)
    w = random_llama(rng)
    meta = llama_metadata() + [("llama.rope.scaling.type", GGUF_STRING, "linear"),
                               ("llama.rope.scaling.factor", GGUF_F32, 4.0)]
    write_gguf(tmp_path / "lin.gguf", meta, gguf_tensors(w, permute=True))
    convert_gguf(tmp_path / "lin.gguf", tmp_path / "lin.tinyloop", show_progress=False)
    default = CFG["theta"] ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    got = ReferenceModel.from_file(tmp_path / "lin.tinyloop").logits(TOKENS)
    np.testing.assert_allclose(got, hf_llama_logits(w, TOKENS, inv_freq=default / 4.0), rtol=0, atol=1e-9)


def test_yarn_rope_scaling_is_refused(tmp_path):
    meta = llama_metadata() + [("llama.rope.scaling.type", GGUF_STRING, "yarn"),
                               ("llama.rope.scaling.factor", GGUF_F32, 4.0)]
    write_gguf(tmp_path / "yarn.gguf", meta, gguf_tensors(random_llama(np.random.default_rng(0)), True))
    with pytest.raises(FormatError, match="RoPE scaling 'yarn'"):
        convert_gguf(tmp_path / "yarn.gguf", tmp_path / "yarn.tinyloop", show_progress=False)


def test_rope_freq_factors_must_be_positive(tmp_path):
    from tinyloop.fileformat.random_model import make_random_model
    from tinyloop.fileformat.tinyloop_file import TinyLoopWriter
    path = tmp_path / "m.tinyloop"
    make_random_model(path, seed=1, vocab_size=64, d_model=32, n_head=2, n_kv_head=1, head_dim=16,
                      ffn_dim=64, n_pre=1, n_core=0, n_post=0, default_depth=0, max_depth=0,
                      max_seq_len=32, rope_freq_factors=1)
    with read_file(path) as f:
        writer = TinyLoopWriter(f.dims)
        for key, value in f.metadata.items():
            writer.add_metadata(key, value)
        for name in f.tensors:
            value = np.array(f.tensor(name), np.float32)
            if name == "rope.freq_factors":
                value[0] = -1.0
            writer.add_tensor(name, value, "f32")
    writer.write(tmp_path / "bad.tinyloop")
    with pytest.raises(FormatError, match="rope.freq_factors: factor 0 is -1"):
        tinyloop.Model(str(tmp_path / "bad.tinyloop"))


# ------------------------------------------------------------------ qwen2

@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_biases_half_rope_and_head(tmp_path, tied):
    rng = np.random.default_rng(23)
    w = random_llama(rng)
    cfg = dict(CFG, theta=1000000.0)
    kv = CFG["kv_heads"] * HEAD_DIM
    bias = {(i, p): (0.1 * rng.standard_normal(n)).astype(np.float32)
            for i in range(CFG["layers"]) for p, n in (("q", CFG["d"]), ("k", kv), ("v", kv))}
    head = None if tied else (rng.standard_normal((CFG["vocab"], CFG["d"])) / 8).astype(np.float32)
    tensors = gguf_tensors(w, permute=False)   # Qwen2 GGUFs keep HF's Q/K rows
    tensors += [(f"blk.{i}.attn_{p}.bias", F32, b.shape, b.tobytes()) for (i, p), b in bias.items()]
    if head is not None:
        tensors.append(("output.weight", F32, head.shape, head.tobytes()))
    write_gguf(tmp_path / "qwen.gguf", llama_metadata(cfg, arch="qwen2"), tensors)
    convert_gguf(tmp_path / "qwen.gguf", tmp_path / "qwen.tinyloop", show_progress=False)

    with read_file(tmp_path / "qwen.tinyloop") as f:
        meta = f.metadata
        assert (meta["arch.rope_style"], meta["arch.qkv_bias"], meta["arch.rope_theta"]) == ("half", 1, 1e6)
        assert meta["arch.tied_embeddings"] == int(tied)
    got = ReferenceModel.from_file(tmp_path / "qwen.tinyloop").logits(TOKENS)
    np.testing.assert_allclose(got, hf_llama_logits(w, TOKENS, head=head, cfg=cfg, bias=bias), rtol=0, atol=1e-9)
    assert_runtime_matches_reference(tmp_path / "qwen.tinyloop", TOKENS)


# ------------------------------------------------------------------ K-quants

try:
    import gguf.quants as gguf_quants
except ImportError:   # a test extra; only the K-quant tests need it
    gguf_quants = None
needs_gguf = pytest.mark.skipif(gguf_quants is None, reason="the `gguf` package (test extra) decodes the "
                                "K-quant reference values: pip install gguf to run the K-quant tests")


def _f16_bytes(values) -> np.ndarray:
    return np.asarray(values, np.float16).view(np.uint8).reshape(-1, 2)


def random_k_blocks(rng, ggml_type: int, n_blocks: int, exact: bool) -> np.ndarray:
    """Random blocks of a K-quant: every byte pattern of the quantized fields is valid; the
    fp16 super-block scales are powers of two when `exact` (then Q4_K's sub-block products
    fit fp16) or arbitrary."""
    def scale():
        if exact:
            return 2.0 ** rng.integers(-14, -8, n_blocks)
        return rng.uniform(0.5, 2.0, n_blocks) * 2.0 ** rng.integers(-14, -8, n_blocks)
    if ggml_type == Q4_K:   # [d][dmin][scales 12][qs 128]
        parts = [_f16_bytes(scale()), _f16_bytes(scale()), rng.integers(0, 256, (n_blocks, 140), dtype=np.uint8)]
    elif ggml_type == Q5_K:   # [d][dmin][scales 12][qh 32][qs 128]
        parts = [_f16_bytes(scale()), _f16_bytes(scale()), rng.integers(0, 256, (n_blocks, 172), dtype=np.uint8)]
    else:   # Q6_K: [ql 128][qh 64][scales int8 16][d]
        sc = rng.integers(-128, 128, (n_blocks, 16))
        if exact:   # both sub-blocks of each 32-group share one scale
            sc = np.repeat(sc[:, ::2], 2, axis=1)
        parts = [rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8), sc.astype(np.int8).view(np.uint8),
                 _f16_bytes(scale())]
    return np.concatenate(parts, axis=1).reshape(-1)


def gguf_package_values(raw: np.ndarray, ggml_type: int, shape) -> np.ndarray:
    rows, cols = shape
    return gguf_quants.dequantize(raw.reshape(rows, -1), ggml_type).astype(np.float64).reshape(shape)


@needs_gguf
@pytest.mark.parametrize("ggml_type", [Q4_K, Q5_K, Q6_K])
def test_k_quant_decoding_matches_the_gguf_package(ggml_type):
    rng = np.random.default_rng(ggml_type)
    shape = (6, 512)
    raw = random_k_blocks(rng, ggml_type, shape[0] * shape[1] // 256, exact=False)
    np.testing.assert_array_equal(ggml_blocks.decode_to_f32(raw, ggml_type, shape),
                                  gguf_package_values(raw, ggml_type, shape))


def _imported_values(raw, ggml_type, shape) -> tuple:
    """(dtype, change, the values of the imported tensor as the .tinyloop reader decodes them)."""
    from tinyloop.fileformat.quantize import dequantize_raw

    dtype, change = ggml_blocks.keep_quantized(raw, ggml_type, shape)
    imported = ggml_blocks.import_tensor(raw, ggml_type, shape)
    return dtype, change, dequantize_raw(dtype, shape, 32, imported.data.tobytes()).astype(np.float64)


@needs_gguf
@pytest.mark.parametrize("exact", [True, False])
def test_q4_k_is_kept_as_q4(exact):
    rng = np.random.default_rng(31)
    shape = (4, 768)
    raw = random_k_blocks(rng, Q4_K, shape[0] * shape[1] // 256, exact)
    dtype, change, values = _imported_values(raw, Q4_K, shape)
    expected = gguf_package_values(raw, Q4_K, shape)
    assert dtype == "q4"
    if exact:
        assert change == 0.0
        np.testing.assert_array_equal(values, expected)
    else:
        assert 0.0 < change < 1e-3 * np.abs(expected).max()
        assert np.abs(values - expected).max() <= change * (1 + 1e-6)


@needs_gguf
def test_q6_k_is_q8_where_exact_and_decoded_otherwise():
    rng = np.random.default_rng(32)
    shape = (4, 512)
    raw = random_k_blocks(rng, Q6_K, shape[0] * shape[1] // 256, exact=True)
    dtype, change, values = _imported_values(raw, Q6_K, shape)
    assert (dtype, change) == ("q8", 0.0)
    np.testing.assert_array_equal(values, gguf_package_values(raw, Q6_K, shape))
    raw = random_k_blocks(rng, Q6_K, shape[0] * shape[1] // 256, exact=False)
    assert ggml_blocks.keep_quantized(raw, Q6_K, shape) is None


@needs_gguf
def test_k_quant_model_conversion_reports_what_it_did(tmp_path, capsys):
    rng = np.random.default_rng(33)
    cfg = dict(CFG, d=256, ffn=256, heads=4, kv_heads=2)
    tensors, expected = [], {}
    kinds = {"q": Q4_K, "k": Q6_K, "v": Q5_K, "o": Q4_K, "gate": Q4_K, "up": Q6_K, "down": Q4_K}
    hd = cfg["d"] // cfg["heads"]
    for i in range(cfg["layers"]):
        for part, rows in (("q", 256), ("k", cfg["kv_heads"] * hd), ("v", cfg["kv_heads"] * hd), ("o", 256),
                           ("gate", 256), ("up", 256), ("down", 256)):
            raw = random_k_blocks(rng, kinds[part], rows, exact=part in ("o", "up"))
            tensors.append((gguf_name((i, part)), kinds[part], (rows, 256), raw.tobytes()))
            expected[gguf_name((i, part))] = gguf_package_values(raw, kinds[part], (rows, 256))
    embed = (rng.standard_normal((cfg["vocab"], 256)) / 16).astype(np.float32)
    tensors.append(("token_embd.weight", F32, embed.shape, embed.tobytes()))
    norms = ["norm"] + [(i, n) for i in range(cfg["layers"]) for n in ("attn_norm", "mlp_norm")]
    for key in norms:
        gain = (1 + 0.1 * rng.standard_normal(256)).astype(np.float32)
        tensors.append((gguf_name(key), F32, gain.shape, gain.tobytes()))
    meta = [(k, t, 64 if k == "llama.rope.dimension_count" else v) for k, t, v in llama_metadata(cfg)]
    write_gguf(tmp_path / "k.gguf", meta, tensors)

    summary = convert_gguf(tmp_path / "k.gguf", tmp_path / "k.tinyloop", show_progress=False)
    err = capsys.readouterr().err
    assert "kept quantized" in err and "decoded" in err
    assert sorted(x.split(" ")[0] for x in summary["lossy"]) == sorted(
        [gguf_name((i, "v")) for i in range(2)] + [gguf_name((i, "k")) for i in range(2)])
    assert sorted(x.split(" ")[0] for x in summary["rounded"]) == sorted(
        gguf_name((i, p)) for i in range(2) for p in ("q", "gate", "down"))
    with read_file(tmp_path / "k.tinyloop") as f:
        for i in range(2):
            assert f.tensors[f"pre.{i}.attn.o.weight"].dtype == "q4"      # exact Q4_K
            assert f.tensors[f"pre.{i}.mlp.up.weight"].dtype == "q8"      # exact Q6_K
            assert f.tensors[f"pre.{i}.attn.q.weight"].dtype == "q4"      # rounded Q4_K
            assert f.tensors[f"pre.{i}.attn.v.weight"].dtype == "f32"     # Q5_K decoded
            for part, ours in (("o", "attn.o"), ("up", "mlp.up"), ("v", "attn.v"), ("k", "attn.k")):
                np.testing.assert_array_equal(f.tensor(f"pre.{i}.{ours}.weight"), expected[gguf_name((i, part))])
    assert_runtime_matches_reference(tmp_path / "k.tinyloop", TOKENS[:8], quantized=True)


# ------------------------------------------------------------------ SentencePiece vocabularies

SPM_PIECES = {   # piece -> score (higher merges first)
    "\u2581": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
    "é": -2.0, "\u2581h": -5.0, "he": -3.0, "ll": -4.0, "llo": -6.0, "hello": -7.0, "\u2581hello": -8.0,
    "\u2581w": -9.0, "or": -3.5, "\u2581wor": -10.0, "ld": -4.5, "\u2581world": -11.0, "\u2581\u2581": -12.0,
    "lo": -4.0,   # ties with "ll": the leftmost pair is joined first
}


def spm_metadata(add_space_prefix=None) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + list(SPM_PIECES.values()),
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0}
    if add_space_prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return meta


def naive_spm(text: str, tokens: list, add_space_prefix: bool = True) -> list:
    """SentencePiece BPE by its definition (llama.cpp's tokenizer): spaces become ▁ (one in
    front of non-empty text), then the adjacent pair whose joined text is the best-scoring
    piece is joined, leftmost first, until none is a piece; a character that is no piece
    becomes its UTF-8 byte tokens."""
    if not text:
        return []
    text = ("\u2581" if add_space_prefix else "") + text.replace(" ", "\u2581")
    syms = list(text)
    while True:
        pairs = [(-SPM_PIECES[a + b], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in SPM_PIECES]
        if not pairs:
            break
        _, i = min(pairs)
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    ids = []
    for s in syms:
        ids += [tokens.index(s)] if s in SPM_PIECES else [3 + b for b in s.encode("utf-8")]
    return ids


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp(add_space_prefix):
    from tokenizers import Tokenizer

    from tinyloop.convert.gguf_tokenizer import tokenizer_json_from_gguf

    meta = spm_metadata(add_space_prefix)
    tok = Tokenizer.from_str(tokenizer_json_from_gguf(meta))
    prefix = add_space_prefix is not False
    for text in ["hello world", "  hello", "hellow", "héllo wörld 🙂", "llo", "lllo", "", "a\nb", "hello  world "]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == naive_spm(text, meta["tokenizer.ggml.tokens"], prefix), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_sentencepiece_needs_scores():
    meta = spm_metadata()
    del meta["tokenizer.ggml.scores"]
    from tinyloop.convert.gguf_tokenizer import tokenizer_json_from_gguf
    with pytest.raises(FormatError, match="scores are required"):
        tokenizer_json_from_gguf(meta)


def test_sentencepiece_files_add_bos_unless_they_say_otherwise():
    from tinyloop.convert.from_gguf import tokenizer_metadata

    class Meta:   # what tokenizer_metadata reads of a GGUFFile
        path = "spm.gguf"

        def __init__(self, metadata):
            self.metadata = metadata

        def get(self, key, default=None):
            return self.metadata.get(key, default)

    assert tokenizer_metadata(Meta(spm_metadata()))["tokenizer.add_bos"] == 1
    no_bos = dict(spm_metadata(), **{"tokenizer.ggml.add_bos_token": False})
    assert tokenizer_metadata(Meta(no_bos))["tokenizer.add_bos"] == 0
