"""Import tools: GGUF (bit-exact dtypes, RoPE layout), HF safetensors, tokenizer, re-quantize.

Every input here is synthetic and built by the test itself: a minimal GGUF writer, a tiny
HF Llama checkpoint, a byte-level BPE vocabulary. Expected values come from what the test
wrote (GGUF blocks) or from a direct numpy Llama written the way HF computes it."""

import json
import struct

import numpy as np
import pytest

from tinyloop.convert import ggml_blocks
from tinyloop.convert.cli_entry import main_convert
from tinyloop.convert.from_gguf import convert_gguf
from tinyloop.convert.from_safetensors import convert_safetensors
from tinyloop.convert.gguf_reader import GGUFFile
from tinyloop.convert.gguf_tokenizer import tokenizer_json_from_gguf
from tinyloop.convert.quantize_model import quantize_model
from tinyloop.errors import FormatError
from tinyloop.fileformat.tinyloop_file import read_file

from reference import ReferenceModel

# ------------------------------------------------------------------ a minimal GGUF writer

GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 4, 5, 6, 7, 8, 9
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gguf_value(vtype: int, value) -> bytes:
    if vtype == GGUF_STRING:
        return _gguf_string(value)
    if vtype == GGUF_ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(_gguf_value(item_type, v) for v in items)
    return struct.pack({GGUF_U32: "<I", GGUF_I32: "<i", GGUF_F32: "<f", GGUF_BOOL: "<?"}[vtype], value)


