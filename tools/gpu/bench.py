"""Helpers of tools/gpu_check, one subcommand each (every one writes its own JSON):

  make PATH --dtype D --group-size G [--dims k=v,...]   write a loop-1b model (dims override)
  short-run PATH --device D                              a few scores and tokens (memcheck)
  tinyloop PATH --device D --out JSON                    decode / prefill / memory of TinyLoop
  peer F16PATH --out JSON                                the HF transformers bf16 peer and the
                                                         measured device copy bandwidth
  batch PATH --device D --batches B,... --out JSON       generate_batch decode tokens/s per batch
                                                         size (the side of tools/bench/torch_peer.py)
"""

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

PROMPT_TOKENS = 128
NEW_TOKENS = 256
PREFILL_TOKENS = 512
REPEATS = 3


def _dims(text):
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, value = item.split("=")
        out[key.strip()] = int(value)
    return out


def cmd_make(args):
    from tinyloop.fileformat.random_model import PRESETS, make_random_model
    config = {**PRESETS["loop-1b"], **_dims(args.dims)}
    t0 = time.monotonic()
    make_random_model(args.path, seed=0, dtype=args.dtype, group_size=args.group_size, **config)
    print(f"wrote {args.path} in {time.monotonic() - t0:.1f} s")


def _tokens(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def cmd_short_run(args):
    import tinyloop
    with tinyloop.Model(args.path, device=args.device) as model:
        tokens = _tokens(40, model.info.vocab_size)
        scores = model.score(tokens)
        result = model.generate(tokens[:12], max_tokens=8, temperature=0.0, eos=False)
        sampled = model.generate(tokens[:12], max_tokens=8, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                                 repetition_penalty=1.2, seed=1, eos=False)
        assert len(sampled.tokens) == 8
        with model.context() as ctx:
            ctx.append(tokens[:20])
            for t in tokens[20:24]:
                ctx.append([int(t)])
        print(model.info.device_name, float(scores.sum()), result.tokens)
        assert np.all(np.isfinite(scores))


def _weight_bytes_per_token(path, depth):
    """Bytes of weights one decode step reads: prelude and coda once, the core `depth`
    times (or once when it stays in L2), the head once; the embedding row is negligible."""
    from tinyloop.fileformat.tinyloop_file import read_file
    sizes = {"pre": 0, "core": 0, "post": 0, "head": 0}
    with read_file(path) as f:
        tied = "output.weight" not in f.tensors
        for name, entry in f.tensors.items():
            part = name.split(".")[0]
            if part in ("pre", "core", "post"):
                sizes[part] += entry.size
            elif name == "output.weight" or (tied and name == "embed.weight"):
                sizes["head"] += entry.size
            elif name != "embed.weight":
                sizes["head"] += entry.size   # norms, injection: small
    once = sizes["pre"] + sizes["post"] + sizes["head"]
    return {"bytes_per_token": once + depth * sizes["core"],
            "bytes_per_token_core_in_l2": once + sizes["core"],
            "core_bytes": sizes["core"]}


def describe(model, path, load_s):
    """The fields a benchmark result starts with: load time, device, default depth and the
    weight bytes a decode step reads at it."""
    depth = model.info.default_depth
    return {"load_s": load_s, "device_name": model.info.device_name, "depth": depth,
            **_weight_bytes_per_token(path, depth)}


def cmd_tinyloop(args):
    import tinyloop
    out = {"model": args.path, "device": args.device}
    try:
        t0 = time.monotonic()
        with tinyloop.Model(args.path, device=args.device) as model:
            out.update(describe(model, args.path, time.monotonic() - t0))
            vocab = model.info.vocab_size
            peak = 0

            def prefill_ms():
                nonlocal peak
                times = []
                for r in range(REPEATS + 1):
                    with model.context() as ctx:
                        t = time.monotonic()
                        ctx.append(_tokens(PREFILL_TOKENS, vocab, r))
                        if r:   # the first pass warms up
                            times.append(time.monotonic() - t)
                        peak = max(peak, model.memory_report()["device_bytes"])
                return 1000 * min(times)

            out["prefill_512_ms"] = prefill_ms()
            prompt = _tokens(PROMPT_TOKENS, vocab, 7)
            decode = []
            for r in range(2):
                res = model.generate(prompt, max_tokens=NEW_TOKENS if r else 16, temperature=0.0, eos=False)
                if r:
                    decode.append(res.decode_tokens_per_s)
                    graph_tokens = list(res.tokens)
                peak = max(peak, model.memory_report()["device_bytes"])
            out["decode_tok_s"] = max(decode)
            # The same work with one feature switched off: what CUDA graphs, programmatic
            # dependent launch, the integer-dot GEMV and the tensor-core GEMM each bring,
            # and whether the decode tokens change (they may without the integer dot:
            # other rounding). A context reads the switches when it is created, so each
            # variant runs on a context of its own (model.generate reuses the model's
            # internal context, created before the switch), warmed up like the above.
            for name, key in (("TINYLOOP_CUDA_GRAPHS", "eager"), ("TINYLOOP_CUDA_PDL", "no_pdl"),
                              ("TINYLOOP_CUDA_DP4A", "no_dp4a")):
                os.environ[name] = "0"
                try:
                    with model.context() as ctx:
                        ctx.generate(prompt, max_tokens=16, temperature=0.0, eos=False)
                        ctx.reset()
                        res = ctx.generate(prompt, max_tokens=NEW_TOKENS, temperature=0.0, eos=False)
                finally:
                    del os.environ[name]
                out[f"decode_tok_s_{key}"] = res.decode_tokens_per_s
                out[f"tokens_match_{key}"] = list(res.tokens) == graph_tokens
            out["graph_tokens_match_eager"] = out["tokens_match_eager"]
            # sampled steps are recorded apart from chained greedy ones: warm up first
            sampling = dict(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=3, eos=False)
            model.generate(prompt, max_tokens=16, **sampling)
            res = model.generate(prompt, max_tokens=NEW_TOKENS, **sampling)
            out["decode_tok_s_sampled"] = res.decode_tokens_per_s
            os.environ["TINYLOOP_CUDA_TC"] = "0"
            try:
                out["prefill_512_ms_no_tc"] = prefill_ms()
            finally:
                del os.environ["TINYLOOP_CUDA_TC"]
            out["peak_device_bytes"] = peak
            out["memory_report"] = model.memory_report()
    except Exception as e:   # recorded, not raised: the report shows it
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    _write(args.out, out)
    return 0 if "error" not in out else 1


def cmd_batch(args):
    """generate_batch of B random prompts of PROMPT_TOKENS, NEW_TOKENS greedy tokens each
    (--prompt-tokens / --new-tokens),
    for each batch size: the decode steps' tokens per second (the steps every sequence
    shares, timed by the longest sequence's decode seconds), after a short warm-up at the
    same size (its steps are recorded as the bucket's CUDA graph)."""
    import tinyloop
    out = {"model": args.path, "device": args.device, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "rows": []}
    try:
        with tinyloop.Model(args.path, device=args.device) as model:
            out["device_name"] = model.info.device_name
            out["kv_dtype"] = model.info.kv_dtype
            vocab = model.info.vocab_size
            for b in [int(x) for x in args.batches.split(",")]:
                prompts = [_tokens(args.prompt_tokens, vocab, 100 + i) for i in range(b)]
                options = dict(temperature=0.0, eos=False)
                try:   # a failing size is recorded, the others still run
                    model.generate_batch(prompts, max_tokens=8, **options)   # warm-up
                    t0 = time.monotonic()
                    results = model.generate_batch(prompts, max_tokens=args.new_tokens, **options)
                    wall = time.monotonic() - t0
                except tinyloop.TinyLoopError as e:
                    row = {"batch": b, "error": f"{type(e).__name__}: {e}"}
                else:
                    steps = sum(len(r.tokens) - 1 for r in results)
                    decode = max(r.decode_seconds for r in results)
                    row = {"batch": b, "decode_tok_s": steps / decode, "decode_s": decode, "wall_s": wall,
                           "tok_s_with_prefill": sum(len(r.tokens) for r in results) / wall}
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:   # what is measured so far survives a time-out
                    json.dump(out, f, indent=1)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    _write(args.out, out)
    return 0 if "error" not in out else 1


def _copy_bandwidth(torch):
    """Device-to-device copy of 2 GiB, bytes read + written per second (best of 5)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1000)
    del a, b
    return 2 * n / best


def _peer_layers(dims):
    """The file's block (name prefix) behind each layer of the unrolled model: the
    prelude, the core blocks once per loop iteration (default depth), the coda."""
    core = [f"core.{c}." for c in range(dims["n_core"])]
    return ([f"pre.{i}." for i in range(dims["n_pre"])] + core * (dims["default_depth"] if core else 0)
            + [f"post.{i}." for i in range(dims["n_post"])])


def _peer_model(path, torch, device="cuda"):
    """An unrolled LlamaForCausalLM on a .tinyloop file's weights, bf16: loop-1b's prelude,
    then its core block repeated `depth` times with the parameters shared; a plain model
    (SmolLM2: 30 prelude blocks) as it is. Q/K rows stored for interleaved RoPE (GGUF's
    layout) are put back in the half-rotation order transformers' Llama uses."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from tinyloop.fileformat.tinyloop_file import read_file
    with read_file(path) as f:
        dims, meta = f.dims, f.metadata
        sources = _peer_layers(dims)
        config = LlamaConfig(vocab_size=dims["vocab_size"], hidden_size=dims["d_model"],
                             intermediate_size=dims["ffn_dim"], num_attention_heads=dims["n_head"],
                             num_key_value_heads=dims["n_kv_head"], head_dim=dims["head_dim"],
                             num_hidden_layers=len(sources), rms_norm_eps=float(meta.get("arch.norm_eps", 1e-5)),
                             rope_theta=float(meta.get("arch.rope_theta", 10000.0)),
                             max_position_embeddings=2048, tie_word_embeddings="output.weight" not in f.tensors,
                             attention_bias=False, mlp_bias=False)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        interleaved = meta.get("arch.rope_style") == "interleaved"

        def put(param, name, heads=0):
            value = np.ascontiguousarray(f.tensor(name), dtype=np.float32)
            if heads and interleaved:   # rows (head, pair, member) -> (head, member, pair)
                value = value.reshape(heads, -1, 2, value.shape[1]).swapaxes(1, 2).reshape(value.shape)
            param.data.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(device=device, dtype=torch.bfloat16))

        put(model.model.embed_tokens.weight, "embed.weight")
        if "output.weight" in f.tensors:
            put(model.lm_head.weight, "output.weight")
        put(model.model.norm.weight, "final_norm.weight")
        first = {}   # block prefix -> the layer that holds its parameters
        for layer, prefix in zip(model.model.layers, sources):
            attn, mlp = layer.self_attn, layer.mlp
            if prefix in first:   # a loop iteration: share, keeping each layer's own cache index
                owner = first[prefix]
                for attr in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(attn, attr).weight = getattr(owner.self_attn, attr).weight
                for attr in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp, attr).weight = getattr(owner.mlp, attr).weight
                layer.input_layernorm.weight = owner.input_layernorm.weight
                layer.post_attention_layernorm.weight = owner.post_attention_layernorm.weight
                continue
            first[prefix] = layer
            put(attn.q_proj.weight, prefix + "attn.q.weight", dims["n_head"])
            put(attn.k_proj.weight, prefix + "attn.k.weight", dims["n_kv_head"])
            put(attn.v_proj.weight, prefix + "attn.v.weight")
            put(attn.o_proj.weight, prefix + "attn.o.weight")
            for attr, key in (("gate_proj", "mlp.gate"), ("up_proj", "mlp.up"), ("down_proj", "mlp.down")):
                put(getattr(mlp, attr).weight, prefix + key + ".weight")
            put(layer.input_layernorm.weight, prefix + "attn_norm.weight")
            put(layer.post_attention_layernorm.weight, prefix + "mlp_norm.weight")
    model.eval()
    return model, config


