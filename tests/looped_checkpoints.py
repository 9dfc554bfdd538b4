"""Tiny random Hugging Face checkpoints of the three looped families, in their exact on-disk
layout: the tensor names and config.json keys of huginn-0125 (raven_modeling_minimal.py),
Ouro (modeling_ouro.py) and Nanbeige4.2 (modeling_nanbeige.py), safetensors written here byte
by byte (f32, f16 or bf16; one file or shards with model.safetensors.index.json), a small
WordLevel tokenizer.json, tokenizer_config.json and generation_config.json.

Weights are seeded and random, norm gains non-constant, so a swapped tensor changes the
function. `read_checkpoint` gives the raw tensors back as float64 for the test's second
oracle (tests/looped_oracle.py)."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(80)]
SPECIALS = ["<|begin_text|>", "<|end_text|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


# ---------------------------------------------------------------- safetensors, written plainly

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))   # finite inputs: no wrap
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return np.asarray(x, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.asarray(x, dtype="<f2").tobytes()
    return bf16_bits(x).astype("<u2").tobytes()


class Lazy:
    """A tensor made when it is written (`make()`), so that a checkpoint of a published
    shape is written one tensor at a time, in bounded memory."""

    def __init__(self, shape, make):
        self.shape, self.make = tuple(shape), make


ROWS_PER_WRITE = 4096   # a large tensor is encoded in blocks of rows: bounded scratch
WIDTH = {"F32": 4, "F16": 2, "BF16": 2}


def write_safetensors(path: Path, tensors: dict, dtypes: dict) -> None:
    """tensors: name -> float array (or Lazy); dtypes: name -> F32 / F16 / BF16."""
    header, offset = {}, 0
    for name, value in tensors.items():
        size = math.prod(value.shape) * WIDTH[dtypes[name]]
        header[name] = {"dtype": dtypes[name], "shape": list(value.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, value in tensors.items():
            data = np.asarray(value.make() if isinstance(value, Lazy) else value)
            rows = data.reshape(len(data), -1) if data.ndim > 1 else data.reshape(1, -1)
            for r0 in range(0, len(rows), ROWS_PER_WRITE):
                f.write(_encode(rows[r0:r0 + ROWS_PER_WRITE], dtypes[name]))


def write_weights(directory: Path, tensors: dict, dtype: str, shards: int = 1,
                  keep_f32=("freqs_cis",)) -> None:
    """model.safetensors, or `shards` files model-0000i-of-0000n.safetensors and the index."""
    dtypes = {name: "F32" if name in keep_f32 else dtype for name in tensors}
    names = list(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, dtypes)
        return
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / file, {n: tensors[n] for n in part}, dtypes)
        weight_map.update({n: file for n in part})
        total += sum(math.prod(tensors[n].shape) * WIDTH[dtypes[n]] for n in part)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def read_checkpoint(directory) -> dict:
    """Every tensor of the checkpoint as float64, read from the files' own headers."""
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            data = raw[8 + n + start: 8 + n + end]
            if info["dtype"] == "BF16":
                value = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                value = np.frombuffer(data, {"F32": "<f4", "F16": "<f2"}[info["dtype"]])
            out[name] = value.astype(np.float64).reshape(info["shape"])
    return out


# ---------------------------------------------------------------- tokenizer files

def write_tokenizer(directory: Path, bos: str, eos: str, gen_eos) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": eos, "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))


# ---------------------------------------------------------------- random weights