def write_gguf(path, metadata: list, tensors: list, alignment: int = 32) -> None:
    """metadata: [(key, type, value)]; tensors: [(name, ggml_type, shape rows-first, bytes)]."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, vtype, value in metadata:
        out += _gguf_string(key) + struct.pack("<I", vtype) + _gguf_value(vtype, value)
    offset, blobs = 0, []
    for name, ggml_type, shape, data in tensors:
        ne = list(reversed(shape))  # GGUF lists the innermost dim first
        out += _gguf_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", ggml_type, offset)
        blobs.append((offset, data))
        offset = -(-(offset + len(data)) // alignment) * alignment
    out += b"\0" * (-len(out) % alignment)
    base = len(out)
    out += b"\0" * offset
    for off, data in blobs:
        out[base + off: base + off + len(data)] = data
    with open(path, "wb") as f:
        f.write(out)


# ------------------------------------------------------------------ quantized blocks with known values

def _random_f16_scales(rng, n):
    return (rng.uniform(0.5, 2.0, n) * 2.0 ** rng.integers(-8, -2, n)).astype(np.float16)


def make_blocks(rng, ggml_type: int, shape) -> tuple:
    """Random raw tensor data of `ggml_type` and the float64 values it stands for."""
    rows, cols = shape
    n_blocks = rows * cols // 32
    if ggml_type == F32:
        w = rng.standard_normal(shape).astype(np.float32)
        return w.tobytes(), w.astype(np.float64)
    if ggml_type == F16:
        w = rng.standard_normal(shape).astype(np.float16)
        return w.tobytes(), w.astype(np.float64)
    d = _random_f16_scales(rng, n_blocks)
    dd = d.astype(np.float64)[:, None]
    if ggml_type == Q8_0:
        q = rng.integers(-127, 128, (n_blocks, 32)).astype(np.int8)
        blocks = [d[i].tobytes() + q[i].tobytes() for i in range(n_blocks)]
        return b"".join(blocks), (dd * q).reshape(shape)
    q = rng.integers(0, 16, (n_blocks, 32)).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)  # ggml: element j low nibble, j+16 high nibble
    if ggml_type == Q4_0:
        blocks = [d[i].tobytes() + packed[i].tobytes() for i in range(n_blocks)]
        return b"".join(blocks), (dd * (q.astype(np.float64) - 8)).reshape(shape)
    m = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
    blocks = [d[i].tobytes() + m[i].tobytes() + packed[i].tobytes() for i in range(n_blocks)]
    return b"".join(blocks), (dd * q + m.astype(np.float64)[:, None]).reshape(shape)


# ------------------------------------------------------------------ a tiny Llama

CFG = dict(vocab=300, d=64, heads=4, kv_heads=2, ffn=128, layers=2, theta=10000.0, eps=1e-5)
HEAD_DIM = CFG["d"] // CFG["heads"]


def llama_shapes(cfg=CFG) -> dict:
    d, f, kv = cfg["d"], cfg["ffn"], cfg["kv_heads"] * HEAD_DIM
    shapes = {"embed": (cfg["vocab"], d), "norm": (d,)}
    for i in range(cfg["layers"]):
        shapes.update({(i, "q"): (d, d), (i, "k"): (kv, d), (i, "v"): (kv, d), (i, "o"): (d, d),
                       (i, "gate"): (f, d), (i, "up"): (f, d), (i, "down"): (d, f),
                       (i, "attn_norm"): (d,), (i, "mlp_norm"): (d,)})
    return shapes


def random_llama(rng) -> dict:
    w = {}
    for key, shape in llama_shapes().items():
        if len(shape) == 1:
            w[key] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[key] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return w


def hf_name(key) -> str:
    if key == "embed":
        return "model.embed_tokens.weight"
    if key == "norm":
        return "model.norm.weight"
    i, part = key
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "mlp_norm": "post_attention_layernorm"}
    return f"model.layers.{i}.{names[part]}.weight"


def gguf_name(key) -> str:
    if key == "embed":
        return "token_embd.weight"
    if key == "norm":
        return "output_norm.weight"
    i, part = key
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
             "up": "ffn_up", "down": "ffn_down", "attn_norm": "attn_norm", "mlp_norm": "ffn_norm"}
    return f"blk.{i}.{names[part]}.weight"


def permute_for_interleaved(w, n_heads):
    """HF Q/K rows (half-split rotary pairs) -> the GGUF order (adjacent rotary pairs)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_llama_logits(w: dict, tokens, head=None, cfg=CFG, inv_freq=None, bias=None) -> np.ndarray:
    """Llama as HF computes it (rotate_half RoPE), float64, causal, GQA; tied head unless
    `head` is given; `inv_freq` replaces RoPE's default frequencies (HF's rope scaling),
    `bias` = {(i, "q"|"k"|"v"): vector} adds Qwen2's projection biases."""
    g = {k: v.astype(np.float64) for k, v in w.items()}
    n, hd, h, kvh = len(tokens), HEAD_DIM, cfg["heads"], cfg["kv_heads"]
    bias = {k: v.astype(np.float64) for k, v in (bias or {}).items()}

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg["eps"]) * weight

    def proj(x, i, part):
        return x @ g[(i, part)].T + bias.get((i, part), 0.0)

    if inv_freq is None:
        inv_freq = cfg["theta"] ** (-np.arange(0, hd, 2) / hd)
    angles = np.arange(n)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]

    def rope(x):
        rotated = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)
        return x * cos + rotated * sin

    x = g["embed"][np.asarray(tokens)]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg["layers"]):
        a = rms(x, g[(i, "attn_norm")])
        q = rope(proj(a, i, "q").reshape(n, h, hd))
        k = rope(proj(a, i, "k").reshape(n, kvh, hd))
        v = proj(a, i, "v").reshape(n, kvh, hd)
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, h * hd) @ g[(i, "o")].T
        m = rms(x, g[(i, "mlp_norm")])
        gate, up = m @ g[(i, "gate")].T, m @ g[(i, "up")].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[(i, "down")].T
    head = g["embed"] if head is None else head.astype(np.float64)
    return rms(x, g["norm"]) @ head.T


# ------------------------------------------------------------------ a byte-level BPE vocabulary

def byte_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "Ġ 1"]
SPECIALS = ["<|endoftext|>", "<|user|>"]