def _static_cache(config, torch, max_len):
    """A StaticCache for batch 1 and max_len positions; the constructor's signature differs
    between transformers releases, so the known forms are tried in turn."""
    from transformers import StaticCache
    attempts = (
        lambda: StaticCache(config=config, max_cache_len=max_len),
        lambda: StaticCache(config=config, max_batch_size=1, max_cache_len=max_len,
                            device="cuda", dtype=torch.bfloat16),
        lambda: StaticCache(config, 1, max_len, "cuda", torch.bfloat16),
    )
    errors = []
    for make in attempts:
        try:
            return make()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    raise RuntimeError("StaticCache(...) failed: " + " | ".join(errors))


def _peer_decode(model, torch, config, static):
    """Greedy decode by hand (no generate() overhead): one prefill of the prompt, then
    one forward per token against the cache, argmax on the device. Returns the decode
    tokens per second (prefill excluded), best of two timed runs after a warm-up."""
    prompt = torch.from_numpy(_tokens(PROMPT_TOKENS, config.vocab_size, 7).astype(np.int64)).cuda()[None]
    total = PROMPT_TOKENS + NEW_TOKENS + 1
    positions = torch.arange(total, dtype=torch.long, device="cuda")

    def run(new):
        cache = _static_cache(config, torch, total) if static else None
        kwargs = {"past_key_values": cache} if cache is not None else {}
        out = model(input_ids=prompt, use_cache=True, cache_position=positions[:PROMPT_TOKENS], **kwargs)
        cache = out.past_key_values
        token = out.logits[:, -1, :].argmax(dim=-1)
        torch.cuda.synchronize()
        t = time.monotonic()
        for step in range(new):
            pos = PROMPT_TOKENS + step
            out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True,
                        cache_position=positions[pos:pos + 1])
            cache = out.past_key_values
            token = out.logits[:, -1, :].argmax(dim=-1)
        torch.cuda.synchronize()
        return time.monotonic() - t

    run(8)   # warm-up
    best = min(run(NEW_TOKENS) for _ in range(2))
    return NEW_TOKENS / max(best, 1e-9)


