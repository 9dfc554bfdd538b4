"""Tiny random f32 GGUF models for the llama.cpp comparison (docs/convert.md, "Checked
against llama.cpp"). Run with TinyLoop's venv plus the `gguf` package:

    python tools/gguf_peer/make_models.py VOCAB_DIR OUT_DIR

VOCAB_DIR holds llama.cpp's vocabulary-only test files (its `models/ggml-vocab-*.gguf`, also
in llama-cpp-python's source package under vendor/llama.cpp/models)."""
import sys

import gguf
import numpy as np

from tinyloop.convert.gguf_reader import GGUFFile

VOCABS, OUT = sys.argv[1], sys.argv[2]

def vocab_meta(path):
    g = GGUFFile(path)
    return {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}

def write(name, arch, cfg, vocab_path, rope_freqs=None, qkv_bias=False, untied=False, extra=None, seed=0):
    rng = np.random.default_rng(seed)
    tm = vocab_meta(vocab_path)
    V = len(tm["tokenizer.ggml.tokens"])
    d, f, L, h, kv = cfg["d"], cfg["ffn"], cfg["layers"], cfg["heads"], cfg["kv"]
    hd = d // h
    w = gguf.GGUFWriter(f"{OUT}/{name}.gguf", arch)
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(d)
    w.add_feed_forward_length(f); w.add_head_count(h); w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["theta"]); w.add_layer_norm_rms_eps(1e-5); w.add_rope_dimension_count(hd)
    w.add_file_type(0)
    for k, v in (extra or {}).items():
        if isinstance(v, str): w.add_string(k, v)
        else: w.add_float32(k, v)
    for k, v in tm.items():
        if k == "tokenizer.ggml.model": w.add_tokenizer_model(v)
        elif k == "tokenizer.ggml.pre": w.add_tokenizer_pre(v)
        elif k == "tokenizer.ggml.tokens": w.add_token_list(list(v))
        elif k == "tokenizer.ggml.scores": w.add_token_scores([float(x) for x in v])
        elif k == "tokenizer.ggml.token_type": w.add_token_types([int(x) for x in v])
        elif k == "tokenizer.ggml.merges": w.add_token_merges(list(v))
        elif k.endswith("_token_id"): w.add_uint32(k, int(v))
        elif isinstance(v, (bool, np.bool_)): w.add_bool(k, bool(v))
        elif isinstance(v, str): w.add_string(k, v)
    def mat(rows, cols, std=None):
        return (rng.standard_normal((rows, cols)) * (std or cols ** -0.5)).astype(np.float32)
    def vec(n, c=1.0, s=0.1):
        return (c + s * rng.standard_normal(n)).astype(np.float32)
    w.add_tensor("token_embd.weight", mat(V, d, 2 * d ** -0.5))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", vec(d))
        w.add_tensor(p + "attn_q.weight", mat(h * hd, d))
        w.add_tensor(p + "attn_k.weight", mat(kv * hd, d))
        w.add_tensor(p + "attn_v.weight", mat(kv * hd, d))
        if qkv_bias:
            w.add_tensor(p + "attn_q.bias", vec(h * hd, 0.0))
            w.add_tensor(p + "attn_k.bias", vec(kv * hd, 0.0))
            w.add_tensor(p + "attn_v.bias", vec(kv * hd, 0.0))
        w.add_tensor(p + "attn_output.weight", mat(d, h * hd, (h * hd) ** -0.5 / 2))
        w.add_tensor(p + "ffn_norm.weight", vec(d))
        w.add_tensor(p + "ffn_gate.weight", mat(f, d))
        w.add_tensor(p + "ffn_up.weight", mat(f, d))
        w.add_tensor(p + "ffn_down.weight", mat(d, f, f ** -0.5 / 2))
    w.add_tensor("output_norm.weight", vec(d))
    if untied:
        w.add_tensor("output.weight", mat(V, d, 2 * d ** -0.5))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    print("wrote", name)

def llama3_factors(theta, hd, factor=8.0, low=1.0, high=4.0, original=64):
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    wl = 2 * np.pi / inv
    out = []
    for wv in wl:
        if wv < original / high: out.append(1.0)
        elif wv > original / low: out.append(factor)
        else:
            smooth = (original / wv - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out)

CFG = dict(d=256, ffn=512, layers=2, heads=4, kv=2, theta=10000.0)
SPM = f"{VOCABS}/ggml-vocab-llama-spm.gguf"
write("llama-spm", "llama", CFG, SPM, seed=1)
write("llama3-ropefreqs", "llama", dict(CFG, theta=500000.0), f"{VOCABS}/ggml-vocab-llama-bpe.gguf",
      rope_freqs=llama3_factors(500000.0, 64), untied=True, seed=2)
write("llama-linear", "llama", CFG, SPM, extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, seed=3)
write("qwen2", "qwen2", dict(d=64, ffn=128, layers=2, heads=4, kv=2, theta=1000000.0), f"{VOCABS}/ggml-vocab-qwen2.gguf",
      qkv_bias=True, untied=True, seed=4)
write("qwen2-tied", "qwen2", dict(d=64, ffn=128, layers=2, heads=4, kv=2, theta=1000000.0), f"{VOCABS}/ggml-vocab-qwen2.gguf",
      qkv_bias=True, untied=False, seed=5)