def synthetic_vocab():
    """(tokens, token_type, merges): 256 byte tokens, the merge results, two specials."""
    tokens = list(byte_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [1] * len(tokens) + [3, 4]  # a control token and a user-defined one
    tokens += SPECIALS
    return tokens, types, MERGES


def naive_bpe(word: str, merges: list) -> list:
    """Merge the adjacent pair of lowest rank until none applies (BPE by definition)."""
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    parts = list(word)
    while True:
        pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        if not pairs or min(pairs)[0] == len(ranks):
            return parts
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def tokenizer_metadata(pre: str = "gpt-2") -> list:
    tokens, types, merges = synthetic_vocab()
    return [
        ("tokenizer.ggml.model", GGUF_STRING, "gpt2"),
        ("tokenizer.ggml.pre", GGUF_STRING, pre),
        ("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, tokens)),
        ("tokenizer.ggml.token_type", GGUF_ARRAY, (GGUF_I32, types)),
        ("tokenizer.ggml.merges", GGUF_ARRAY, (GGUF_STRING, merges)),
        ("tokenizer.ggml.bos_token_id", GGUF_U32, len(tokens) - 2),
        ("tokenizer.ggml.eos_token_id", GGUF_U32, len(tokens) - 2),
        ("tokenizer.ggml.add_bos_token", GGUF_BOOL, True),
        ("tokenizer.chat_template", GGUF_STRING, "{{ messages }}"),
    ]


def llama_metadata(cfg=CFG, arch="llama") -> list:
    return [
        ("general.architecture", GGUF_STRING, arch),
        ("general.name", GGUF_STRING, "tiny test llama"),
        ("general.license", GGUF_STRING, "public-domain"),
        (f"{arch}.block_count", GGUF_U32, cfg["layers"]),
        (f"{arch}.context_length", GGUF_U32, 128),
        (f"{arch}.embedding_length", GGUF_U32, cfg["d"]),
        (f"{arch}.feed_forward_length", GGUF_U32, cfg["ffn"]),
        (f"{arch}.attention.head_count", GGUF_U32, cfg["heads"]),
        (f"{arch}.attention.head_count_kv", GGUF_U32, cfg["kv_heads"]),
        (f"{arch}.rope.freq_base", GGUF_F32, cfg["theta"]),
        (f"{arch}.attention.layer_norm_rms_epsilon", GGUF_F32, cfg["eps"]),
        (f"{arch}.rope.dimension_count", GGUF_U32, HEAD_DIM),
    ] + tokenizer_metadata()


# ------------------------------------------------------------------ GGUF tests

# one ggml type per matrix so that every lossless import path is exercised
GGUF_TYPES = {"embed": Q8_0, "q": Q4_0, "k": Q4_1, "v": F16, "o": Q8_0,
              "gate": Q4_1, "up": Q4_0, "down": F32}
OUR_DTYPES = {F32: "f32", F16: "f16", Q8_0: "q8", Q4_0: "q4", Q4_1: "q4"}


def test_gguf_dtypes_import_bit_exactly(tmp_path):
    rng = np.random.default_rng(1)
    tensors, expected = [], {}
    for key, shape in llama_shapes().items():
        ggml_type = F32 if len(shape) == 1 else GGUF_TYPES[key if key == "embed" else key[1]]
        if len(shape) == 1:
            w = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            data, values = w.tobytes(), w.astype(np.float64)
        else:
            data, values = make_blocks(rng, ggml_type, shape)
        tensors.append((gguf_name(key), ggml_type, shape, data))
        expected[gguf_name(key)] = (ggml_type, values)
    src, dst = tmp_path / "tiny.gguf", tmp_path / "tiny.tinyloop"
    write_gguf(src, llama_metadata(), tensors)

    summary = convert_gguf(src, dst, show_progress=False)
    assert summary["lossy"] == []

    from tinyloop.convert.from_gguf import map_tensor_name
    with read_file(dst, verify_checksums=True) as f:
        assert f.dims["n_pre"] == CFG["layers"] and f.dims["n_core"] == 0 and f.dims["max_depth"] == 0
        assert set(f.tensors) == {map_tensor_name(n, CFG["layers"]) for n in expected}
        for name, (ggml_type, values) in expected.items():
            ours = map_tensor_name(name, CFG["layers"])
            entry = f.tensors[ours]
            assert entry.dtype == OUR_DTYPES[ggml_type], name
            assert entry.group_size == (32 if ggml_type in (Q8_0, Q4_0, Q4_1) else 0)
            np.testing.assert_array_equal(f.tensor(ours), values, err_msg=name)
        meta = f.metadata
        assert meta["arch.rope_style"] == "interleaved"
        assert meta["arch.tied_embeddings"] == 1
        assert meta["arch.rope_theta"] == CFG["theta"]
        assert meta["arch.norm_eps"] == pytest.approx(CFG["eps"], rel=1e-7)
        assert meta["general.name"] == "tiny test llama"
        assert meta["tokenizer.add_bos"] == 1
        assert meta["tokenizer.bos_id"] == synthetic_vocab()[0].index("<|endoftext|>")
        assert meta["tokenizer.chat_template"] == "{{ messages }}"


def test_gguf_and_safetensors_imports_compute_the_hf_function(tmp_path):
    """The same weights through GGUF (Q/K permuted, interleaved RoPE) and through HF
    safetensors (half RoPE) give the logits of a direct numpy HF Llama."""
    rng = np.random.default_rng(2)
    w = random_llama(rng)
    tokens = [5, 17, 260, 99, 3, 120, 42, 7]
    expected = hf_llama_logits(w, tokens)

    tensors = []
    for key, value in w.items():
        if key != "embed" and key[1] in ("q", "k"):
            value = permute_for_interleaved(value, CFG["heads"] if key[1] == "q" else CFG["kv_heads"])
        tensors.append((gguf_name(key), F32, value.shape, value.tobytes()))
    write_gguf(tmp_path / "m.gguf", llama_metadata(), tensors)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "from_gguf.tinyloop", show_progress=False)

    ckpt = write_hf_checkpoint(tmp_path / "hf", w)
    convert_safetensors(ckpt, tmp_path / "from_hf.tinyloop", show_progress=False)

    for path in ("from_gguf.tinyloop", "from_hf.tinyloop"):
        got = ReferenceModel.from_file(tmp_path / path).logits(tokens)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9, err_msg=path)