def cmd_peer(args):
    out = {}
    try:
        import torch
        out["copy_bandwidth_Bps"] = _copy_bandwidth(torch)
        out["l2_bytes"] = torch.cuda.get_device_properties(0).L2_cache_size
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()   # the peak below is the peer's, not the copy test's
        with torch.inference_mode():
            model, config = _peer_model(args.path, torch)
            vocab = config.vocab_size
            out["decode_method"] = "hand-written greedy loop: prefill once, then one forward per token"
            for name, static in (("eager", False), ("static_cache", True)):
                try:
                    out[f"decode_tok_s_{name}"] = _peer_decode(model, torch, config, static)
                except Exception as e:
                    out[f"error_{name}"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            ids = torch.from_numpy(_tokens(PREFILL_TOKENS, vocab).astype(np.int64)).cuda()[None]
            model(ids)
            times = []
            for _ in range(REPEATS):
                torch.cuda.synchronize()
                t = time.monotonic()
                model(ids)
                torch.cuda.synchronize()
                times.append(time.monotonic() - t)
            out["prefill_512_ms"] = 1000 * min(times)
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    _write(args.out, out)
    return 0 if "error" not in out else 1


def _write(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(json.dumps(data, indent=1, default=str))


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools/gpu/bench.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("path")
    m.add_argument("--dtype", required=True)
    m.add_argument("--group-size", type=int, default=64)
    m.add_argument("--dims", default="")
    s = sub.add_parser("short-run")
    s.add_argument("path")
    s.add_argument("--device", default="cuda")
    t = sub.add_parser("tinyloop")
    t.add_argument("path")
    t.add_argument("--device", default="cuda")
    t.add_argument("--out", required=True)
    q = sub.add_parser("peer")
    q.add_argument("path")
    q.add_argument("--out", required=True)
    b = sub.add_parser("batch")
    b.add_argument("path")
    b.add_argument("--device", default="cuda")
    b.add_argument("--batches", default="1,8,64,256")
    b.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    b.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    b.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return {"make": cmd_make, "short-run": cmd_short_run, "tinyloop": cmd_tinyloop,
            "peer": cmd_peer, "batch": cmd_batch}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
