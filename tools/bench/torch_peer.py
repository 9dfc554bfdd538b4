#!/usr/bin/env python3
"""The peer of TinyLoop's batched decoding: a plain decoder of loop-1b's shape written in
PyTorch for this benchmark (not a dependency of the package), bf16, compiled with
torch.compile and replayed as CUDA graphs, measuring batched greedy decode tokens per
second for each batch size asked for.

loop-1b is the random benchmark model of tools/gpu_check (tools/gpu/bench.py make,
PRESETS["loop-1b"] of tinyloop/fileformat/random_model.py): vocabulary 32000, d_model
2048, 16 query heads and 4 KV heads of 128, SiLU-gated MLP of 5632, RMSNorm (eps 1e-5)
before attention and MLP, RoPE over whole heads (half rotation, theta 10000), 2 prelude
blocks and 1 core block run 8 times with shared weights (every iteration its own KV
cache, as TinyLoop's exact KV policy), a final norm and an untied head. The peer draws
random bf16 weights of that shape; speed does not depend on their values.

Decoding: every layer has a static KV cache [B, 4, max_len, 128] (bf16, max_len = prompt
+ new tokens, rounded up to 64); the prompt (B rows of random tokens) is prefilled once,
eagerly; each decode step (embedding, the 10 layers with fused q/k/v and gate/up
projections, RoPE, the cache write at the step's position, SDPA of the step's query
against the whole cache under a mask of the positions written, head, argmax) is one
torch.compile'd function, captured with the token feedback and the position increment as
one CUDA graph per batch size, so the timed loop is graph replays alone, no host work per
token. Reported: B x new tokens / seconds of those replays (best of --repeat).

    python3 tools/bench/torch_peer.py --batches 1,8,64,256 --json peer.json
"""

import argparse
import json
import math
import time

SHAPE = dict(vocab=32000, d=2048, n_head=16, n_kv_head=4, head_dim=128, ffn=5632, n_pre=2, n_core=1, depth=8,
             theta=10000.0, eps=1e-5)


class Decoder:
    """Weights and caches of the unrolled decoder; step() is what gets compiled."""

    def __init__(self, torch, batch, max_len, shape, seed=0, device="cuda", dtype=None):
        self.torch, self.B, self.max_len, self.s = torch, batch, max_len, shape
        s, dev, dt = shape, device, dtype or torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(seed)
        qd, kvd = s["n_head"] * s["head_dim"], s["n_kv_head"] * s["head_dim"]

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=g, device=dev, dtype=torch.float32) / math.sqrt(cols)).to(dt)

        def block():
            return {"n1": torch.ones(s["d"], device=dev, dtype=dt), "n2": torch.ones(s["d"], device=dev, dtype=dt),
                    "qkv": w(qd + 2 * kvd, s["d"]), "o": w(s["d"], qd), "gate_up": w(2 * s["ffn"], s["d"]),
                    "down": w(s["d"], s["ffn"])}

        blocks = [block() for _ in range(s["n_pre"] + s["n_core"])]
        core = blocks[s["n_pre"]:]
        # the layers in order: prelude, then the core blocks once per iteration (shared weights)
        self.layers = blocks[:s["n_pre"]] + [core[i % s["n_core"]] for i in range(s["n_core"] * s["depth"])]
        self.embed = torch.randn(s["vocab"], s["d"], generator=g, device=dev, dtype=torch.float32).to(dt)
        self.final_norm = torch.ones(s["d"], device=dev, dtype=dt)
        self.head = w(s["vocab"], s["d"])
        cache = (batch, s["n_kv_head"], max_len, s["head_dim"])
        self.k = [torch.zeros(cache, device=dev, dtype=dt) for _ in self.layers]
        self.v = [torch.zeros(cache, device=dev, dtype=dt) for _ in self.layers]
        half = s["head_dim"] // 2
        freqs = s["theta"] ** (-torch.arange(half, device=dev, dtype=torch.float64) * 2 / s["head_dim"])
        angles = torch.arange(max_len, device=dev, dtype=torch.float64)[:, None] * freqs[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.positions = torch.arange(max_len, device=dev)

    def norm(self, x, weight):
        t = self.torch
        xf = x.float()
        return (xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.s["eps"])).to(x.dtype) * weight

    def rope(self, x, cos, sin):
        """x [..., T, head_dim] at positions whose cos/sin are [T, half] (half rotation)."""
        half = self.s["head_dim"] // 2
        xf = x.float()
        a, b = xf[..., :half], xf[..., half:]
        return self.torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)

    def layer(self, i, x, pos, attend):
        """One block on x [B, T, d] at positions pos [T]; attend(q, layer) -> [B, H, T, hd]."""
        t, s, L = self.torch, self.s, self.layers[i]
        B, T = x.shape[0], x.shape[1]
        H, KV, hd = s["n_head"], s["n_kv_head"], s["head_dim"]
        q, k, v = (self.norm(x, L["n1"]) @ L["qkv"].t()).split([H * hd, KV * hd, KV * hd], dim=-1)
        cos, sin = self.cos[pos], self.sin[pos]
        q = self.rope(q.view(B, T, H, hd).transpose(1, 2), cos, sin)
        k = self.rope(k.view(B, T, KV, hd).transpose(1, 2), cos, sin)
        self.k[i][:, :, pos] = k
        self.v[i][:, :, pos] = v.view(B, T, KV, hd).transpose(1, 2)
        out = attend(q, i).transpose(1, 2).reshape(B, T, H * hd)
        x = x + out @ L["o"].t()
        gate, up = (self.norm(x, L["n2"]) @ L["gate_up"].t()).chunk(2, dim=-1)
        return x + (t.nn.functional.silu(gate) * up) @ L["down"].t()

    def logits(self, x):
        return self.norm(x, self.final_norm) @ self.head.t()

    def prefill(self, tokens):
        """The prompt [B, T] into the caches; the next tokens [B]."""
        t, s = self.torch, self.s
        T, group = tokens.shape[1], s["n_head"] // s["n_kv_head"]
        pos = self.positions[:T]

        def attend(q, i):
            k = self.k[i][:, :, :T].repeat_interleave(group, dim=1)
            v = self.v[i][:, :, :T].repeat_interleave(group, dim=1)
            return t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        x = self.embed[tokens]
        for i in range(len(self.layers)):
            x = self.layer(i, x, pos, attend)
        return self.logits(x[:, -1]).argmax(-1)

    def step(self, tokens, pos):
        """One decode step: tokens [B] at position pos [1] (a device tensor); the next
        tokens. GQA as SDPA over [B, KV, group, hd] queries: a KV head's query heads are
        its group's rows, all under the mask of the positions written so far."""
        t, s = self.torch, self.s
        B, KV, hd = tokens.shape[0], s["n_kv_head"], s["head_dim"]
        group = s["n_head"] // KV
        mask = (self.positions <= pos).view(1, 1, 1, self.max_len)

        def attend(q, i):
            out = t.nn.functional.scaled_dot_product_attention(q.reshape(B, KV, group, hd), self.k[i], self.v[i],
                                                               attn_mask=mask)
            return out.reshape(B, KV * group, 1, hd)

        x = self.embed[tokens][:, None]
        for i in range(len(self.layers)):
            x = self.layer(i, x, pos, attend)
        return self.logits(x[:, 0]).argmax(-1)