def test_gguf_other_types_are_decoded_with_a_warning(tmp_path, capsys):
    """A Q5_0 matrix has no exact TinyLoop dtype: it is decoded to the fallback dtype."""
    rng = np.random.default_rng(3)
    tensors = []
    d, f = CFG["d"], CFG["ffn"]
    for key, shape in llama_shapes().items():
        data, _ = make_blocks(rng, F32, shape) if len(shape) == 2 else (np.ones(shape, np.float32).tobytes(), None)
        tensors.append((gguf_name(key), F32, shape, data))
    # replace one matrix by Q5_0 blocks: d, 32 fifth bits, nibbles; w = d (q - 16)
    n_blocks = f * d // 32
    scales = _random_f16_scales(rng, n_blocks)
    q = rng.integers(0, 32, (n_blocks, 32))
    qh = (((q >> 4) & 1) << np.arange(32)).sum(axis=1).astype("<u4")
    low = (q & 15).astype(np.uint8)
    nibbles = low[:, :16] | (low[:, 16:] << 4)
    blob = b"".join(scales[i].tobytes() + qh[i].tobytes() + nibbles[i].tobytes() for i in range(n_blocks))
    tensors = [(n, 6, s, blob) if n == "blk.1.ffn_up.weight" else (n, t, s, b) for n, t, s, b in tensors]
    write_gguf(tmp_path / "q5.gguf", llama_metadata(), tensors)

    summary = convert_gguf(tmp_path / "q5.gguf", tmp_path / "q5.tinyloop", fallback_dtype="f32", show_progress=False)
    assert summary["lossy"] == ["blk.1.ffn_up.weight (Q5_0 -> f32)"]
    assert "warning" in capsys.readouterr().err
    with read_file(tmp_path / "q5.tinyloop") as out:
        expected = (scales.astype(np.float64)[:, None] * (q - 16)).reshape(f, d)
        np.testing.assert_array_equal(out.tensor("pre.1.mlp.up.weight"), expected)


