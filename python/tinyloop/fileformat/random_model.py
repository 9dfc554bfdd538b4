"""Seeded random `.tinyloop` models: tiny ones for the parity tests, large presets for
benchmarks.

Weights are N(0, 1/fan_in) with the residual-branch output projections scaled down by the
number of virtual layers, so activations stay of order one however many times the loop
runs; norm gains are near 1. Big matrices are generated and quantized in row blocks, so
writing a model needs about the output size in memory (twice that for bf16).

    python -m tinyloop.fileformat.random_model --preset loop-1b --dtype q4 --group-size 64 OUT
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import Callable

import numpy as np

from .quantize import concat_rows, quantize
from .tinyloop_file import FLOAT_DTYPES, QUANT_DTYPES, TinyLoopWriter

# Short option names -> metadata keys of docs/format.md.
ARCH_OPTIONS = {
    "norm_placement": "arch.norm_placement",
    "norm_type": "arch.norm_type",
    "norm_unit_offset": "arch.norm_unit_offset",
    "norm_eps": "arch.norm_eps",
    "rope_style": "arch.rope_style",
    "rope_theta": "arch.rope_theta",
    "rope_dims": "arch.rope_dims",
    "activation": "arch.activation",
    "qkv_bias": "arch.qkv_bias",
    "sliding_window": "arch.sliding_window",
    "attn_scale": "arch.attn_scale",
    "embed_scale": "arch.embed_scale",
    "tied_embeddings": "arch.tied_embeddings",
    "injection": "loop.injection",
    "injection_bias": "loop.injection_bias",
    "state_init": "loop.state_init",
    "noise_sigma": "loop.noise_sigma",
    "noise_seed": "loop.noise_seed",
    "loop_norm": "loop.norm",
    "final_norm": "arch.final_norm",
    "post_norm": "loop.post_norm",
    "noise_truncation": "loop.noise_truncation",
    "exit_gate": "loop.exit_gate",
}

# Options that add a tensor rather than a metadata key: rope_freq_factors = 1 writes
# `rope.freq_factors` (Llama 3.x-like RoPE frequency divisors, from 1 up to 8).
TENSOR_OPTIONS = ("rope_freq_factors",)

# The file-format defaults of the options that decide which tensors exist.
_LAYOUT_DEFAULTS = {"norm_type": "rmsnorm", "norm_unit_offset": 0, "qkv_bias": 0,
                    "tied_embeddings": 1, "injection": "add", "injection_bias": 0,
                    "loop_norm": 0, "norm_placement": "pre", "final_norm": 1, "post_norm": 0,
                    "exit_gate": 0, "rope_freq_factors": 0}

PRESETS = {
    # The GPU benchmark model of the CUDA backend: a Llama-shaped prelude of two blocks and
    # one shared block looped 8 times with no injection, so an unrolled HF Llama with tied
    # loop layers computes the same function.
    "loop-1b": dict(vocab_size=32000, d_model=2048, n_head=16, n_kv_head=4, head_dim=128,
                    ffn_dim=5632, n_pre=2, n_core=1, n_post=0, default_depth=8, max_depth=8,
                    max_seq_len=2048, tied_embeddings=0, injection="none",
                    state_init="prelude", rope_theta=10000.0),
}

# Rows per generated block are chosen so one block holds about this many elements.
_BLOCK_ELEMENTS = 1 << 20
# Relative spread of norm gains and of biases around their centre.
_NORM_SPREAD = 0.1
_BIAS_STD = 0.1
# Embedding rows are drawn so that a (tied) head gives logits of a few units.
_LOGIT_STD = 2.0


class _TensorMaker:
    """Draws each tensor from its own stream (seed, CRC of the name), so a tensor's values
    do not depend on which other tensors the architecture has."""

    def __init__(self, seed: int, dtype: str, group_size: int, method: str):
        self.seed, self.dtype, self.group_size, self.method = seed, dtype, group_size, method
        # vectors (norms, biases) use the float weight dtype, or f32 next to quantized matrices
        self.vector_dtype = dtype if dtype in FLOAT_DTYPES else "f32"

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def matrix(self, name: str, rows: int, cols: int, std: float, dtype: str | None = None):
        dtype = dtype or self.dtype
        rng = self._rng(name)
        block_rows = max(1, _BLOCK_ELEMENTS // cols)
        parts = []
        for r0 in range(0, rows, block_rows):
            n = min(block_rows, rows - r0)
            block = rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std)
            parts.append(self._encode(name, block, dtype))
        if dtype in QUANT_DTYPES:
            return concat_rows(parts), dtype
        return np.concatenate(parts), dtype

    def _encode(self, name: str, block: np.ndarray, dtype: str):
        if dtype in QUANT_DTYPES:
            if block.shape[1] % self.group_size:
                raise ValueError(f"{name}: {block.shape[1]} columns are not a multiple of "
                                 f"group size {self.group_size}")
            return quantize(block, dtype, self.group_size, self.method)
        if dtype == "f16":
            return block.astype(np.float16)     # held as f16: the writer stores it as is
        return block                            # f32, or bf16 rounded by the writer

    def vector(self, name: str, size: int, centre: float, spread: float):
        values = centre + spread * self._rng(name).standard_normal(size)
        return values.astype(np.float32), self.vector_dtype


def _option(options: dict, name: str):
    return options.get(name, _LAYOUT_DEFAULTS[name])


def _norm_tensors(maker: _TensorMaker, name: str, d: int, options: dict):
    """Gain near 1 (stored as w near 0 with the (1 + w) convention), plus a LayerNorm bias."""
    layernorm = _option(options, "norm_type") == "layernorm"
    unit_offset = bool(_option(options, "norm_unit_offset")) and not layernorm
    yield f"{name}.weight", maker.vector(f"{name}.weight", d, 0.0 if unit_offset else 1.0, _NORM_SPREAD)
    if layernorm:
        yield f"{name}.bias", maker.vector(f"{name}.bias", d, 0.0, _BIAS_STD)


def _block_tensors(maker: _TensorMaker, prefix: str, dims: dict, options: dict, out_std_scale: float):
    d, hd, f = dims["d_model"], dims["head_dim"], dims["ffn_dim"]
    q_rows, kv_rows = dims["n_head"] * hd, dims["n_kv_head"] * hd
    norm_names = ["attn_norm", "mlp_norm"]
    if _option(options, "norm_placement") != "pre":
        norm_names += ["attn_post_norm", "mlp_post_norm"]
    for norm in norm_names:
        yield from _norm_tensors(maker, prefix + norm, d, options)
    for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        name = f"{prefix}attn.{proj}"
        yield f"{name}.weight", maker.matrix(f"{name}.weight", rows, d, d ** -0.5)
        if _option(options, "qkv_bias"):
            yield f"{name}.bias", maker.vector(f"{name}.bias", rows, 0.0, _BIAS_STD)
    yield f"{prefix}attn.o.weight", maker.matrix(f"{prefix}attn.o.weight", d, q_rows,
                                                 q_rows ** -0.5 * out_std_scale)
    yield f"{prefix}mlp.gate.weight", maker.matrix(f"{prefix}mlp.gate.weight", f, d, d ** -0.5)
    yield f"{prefix}mlp.up.weight", maker.matrix(f"{prefix}mlp.up.weight", f, d, d ** -0.5)
    yield f"{prefix}mlp.down.weight", maker.matrix(f"{prefix}mlp.down.weight", d, f,
                                                   f ** -0.5 * out_std_scale)


def _model_tensors(maker: _TensorMaker, dims: dict, options: dict, embed_dtype: str):
    """Yield (name, (value, dtype)) for every tensor the architecture needs, one at a time."""
    d, vocab = dims["d_model"], dims["vocab_size"]
    virtual_layers = dims["n_pre"] + dims["max_depth"] * dims["n_core"] + dims["n_post"]
    # each virtual layer adds two residual branches; keep their summed variance of order one
    out_std_scale = (2.0 * max(1, virtual_layers)) ** -0.5
    yield "embed.weight", maker.matrix("embed.weight", vocab, d, _LOGIT_STD * d ** -0.5, embed_dtype)
    for kind, count in (("pre", dims["n_pre"]), ("core", dims["n_core"]), ("post", dims["n_post"])):
        for i in range(count):
            yield from _block_tensors(maker, f"{kind}.{i}.", dims, options, out_std_scale)
    if dims["n_core"] and _option(options, "injection") == "concat":
        yield "inject.weight", maker.matrix("inject.weight", d, 2 * d, (2 * d) ** -0.5)
        if _option(options, "injection_bias"):
            yield "inject.bias", maker.vector("inject.bias", d, 0.0, _BIAS_STD)
    if _option(options, "loop_norm"):
        yield from _norm_tensors(maker, "loop_norm", d, options)
    if _option(options, "post_norm"):
        yield from _norm_tensors(maker, "post_loop_norm", d, options)
    if _option(options, "exit_gate"):
        yield "exit_gate.weight", maker.matrix("exit_gate.weight", 1, d, d ** -0.5, "f32")
        yield "exit_gate.bias", maker.vector("exit_gate.bias", 1, 0.0, 1.0)
    if _option(options, "rope_freq_factors"):
        pairs = options.get("rope_dims", dims["head_dim"]) // 2
        factors = np.exp(np.log(8.0) * maker._rng("rope.freq_factors").uniform(0.0, 1.0, pairs))
        yield "rope.freq_factors", (factors.astype(np.float32), "f32")
    if _option(options, "final_norm"):
        yield from _norm_tensors(maker, "final_norm", d, options)
    if not _option(options, "tied_embeddings"):
        yield "output.weight", maker.matrix("output.weight", vocab, d, _LOGIT_STD * d ** -0.5)


def make_random_model(path, *, seed: int, vocab_size: int, d_model: int, n_head: int,
                      n_kv_head: int, head_dim: int, ffn_dim: int, n_pre: int, n_core: int,
                      n_post: int, default_depth: int, max_depth: int, max_seq_len: int,
                      dtype: str = "f32", group_size: int = 32, embed_dtype: str | None = None,
                      quant_method: str = "rtn",
                      progress: Callable[[str], None] | None = None, **arch_options) -> None:
    """Write a random model to `path`. `arch_options` are the short names of ARCH_OPTIONS
    (or TENSOR_OPTIONS);
    options not given are left out of the file, so the reader's defaults apply."""
    unknown = sorted(set(arch_options) - set(ARCH_OPTIONS) - set(TENSOR_OPTIONS))
    if unknown:
        raise ValueError(f"unknown architecture options {unknown}; expected some of "
                         f"{sorted(ARCH_OPTIONS) + list(TENSOR_OPTIONS)}")
    for name, dt in (("dtype", dtype), ("embed_dtype", embed_dtype or dtype)):
        if dt not in FLOAT_DTYPES + QUANT_DTYPES:
            raise ValueError(f"{name} {dt!r} is not one of {FLOAT_DTYPES + QUANT_DTYPES}")
    dims = dict(vocab_size=vocab_size, d_model=d_model, n_head=n_head, n_kv_head=n_kv_head,
                head_dim=head_dim, ffn_dim=ffn_dim, n_pre=n_pre, n_core=n_core, n_post=n_post,
                default_depth=default_depth, max_depth=max_depth, max_seq_len=max_seq_len)
    say = progress or (lambda message: None)
    writer = TinyLoopWriter(dims)
    for name, value in arch_options.items():
        if name in ARCH_OPTIONS:
            writer.add_metadata(ARCH_OPTIONS[name], int(value) if isinstance(value, bool) else value)
    writer.add_metadata("general.name", f"random-seed{seed}")
    writer.add_metadata("general.source", f"tinyloop.random_model seed {seed}")
    writer.add_metadata("general.converter", "tinyloop.random_model")

    maker = _TensorMaker(seed, dtype, group_size, quant_method)
    started = time.monotonic()
    for name, (value, tensor_dtype) in _model_tensors(maker, dims, arch_options, embed_dtype or dtype):
        writer.add_tensor(name, value, None if tensor_dtype in QUANT_DTYPES else tensor_dtype)
        say(f"generated {name} {tensor_dtype} {tuple(value.shape)} ({time.monotonic() - started:.1f} s)")

    def on_written(done: int, total: int, name: str) -> None:
        say(f"wrote {done / 2**20:.1f} / {total / 2**20:.1f} MiB ({name})")

    writer.write(path, progress=on_written)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyloop.fileformat.random_model",
                                     description="Write a seeded random .tinyloop model from a preset.")
    parser.add_argument("output", help="path of the .tinyloop file to write")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="f16", choices=FLOAT_DTYPES + QUANT_DTYPES)
    parser.add_argument("--embed-dtype", default=None, choices=FLOAT_DTYPES + QUANT_DTYPES,
                        help="dtype of the embedding (default: --dtype)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--method", default="rtn", choices=("rtn", "search"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    make_random_model(args.output, seed=args.seed, dtype=args.dtype, group_size=args.group_size,
                      embed_dtype=args.embed_dtype, quant_method=args.method, progress=say,
                      **PRESETS[args.preset])
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