def measure(torch, batch, prompt_tokens, new_tokens, repeat, shape):
    max_len = (prompt_tokens + new_tokens + 63) // 64 * 64
    model = Decoder(torch, batch, max_len, shape)
    # default dynamism: the first batch size compiles static shapes, the next one a graph
    # whose batch is symbolic, which the later sizes reuse (each size has its own CUDA graph)
    compiled = torch.compile(model.step, fullgraph=True)
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")

    def advance():   # what the graph holds: one step, its token fed back, the position moved on
        tokens.copy_(compiled(tokens, pos))
        pos.add_(1)

    prompt = torch.randint(0, shape["vocab"], (batch, prompt_tokens), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(7))
    t0 = time.monotonic()
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # compile and warm up outside the capture
            pos.fill_(prompt_tokens)
            for _ in range(3):
                advance()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            advance()
        compile_s = time.monotonic() - t0
        best = float("inf")
        for _ in range(repeat):
            tokens.copy_(model.prefill(prompt))
            pos.fill_(prompt_tokens)
            torch.cuda.synchronize()
            t = time.monotonic()
            for _ in range(new_tokens):
                graph.replay()
            torch.cuda.synchronize()
            best = min(best, time.monotonic() - t)
    peak = torch.cuda.max_memory_allocated()
    del graph, compiled, model
    torch.cuda.empty_cache()
    return {"batch": batch, "decode_tok_s": batch * new_tokens / best, "decode_s": best, "compile_s": compile_s,
            "peak_device_bytes": peak}


def check(torch, device="cuda", steps=4, compiled=True):
    """The decode step against the prefill of the longer sequence, on a small shape in
    f32: the same greedy tokens, eagerly and (every other step, with `compiled`) compiled;
    a wrong cache write or mask would change them. Returns the steps' tokens."""
    shape = dict(SHAPE, vocab=97, d=64, n_head=4, n_kv_head=2, head_dim=16, ffn=96, depth=3)
    model = Decoder(torch, 3, 32, shape, seed=1, device=device, dtype=torch.float32)
    prompt = torch.randint(0, shape["vocab"], (3, 9), device=device, generator=torch.Generator(device).manual_seed(2))
    step = torch.compile(model.step, fullgraph=True) if compiled else model.step
    with torch.inference_mode():
        seq, token = prompt, model.prefill(prompt)
        for i in range(steps):
            seq = torch.cat([seq, token[:, None]], dim=1)
            fn = model.step if i % 2 == 0 else step
            token = fn(token, torch.tensor([seq.shape[1] - 1], device=device))
            again = Decoder(torch, 3, 32, shape, seed=1, device=device, dtype=torch.float32).prefill(seq)
            if not torch.equal(token, again):
                raise AssertionError(f"step {i}: decode {token.tolist()} != prefill {again.tolist()}")
    return seq[:, prompt.shape[1]:].tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--check", metavar="DEVICE", help="only check the decoder on a small shape (cpu or cuda)")
    args = ap.parse_args(argv)
    import torch
    if args.check:
        print("decode matches prefill:", check(torch, args.check))
        return 0
    out = {"peer": "plain PyTorch decoder of loop-1b's shape, bf16, static KV cache, SDPA, torch.compile + CUDA graphs",
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "shape": SHAPE,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": []}
    out["check"] = check(torch, compiled=False)   # the compiled step: --check (a compile of its own)
    for b in [int(x) for x in args.batches.split(",")]:
        torch.cuda.reset_peak_memory_stats()
        try:
            row = measure(torch, b, args.prompt_tokens, args.new_tokens, args.repeat, SHAPE)
        except Exception as e:   # recorded: the other batch sizes still run
            row = {"batch": b, "error": f"{type(e).__name__}: {e}"[:600]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0 if all("error" not in r for r in out["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