def test_gguf_reader_rejects_bad_files(tmp_path):
    rng = np.random.default_rng(4)
    data, _ = make_blocks(rng, Q4_1, (64, 64))
    write_gguf(tmp_path / "ok.gguf", [("general.architecture", GGUF_STRING, "llama")],
               [("t", Q4_1, (64, 64), data)])
    raw = (tmp_path / "ok.gguf").read_bytes()
    with GGUFFile(tmp_path / "ok.gguf") as g:
        assert g.tensors["t"].shape == (64, 64) and g.tensors["t"].type_name == "Q4_1"

    cases = {
        "magic": (b"GGUX" + raw[4:], "bad magic"),
        "version": (raw[:4] + struct.pack("<I", 9) + raw[8:], "version 9"),
        "truncated data": (raw[:-10], "truncated"),
        "truncated header": (raw[:40], "truncated"),
        "huge count": (raw[:8] + struct.pack("<Q", 1 << 40) + raw[16:], "more than the file"),
    }
    for label, (blob, message) in cases.items():
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(blob)
        with pytest.raises(FormatError, match=message):
            GGUFFile(path)


def test_gguf_rejects_other_architectures(tmp_path):
    meta = [(k, t, "gpt2" if k == "general.architecture" else v) for k, t, v in llama_metadata()]
    write_gguf(tmp_path / "gpt2.gguf", meta, [])
    with pytest.raises(FormatError, match="architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out.tinyloop", show_progress=False)


def test_q4_0_with_a_scale_too_large_for_its_min_is_decoded():
    """-8 d overflows fp16 when |d| > 8188: that block cannot be stored as q4 exactly."""
    d = np.array([9000.0], np.float16)
    raw = np.frombuffer(d.tobytes() + bytes(range(16)), np.uint8)
    assert ggml_blocks.lossless_dtype(raw, Q4_0, (1, 32)) is None
    ok = np.frombuffer(np.array([0.5], np.float16).tobytes() + bytes(range(16)), np.uint8)
    assert ggml_blocks.lossless_dtype(ok, Q4_0, (1, 32)) == "q4"


# ------------------------------------------------------------------ tokenizer

def _tokenizer(pre="gpt-2"):
    from tokenizers import Tokenizer

    meta = {k: (list(v[1]) if t == GGUF_ARRAY else v) for k, t, v in tokenizer_metadata(pre)}
    return Tokenizer.from_str(tokenizer_json_from_gguf(meta))


def test_tokenizer_from_gguf_matches_bpe_and_round_trips():
    tok = _tokenizer()
    tokens, _, merges = synthetic_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    # pre-tokenized by hand: "hello" " world"
    expected = [ids[p] for word in ("hello", "Ġworld") for p in naive_bpe(word, merges)]
    assert tok.encode("hello world", add_special_tokens=False).ids == expected
    assert expected == [ids["hello"], ids["Ġworld"]]
    # special tokens are single ids wherever they appear
    got = tok.encode("hi<|endoftext|>there<|user|>", add_special_tokens=False).ids
    assert ids["<|endoftext|>"] in got and ids["<|user|>"] in got
    for text in ["hello world", "  spaces\tand\nlines\n", "ünïcödé 日本 🙂", "a<|endoftext|>b", ""]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_tokenizer_pre_tokenizer_follows_gguf_pre():
    tokens, _, _ = synthetic_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    gpt2, smollm = _tokenizer("gpt-2"), _tokenizer("smollm")
    # the GPT-2 split keeps digits together, so "1 2" (rank 9) merges before "Ġ 1" (rank 10)
    assert gpt2.encode("12", add_special_tokens=False).ids == [ids["12"]]
    assert gpt2.encode(" 12", add_special_tokens=False).ids == [ids["Ġ"], ids["12"]]
    # smollm splits every digit off first, so digits never merge
    assert smollm.encode("12", add_special_tokens=False).ids == [ids["1"], ids["2"]]
    assert smollm.encode(" 12", add_special_tokens=False).ids == [ids["Ġ"], ids["1"], ids["2"]]


