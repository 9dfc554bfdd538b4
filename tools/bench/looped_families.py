#!/usr/bin/env python3
"""The looped families (Huginn, Ouro, Nanbeige) on a device, for tools/gpu_check:

  parity --device D --out JSON     tiny random HF checkpoints of each family
                                   (tests/looped_checkpoints.py) converted to f32, q4 and q2 with
                                   `tinyloop convert`, scored on the CPU and on D at two depths:
                                   D against the float64 oracle on the same file, and against
                                   the CPU (exit status 1 past the tolerances)
  make SHAPE PATH [--dims k=v,..] a random-weight q4 (--dtype) .tinyloop at a family's published shape
                                   (SHAPES below), written directly by tinyloop.fileformat.random_model:
                                   no bf16 checkpoint first, so it needs only the output's size
  bench PATH --device D --out JSON batch-1 decode tokens/s and a 512-token prefill at the
                                   file's default depth (the fields tools/gpu/report.py reads)
  checkpoint SHAPE DIR             a random Hugging Face checkpoint of a family at its published
                                   shape (HF_SHAPES: the config.json values), bf16 shards written
                                   one tensor at a time (tests/looped_checkpoints.py, lazy), for
                                   `tinyloop convert` at full size

The published shapes are the checkpoints' config.json values; Nanbeige4.2-3B's
intermediate_size is taken as 8192 (not checked against its config here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tools" / "gpu")]

DTYPES = ("f32", "q4", "q2")
# (atol, rtol) against the oracle: a device keeps activations fp32 for every weight dtype
# (tests/test_parity.py DEVICE_TOLERANCE); the CPU (a dry run) rounds them to int16 before a
# quantized matrix (docs/testing.md), so on q4 files the device and the CPU differ by up to
# parity's quantized bound too
DEVICE_TOLERANCE, CPU_QUANTIZED = (1e-4, 2e-5), (1e-3, 1e-4)
VS_CPU = {"f32": 1e-4, "q4": 2e-3, "q2": 2e-3}


def _within(got, expected, tolerance) -> bool:
    atol, rtol = tolerance
    return bool(np.all(np.abs(got - expected) <= atol + rtol * np.abs(expected)))
TOKENS = np.array([5, 9, 17, 30, 2, 44, 60, 7, 11, 80, 23, 64], dtype=np.int32)

_HUGINN = dict(vocab_size=65536, d_model=5280, n_head=55, n_kv_head=55, head_dim=96, ffn_dim=17920,
               n_pre=2, n_core=4, n_post=2, default_depth=32, max_depth=32, max_seq_len=1024,
               norm_placement="sandwich_outer", norm_eps=1e-6, rope_style="interleaved", rope_theta=50000.0,
               qkv_bias=1, embed_scale=5280 ** 0.5, tied_embeddings=1, injection="concat",
               state_init="zeros", post_norm=1, group_size=32)   # 5280 columns: groups of 32 only


def _ouro(layers):
    return dict(vocab_size=49152, d_model=2048, n_head=16, n_kv_head=16, head_dim=128, ffn_dim=5632,
                n_pre=0, n_core=layers, n_post=0, default_depth=4, max_depth=4, max_seq_len=1024,
                norm_placement="sandwich_branch", norm_eps=1e-6, rope_theta=1e6, tied_embeddings=0,
                injection="none", state_init="prelude", loop_norm=1, final_norm=0, exit_gate=1, group_size=64)


SHAPES = {
    "huginn-0125": _HUGINN,
    "ouro-1.4b": _ouro(24),
    "ouro-2.6b": _ouro(48),
    "nanbeige4.2-3b": dict(vocab_size=166144, d_model=3072, n_head=48, n_kv_head=8, head_dim=128,
                           ffn_dim=8192, n_pre=0, n_core=22, n_post=0, default_depth=2, max_depth=2,
                           max_seq_len=1024, norm_eps=1e-5, rope_theta=7e7, tied_embeddings=0,
                           injection="none", state_init="prelude", loop_norm=1, final_norm=0, group_size=64),
}


# The published checkpoints' config.json values (the keys the importers read), for
# `checkpoint`: Huginn-0125, Ouro-1.4B / 2.6B, Nanbeige4.2-3B-Looped.
HF_SHAPES = {
    "huginn-0125": ("huginn", dict(n_embd=5280, n_heads=55, n_layers_in_prelude=2, n_layers_in_recurrent_block=4,
                                   n_layers_in_coda=2, intermediate_size=17920, vocab_size=65536, block_size=4096,
                                   mean_recurrence=32, rope_base=50000.0, norm_eps=1e-6, qk_bias=True, bias=False,
                                   tie_embeddings=True)),
    "ouro-1.4b": ("ouro", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                               num_hidden_layers=24, intermediate_size=5632, vocab_size=49152, total_ut_steps=4,
                               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=65536,
                               tie_word_embeddings=False)),
    "ouro-2.6b": ("ouro", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                               num_hidden_layers=48, intermediate_size=5632, vocab_size=49152, total_ut_steps=4,
                               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=65536,
                               tie_word_embeddings=False)),
    "nanbeige4.2-3b": ("nanbeige", dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8,
                                        head_dim=128, num_hidden_layers=22, intermediate_size=8192,
                                        vocab_size=166144, num_loops=2, rms_norm_eps=1e-5, rope_theta=7e7,
                                        max_position_embeddings=65536, tie_word_embeddings=False)),
}


def _write(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(json.dumps(data, default=str))


def cmd_parity(args):
    import tinyloop
    from looped_checkpoints import FAMILIES
    from reference import ReferenceModel

    out, failed = {"device": args.device, "kv_dtype": args.kv_dtype, "families": {}}, False
    with tempfile.TemporaryDirectory() as tmp:
        for family, make in FAMILIES.items():
            src = make(Path(tmp) / family)
            for dtype in DTYPES:
                tolerance = CPU_QUANTIZED if args.device == "cpu" and dtype != "f32" else DEVICE_TOLERANCE
                path = Path(tmp) / f"{family}-{dtype}.tinyloop"
                subprocess.run([sys.executable, "-m", "tinyloop", "convert", str(src), "-o", str(path),
                                "--dtype", dtype, "--group-size", "32", "--no-progress"], check=True)
                reference = ReferenceModel.from_file(path)
                row = {}
                with tinyloop.Model(path) as cpu, \
                        tinyloop.Model(path, device=args.device, kv_dtype=args.kv_dtype) as dev:
                    for depth in (1, reference.config.default_depth):
                        got, expected = dev.score(TOKENS, depth), reference.logprobs(TOKENS, depth)
                        last = dev.score_last_token(TOKENS, depth)
                        vs_cpu = float(np.abs(got - cpu.score(TOKENS, depth)).max())
                        row[f"depth{depth}"] = cell = {
                            "vs_oracle": float(np.abs(got - expected).max()), "vs_cpu": vs_cpu,
                            "last_logits_vs_cpu": float(np.abs(last - cpu.score_last_token(TOKENS, depth)).max()),
                            "ok": _within(got, expected, tolerance) and vs_cpu <= VS_CPU[dtype]}
                        failed |= not cell["ok"]
                    if reference.config.exit_gate:
                        lam = dev.score_exit_gate(TOKENS).lam
                        row["exit_gate_vs_oracle"] = float(np.abs(lam - reference.exit_gate(TOKENS)).max())
                        failed |= row["exit_gate_vs_oracle"] > 1e-4
                out["families"][f"{family}-{dtype}"] = row
    out["ok"] = not failed
    _write(args.out, out)
    return 1 if failed else 0


def cmd_make(args):
    from bench import _dims   # tools/gpu/bench.py
    from tinyloop.fileformat.random_model import make_random_model

    config = {**SHAPES[args.shape], **_dims(args.dims)}
    t0 = time.monotonic()
    make_random_model(args.path, seed=0, dtype=args.dtype, embed_dtype="q8", **config)
    print(f"wrote {args.path} ({os.path.getsize(args.path) / 2**30:.2f} GiB) in {time.monotonic() - t0:.1f} s")


def cmd_checkpoint(args):
    from looped_checkpoints import FAMILIES

    family, config = HF_SHAPES[args.shape]
    t0 = time.monotonic()
    directory = FAMILIES[family](Path(args.dir), dtype="BF16", shards=args.shards, lazy=True, **config)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    print(f"wrote {directory} ({size / 2**30:.2f} GiB in {args.shards} shards) in {time.monotonic() - t0:.1f} s")


def cmd_bench(args):
    import tinyloop
    from bench import describe   # tools/gpu/bench.py

    out = {"model": args.path, "device": args.device}
    try:
        t0 = time.monotonic()
        with tinyloop.Model(args.path, device=args.device) as model:
            out.update(describe(model, args.path, time.monotonic() - t0))
            rng = np.random.default_rng(0)
            vocab = model.info.vocab_size
            prefill = []
            for r in range(3):   # the first pass warms up
                with model.context() as ctx:
                    t = time.monotonic()
                    ctx.append(rng.integers(0, vocab, 512).astype(np.int32))
                    prefill.append(time.monotonic() - t)
            out["prefill_512_ms"] = 1000 * min(prefill[1:])
            prompt = rng.integers(0, vocab, 64).astype(np.int32)
            model.generate(prompt, max_tokens=8, temperature=0.0, eos=False)
            res = model.generate(prompt, max_tokens=args.new_tokens, temperature=0.0, eos=False)
            out["decode_tok_s"] = res.decode_tokens_per_s
            out["memory_report"] = model.memory_report()
            out["peak_device_bytes"] = out["memory_report"].get("device_bytes")
    except Exception as e:   # recorded for the report, not raised
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    _write(args.out, out)
    return 0 if "error" not in out else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("parity")
    q.add_argument("--device", default="cuda")
    q.add_argument("--kv-dtype", default="f32", help="the device's KV cache (f32: the 1e-4 bar; f16 rounds)")
    q.add_argument("--out", required=True)
    q = sub.add_parser("checkpoint")
    q.add_argument("shape", choices=sorted(HF_SHAPES))
    q.add_argument("dir")
    q.add_argument("--shards", type=int, default=4)
    q = sub.add_parser("make")
    q.add_argument("shape", choices=sorted(SHAPES))
    q.add_argument("path")
    q.add_argument("--dims", help="k=v,... overrides of the shape (tools/gpu_check --dry-run: tiny ones)")
    q.add_argument("--dtype", default="q4", choices=("q8", "q4", "q2"))
    q = sub.add_parser("bench")
    q.add_argument("path")
    q.add_argument("--device", default="cuda")
    q.add_argument("--new-tokens", type=int, default=64)
    q.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return {"parity": cmd_parity, "make": cmd_make, "bench": cmd_bench,
            "checkpoint": cmd_checkpoint}[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