class _Weights:
    """Seeded random tensors. Drawn at once from one generator in the order they are
    named (the tests' tiny checkpoints), or, `lazy`, each from a generator of its own
    (the seed and the tensor's name, uniform of the same deviation) when it is written: a
    checkpoint of a published shape then never sits in memory whole."""

    def __init__(self, seed: int, lazy: bool = False):
        self.seed, self.lazy = seed, lazy
        self.rng = np.random.default_rng(seed)
        self.tensors: dict = {}

    def _normal(self, name: str, shape, scale: float, offset: float = 0.0) -> None:
        if not self.lazy:
            self.tensors[name] = offset + scale * self.rng.standard_normal(shape)
            return
        key = [self.seed, zlib.crc32(name.encode())]

        def make():   # uniform of the same deviation: several times faster to draw than normal
            x = np.random.default_rng(key).random(shape, dtype=np.float32)
            x -= np.float32(0.5)
            x *= np.float32(scale * math.sqrt(12.0))
            return x + np.float32(offset) if offset else x
        self.tensors[name] = Lazy(shape, make)

    def matrix(self, name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        self._normal(name, (rows, cols), scale / math.sqrt(cols))

    def norm(self, name: str, d: int) -> None:
        self._normal(name, (d,), 0.3, offset=1.0)

    def vector(self, name: str, shape, std: float) -> None:
        self._normal(name, shape, std)


HUGINN = dict(n_embd=64, n_heads=4, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
              n_layers_in_coda=1, intermediate_size=128, vocab_size=96, block_size=64,
              mean_recurrence=4, rope_base=50000.0, norm_eps=1e-6, qk_bias=True, bias=False,
              tie_embeddings=True)


def huginn_checkpoint(directory, dtype: str = "BF16", shards: int = 1, seed: int = 0, lazy: bool = False,
                      **overrides) -> Path:
    """A huginn_raven checkpoint (config keys and tensor names of huginn-0125)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = {**HUGINN, **overrides}
    d, f, h = c["n_embd"], c["intermediate_size"], c["n_heads"]
    hd = d // h
    n_layers = c["n_layers_in_prelude"] + c["n_layers_in_recurrent_block"] + c["n_layers_in_coda"]
    depth_layers = n_layers + c["mean_recurrence"] * c["n_layers_in_recurrent_block"]
    w = _Weights(seed, lazy)
    w.matrix("transformer.wte.weight", c["vocab_size"], d, scale=math.sqrt(d) * 0.3)
    for part, count in (("prelude", c["n_layers_in_prelude"]), ("core_block", c["n_layers_in_recurrent_block"]),
                        ("coda", c["n_layers_in_coda"])):
        for i in range(count):
            p = f"transformer.{part}.{i}."
            for k in range(1, 5):
                w.norm(f"{p}norm_{k}.weight", d)
            w.matrix(f"{p}attn.Wqkv.weight", 3 * d, d)
            if c["qk_bias"]:
                w.vector(f"{p}attn.qk_bias", (2, 1, h, hd), 0.3)
            w.matrix(f"{p}attn.proj.weight", d, d, scale=(2 * depth_layers) ** -0.5)
            w.matrix(f"{p}mlp.fc.weight", 2 * f, d)
            w.matrix(f"{p}mlp.proj.weight", d, f, scale=(2 * depth_layers) ** -0.5)
    w.matrix("transformer.adapter.weight", d, 2 * d)
    if c["bias"]:
        w.vector("transformer.adapter.bias", (d,), 0.1)
    w.norm("transformer.ln_f.weight", d)
    if not c["tie_embeddings"]:
        w.matrix("lm_head.weight", c["vocab_size"], d)
    # the persistent rotary buffer, computed as precompute_freqs_cis does (float32)
    inv = (1.0 / (np.float32(c["rope_base"]) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
    angles = np.outer(np.arange(c["block_size"], dtype=np.float32), inv.astype(np.float32))
    w.tensors["freqs_cis"] = np.stack([np.cos(angles), np.sin(angles)], axis=-1)[None, :, None, :, :]
    write_weights(directory, w.tensors, dtype, shards)
    config = {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "injection_type": "linear", "state_init": "like-init", "init_strategy": "takase",
        "n_layers": n_layers, "num_key_value_heads": h, "head_dim": hd,
        "padded_vocab_size": c["vocab_size"], "padding_multiple": 32, "effective_expected_depth": depth_layers,
        "mean_backprop_depth": 2, "sampling_scheme": "poisson-lognormal-filling", "test_time_noise": 0,
        "test_time_noise_type": "none", "torch_dtype": "bfloat16", "transformers_version": "4.47.1",
        "init_values": {"std": math.sqrt(2 / (5 * d)), "embed_scale": math.sqrt(d)},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 4,
        **c,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory, SPECIALS[0], SPECIALS[1], [1, 3])
    return directory


def _llama_layers(w: _Weights, c: dict, sandwich: bool) -> None:
    d, hd, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    scale = (2 * c["num_hidden_layers"] * c["_loops"]) ** -0.5
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["input_layernorm_2", "post_attention_layernorm_2"] if sandwich else []
        for n in norms:
            w.norm(f"{p}{n}.weight", d)
        w.matrix(f"{p}self_attn.q_proj.weight", q, d)
        w.matrix(f"{p}self_attn.k_proj.weight", kv, d)
        w.matrix(f"{p}self_attn.v_proj.weight", kv, d)
        w.matrix(f"{p}self_attn.o_proj.weight", d, q, scale=scale)
        w.matrix(f"{p}mlp.gate_proj.weight", f, d)
        w.matrix(f"{p}mlp.up_proj.weight", f, d)
        w.matrix(f"{p}mlp.down_proj.weight", d, f, scale=scale)


def _llama_head(w: _Weights, c: dict) -> None:
    w.matrix("model.embed_tokens.weight", c["vocab_size"], c["hidden_size"], scale=math.sqrt(c["hidden_size"]))
    w.norm("model.norm.weight", c["hidden_size"])
    if not c["tie_word_embeddings"]:
        w.matrix("lm_head.weight", c["vocab_size"], c["hidden_size"])


OURO = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, intermediate_size=128, vocab_size=96, total_ut_steps=3,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
            tie_word_embeddings=False, early_exit_threshold=1.0)


def ouro_checkpoint(directory, dtype: str = "F32", shards: int = 2, seed: int = 1,
                    gate_bias: float = 0.0, lazy: bool = False, **overrides) -> Path:
    """An ouro checkpoint (OuroForCausalLM's tensor names and config keys)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = {**OURO, **overrides}
    w = _Weights(seed, lazy)
    _llama_head(w, c)
    _llama_layers(w, {**c, "_loops": c["total_ut_steps"]}, sandwich=True)
    w.matrix("model.early_exit_gate.weight", 1, c["hidden_size"], scale=2.0)
    w.tensors["model.early_exit_gate.bias"] = np.array([gate_bias])
    write_weights(directory, w.tensors, dtype, shards)
    config = {
        "architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_act": "silu",
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "attention_dropout": 0.0, "initializer_range": 0.02, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c["num_hidden_layers"],
        "layer_types": ["full_attention"] * c["num_hidden_layers"], "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
        **c,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory, SPECIALS[0], SPECIALS[3], [3, 0])
    return directory


NANBEIGE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_hidden_layers=2, intermediate_size=128, vocab_size=96, num_loops=2,
                loop_loss_weights=[], skip_loop_final_norm=False, rms_norm_eps=1e-5,
                rope_theta=7e7, max_position_embeddings=64, tie_word_embeddings=False)


def nanbeige_checkpoint(directory, dtype: str = "BF16", shards: int = 3, seed: int = 2, lazy: bool = False,
                        **overrides) -> Path:
    """A nanbeige checkpoint (NanbeigeForCausalLM: Llama names, head_dim != hidden / heads)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = {**NANBEIGE, **overrides}
    loops = len(c["loop_loss_weights"]) + 1 if c["loop_loss_weights"] else c["num_loops"]
    w = _Weights(seed, lazy)
    _llama_head(w, c)
    _llama_layers(w, {**c, "_loops": loops}, sandwich=False)
    write_weights(directory, w.tensors, dtype, shards)
    config = {
        "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "rope_scaling": None, "pretraining_tp": 1,
        "qk_layernorm": False, "emb_neighbor_num": None, "enable_double_loop_split": False,
        "loop_share_kv": False, "enable_hyper_connection": False, "enable_depth_attention": False,
        "bos_token_id": 1, "eos_token_id": 3, "torch_dtype": "bfloat16", "use_cache": True,
        **c,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory, SPECIALS[0], SPECIALS[3], 3)
    return directory


FAMILIES = {"huginn": huginn_checkpoint, "ouro": ouro_checkpoint, "nanbeige": nanbeige_checkpoint}