def test_tokenizer_unknown_pre_is_an_error():
    meta = {k: (list(v[1]) if t == GGUF_ARRAY else v) for k, t, v in tokenizer_metadata("no-such-pre")}
    with pytest.raises(FormatError, match="pre-tokenizer 'no-such-pre'"):
        tokenizer_json_from_gguf(meta)


# ------------------------------------------------------------------ safetensors

def write_hf_checkpoint(directory, w: dict, dtype="F32", untied_head=None):
    from safetensors.numpy import save_file

    directory.mkdir()
    arrays = {hf_name(k): v for k, v in w.items()}
    if untied_head is not None:
        arrays["lm_head.weight"] = untied_head
    if dtype == "F32":
        save_file(arrays, str(directory / "model.safetensors"))
    else:  # numpy has no bfloat16: write the file layout by hand (header + raw bf16 bits)
        header, blobs, offset = {}, [], 0
        for name, a in sorted(arrays.items()):
            bits = (a.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
            header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [offset, offset + len(bits)]}
            blobs.append(bits)
            offset += len(bits)
        h = json.dumps(header).encode()
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    config = {
        "model_type": "llama", "vocab_size": CFG["vocab"], "hidden_size": CFG["d"],
        "intermediate_size": CFG["ffn"], "num_hidden_layers": CFG["layers"],
        "num_attention_heads": CFG["heads"], "num_key_value_heads": CFG["kv_heads"],
        "rms_norm_eps": CFG["eps"], "rope_theta": CFG["theta"], "max_position_embeddings": 256,
        "tie_word_embeddings": untied_head is None, "hidden_act": "silu",
        "bos_token_id": 298, "eos_token_id": [299, 298],
    }
    (directory / "config.json").write_text(json.dumps(config))
    meta = {k: (list(v[1]) if t == GGUF_ARRAY else v) for k, t, v in tokenizer_metadata()}
    (directory / "tokenizer.json").write_text(tokenizer_json_from_gguf(meta))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return directory


def test_safetensors_untied_head_and_metadata(tmp_path):
    rng = np.random.default_rng(5)
    w = random_llama(rng)
    head = (rng.standard_normal((CFG["vocab"], CFG["d"])) / 8).astype(np.float32)
    ckpt = write_hf_checkpoint(tmp_path / "hf", w, untied_head=head)
    convert_safetensors(ckpt, tmp_path / "m.tinyloop", show_progress=False)
    with read_file(tmp_path / "m.tinyloop") as f:
        assert f.metadata["arch.tied_embeddings"] == 0 and f.metadata["arch.rope_style"] == "half"
        assert f.metadata["tokenizer.bos_id"] == 298 and f.metadata["tokenizer.eos_id"] == 299
        assert f.metadata["tokenizer.add_bos"] == 0
        np.testing.assert_array_equal(f.tensor("output.weight"), head.astype(np.float64))
    tokens = [1, 2, 3, 250, 4]
    got = ReferenceModel.from_file(tmp_path / "m.tinyloop").logits(tokens)
    np.testing.assert_allclose(got, hf_llama_logits(w, tokens, head=head), rtol=0, atol=1e-9)


def test_safetensors_bf16_is_kept_bit_exactly_or_cast(tmp_path):
    rng = np.random.default_rng(6)
    w = random_llama(rng)
    ckpt = write_hf_checkpoint(tmp_path / "hf", w, dtype="BF16")
    convert_safetensors(ckpt, tmp_path / "keep.tinyloop", show_progress=False)
    convert_safetensors(ckpt, tmp_path / "f32.tinyloop", dtype="f32", show_progress=False)
    bf16 = (w[(0, "q")].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    with read_file(tmp_path / "keep.tinyloop") as keep, read_file(tmp_path / "f32.tinyloop") as f32:
        assert keep.tensors["pre.0.attn.q.weight"].dtype == "bf16"
        assert f32.tensors["pre.0.attn.q.weight"].dtype == "f32"
        np.testing.assert_array_equal(keep.tensor("pre.0.attn.q.weight"), bf16)
        np.testing.assert_array_equal(f32.tensor("pre.0.attn.q.weight"), bf16)


# ------------------------------------------------------------------ re-quantization and CLI

def test_quantize_model_quantizes_matrices_only(tmp_path):
    rng = np.random.default_rng(7)
    ckpt = write_hf_checkpoint(tmp_path / "hf", random_llama(rng))
    convert_safetensors(ckpt, tmp_path / "f32.tinyloop", show_progress=False)
    quantize_model(tmp_path / "f32.tinyloop", tmp_path / "q4.tinyloop", dtype="q4", group_size=32,
                   method="rtn", embed_dtype="q8", show_progress=False)
    with read_file(tmp_path / "f32.tinyloop") as src, read_file(tmp_path / "q4.tinyloop") as out:
        assert out.dims == src.dims
        assert out.metadata["tokenizer.json"] == src.metadata["tokenizer.json"]
        for name, e in out.tensors.items():
            if len(e.shape) == 1:
                assert e.dtype == "f32" and bytes(out.raw(name)) == bytes(src.raw(name))
                continue
            assert (e.dtype, e.group_size) == (("q8" if name == "embed.weight" else "q4"), 32), name
            w = src.tensor(name)
            err = np.abs(out.tensor(name) - w).reshape(w.shape[0], -1, 32)
            span = np.ptp(w.reshape(w.shape[0], -1, 32), axis=-1, keepdims=True)
            # q4: half a step of (max - min) / 15, plus fp16 rounding of scale and min
            assert np.all(err <= span / 15 * 0.5 * 1.01 + 1e-3), name


def test_cli_convert_prints_json(tmp_path, capsys):
    ckpt = write_hf_checkpoint(tmp_path / "hf", random_llama(np.random.default_rng(8)))
    out = tmp_path / "cli.tinyloop"
    assert main_convert([str(ckpt), "-o", str(out), "--dtype", "f16", "--no-progress", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["format"] == "safetensors" and result["bytes"] == out.stat().st_size
    with read_file(out) as f:
        assert f.tensors["embed.weight"].dtype == "f16"
    assert main_convert([str(tmp_path / "missing.gguf"), "-o", str(out), "--json"]) == 1
    assert "error" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ------------------------------------------------------------------ pull helpers (no download)

def test_cache_dir_and_model_name_resolution(tmp_path, monkeypatch):
    from tinyloop.convert.pull import cache_dir, resolve_model_name
    from tinyloop.errors import ModelIOError

    monkeypatch.delenv("TINYLOOP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tinyloop"
    monkeypatch.setenv("TINYLOOP_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"

    with pytest.raises(ModelIOError, match="tinyloop pull smollm2-135m"):
        resolve_model_name("smollm2-135m")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "smollm2-135m.tinyloop").write_bytes(b"")
    assert resolve_model_name("smollm2-135m") == tmp_path / "cache" / "smollm2-135m.tinyloop"
    own = tmp_path / "own.tinyloop"
    own.write_bytes(b"")
    assert resolve_model_name(str(own)) == own
    with pytest.raises(ModelIOError, match="neither an existing file nor a known model"):
        resolve_model_name("no-such-model")
