"""Sample training text from the teacher: continuations of training-corpus prompts.

The corpora hold 5.9 M tokens; a 14-minute run reads them ~34 times and the student
memorises them (fit.py). Text the teacher samples itself is distillation data without
that limit: the student learns the teacher's distribution where the teacher puts its
mass. Each record starts with --prompt-tokens tokens of train.u16 (drawn like train.py's
windows, --source-weights included; never validation or held-out text) or, for
--free-share of the batches, with the document separator alone, and continues with
tokens sampled from the teacher at --temperature, to --length tokens in all.

Decoding keeps a key/value cache per layer (the teacher's blocks, read step by step), so
one batch of B records costs --length steps of B tokens. Records are appended to --out
as uint16 after every batch, so a run stopped by --minutes keeps what it made; --out.json
records the settings and the count. --check first compares the cached decode with the
teacher's full-sequence logits on training text and stops when they differ.

  python3 tools/train/generate_text.py --teacher T.gguf --out /tmp/synth-0.u16 \\
      --minutes 2 --batch 1024 --length 1025 --seed 0 --source-weights sotu=2 --check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layers import apply_rope_interleaved, rope_tables  # noqa: E402
from teacher import Teacher, load_teacher  # noqa: E402
from train import load_tokens, sample_batch, source_ranges  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ATTENTION = ("sdpa", "matmul")  # a decode step's attention: fused kernel, or explicit product and softmax
SAMPLERS = ("race", "multinomial")
# Not cuDNN's attention: it builds a plan per key length, and a record's steps meet every
# length once (measured on an H200: a batch of 1024 x 513 took 36 s the first time, 15 s
# after; 14 s the first time without cuDNN, at the same speed after).
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CachedDecoder:
    """The teacher read a few positions at a time with a key/value cache per layer.
    Attention groups the query heads by their kv head ([B, kv, group*t, hd] against
    [B, kv, T, hd]), so the cache is never repeated across the group."""

    def __init__(self, teacher: Teacher, batch: int, max_len: int, dtype, device, attention: str = "sdpa"):
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: one of {ATTENTION}")
        self.t, self.dims, self.attention = teacher, teacher.dims, attention
        dm = self.dims
        shape = (batch, dm.kv_heads, max_len, dm.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in teacher.layers]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in teacher.layers]
        self.cos, self.sin = rope_tables(max_len, dm.head_dim, dm.rope_theta, device)
        self.pos = 0

    def _attend(self, i: int, block, x):
        B, t, _ = x.shape
        dm, a, p = self.dims, block.attn, self.pos
        group = dm.heads // dm.kv_heads
        cos, sin = self.cos[p:p + t], self.sin[p:p + t]
        q = apply_rope_interleaved(a.q(x).view(B, t, dm.heads, dm.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope_interleaved(a.k(x).view(B, t, dm.kv_heads, dm.head_dim).transpose(1, 2), cos, sin)
        self.k[i][:, :, p:p + t] = k
        self.v[i][:, :, p:p + t] = a.v(x).view(B, t, dm.kv_heads, dm.head_dim).transpose(1, 2)
        keys, values = self.k[i][:, :, :p + t], self.v[i][:, :, :p + t]
        q = q.reshape(B, dm.kv_heads, group * t, dm.head_dim)  # head kv*group + g reads kv head kv
        if t == 1 and self.attention == "sdpa":  # the group's queries see every key: no mask
            o = F.scaled_dot_product_attention(q, keys, values)
            return a.o(o.reshape(B, dm.heads * dm.head_dim)[:, None])
        scores = (q @ keys.transpose(-1, -2)).float() / math.sqrt(dm.head_dim)
        if t > 1:  # query j of the chunk (row % t) sees keys up to p + j
            rows = torch.arange(group * t, device=x.device) % t
            cols = torch.arange(p + t, device=x.device)
            scores = scores.masked_fill(cols[None, :] > (p + rows)[:, None], float("-inf"))
        o = scores.softmax(-1).to(values.dtype) @ values
        o = o.view(B, dm.heads, t, dm.head_dim).transpose(1, 2).reshape(B, t, dm.heads * dm.head_dim)
        return a.o(o)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, t, V] of the next t positions, given everything read before."""
        h = self.t.embed(tokens)
        with sdpa_kernel(DECODE_BACKENDS):
            for i, block in enumerate(self.t.layers):
                h = h + self._attend(i, block, block.attn_norm(h))
                h = h + block.mlp(block.mlp_norm(h))
        self.pos += tokens.shape[1]
        return self.t.head(h)


def sample_next(logits: torch.Tensor, temperature: float, gen: torch.Generator, sampler: str) -> torch.Tensor:
    """One token per row of logits [B, V], drawn from softmax(logits / temperature).
    race: argmax of logits / T - log(E) with E ~ Exp(1) per entry (the Gumbel-max trick:
    exact, and no normalised probabilities or cumulative sums over the vocabulary)."""
    scaled = logits.float() / temperature
    if sampler == "race":
        noise = torch.empty_like(scaled).exponential_(generator=gen)
        # a draw of exactly 0 would make its token win (-log 0 = inf), whatever its logit
        return (scaled - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()).argmax(-1)
    if sampler == "multinomial":
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen).squeeze(-1)
    raise ValueError(f"sampler {sampler!r}: one of {SAMPLERS}")


@torch.no_grad()
def sample_records(teacher: Teacher, prompts: torch.Tensor, length: int, temperature: float,
                   gen: torch.Generator, attention: str = "sdpa", sampler: str = "race") -> torch.Tensor:
    """prompts [B, P] continued to [B, length] with tokens sampled from the teacher."""
    B, P = prompts.shape
    dec = CachedDecoder(teacher, B, length, teacher.embed.weight.dtype, prompts.device, attention)
    out = torch.empty((B, length), dtype=torch.long, device=prompts.device)
    out[:, :P] = prompts
    logits = dec.logits(prompts)[:, -1]
    nan = torch.zeros((), dtype=torch.bool, device=prompts.device)  # checked once a batch: no sync per step
    for pos in range(P, length):
        nan |= logits.isnan().any()
        out[:, pos] = sample_next(logits, temperature, gen, sampler)
        if pos + 1 < length:
            logits = dec.logits(out[:, pos:pos + 1])[:, -1]
    if nan.item():
        raise FloatingPointError("the teacher's logits hold NaN: these records would be noise")
    return out


@torch.no_grad()
def check_cache(teacher: Teacher, tokens: torch.Tensor, prompt: int, attention: str = "sdpa") -> float:
    """Largest |cached - full| logit over positions prompt-1.. of `tokens` [B, T], relative to
    the largest |logit|; the prompt is read in one chunk, the rest one token at a time."""
    full = teacher(tokens).float()
    dec = CachedDecoder(teacher, tokens.shape[0], tokens.shape[1], teacher.embed.weight.dtype, tokens.device,
                        attention)
    steps = [dec.logits(tokens[:, :prompt])[:, -1:]]
    steps += [dec.logits(tokens[:, p:p + 1]) for p in range(prompt, tokens.shape[1] - 1)]
    cached = torch.cat(steps, dim=1).float()
    ref = full[:, prompt - 1:tokens.shape[1] - 1]
    return ((cached - ref).abs().max() / ref.abs().max()).item()


class Stopped(Exception):
    """SIGTERM arrived: keep the records written so far and report them."""


class StopOnSigterm:
    """SIGTERM handler: stops sampling at once, except inside deferred(), which finishes first
    (a batch is appended and counted whole, or not at all)."""

    def __init__(self):
        self.requested, self.deferring = False, False

    def __call__(self, signum=None, frame=None):
        self.requested = True
        if not self.deferring:
            raise Stopped

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.requested:
            raise Stopped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="teacher GGUF")
    ap.add_argument("--data", default=str(REPO / ".traindata" / "tokens"), help="data.py's output folder")
    ap.add_argument("--out", required=True, help="records file (uint16); appended to when it exists")
    ap.add_argument("--length", type=int, default=1025, help="tokens per record (train.py --seq + 1)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--free-share", type=float, default=0.25,
                    help="share of batches prompted by the document separator alone")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after the batch that passes this")
    ap.add_argument("--records", type=int, default=0, help="stop once the file holds this many (0: time only)")
    ap.add_argument("--source-weights", default="", help="train.py --source-weights for the prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention", default="sdpa", choices=ATTENTION,
                    help="decode-step attention (bench_generate.py says which is faster on a machine)")
    ap.add_argument("--sampler", default="race", choices=SAMPLERS)
    ap.add_argument("--check", action="store_true", help="compare cached and full logits first")
    args = ap.parse_args(argv)
    if args.minutes <= 0 and args.records <= 0:
        ap.error("give --minutes and/or --records")
    if not 1 <= args.prompt_tokens < args.length:
        ap.error("--prompt-tokens must be in [1, --length)")
    if not 0.0 <= args.free_share <= 1.0 or args.temperature <= 0 or args.batch < 1:
        ap.error("--free-share must be in [0, 1], --temperature > 0 and --batch >= 1")

    out = Path(args.out)
    size = out.stat().st_size if out.exists() else 0
    if size % (2 * args.length):
        print(f"[generate] {out} holds {size // 2} tokens, not whole records of --length {args.length}: "
              "appending would misalign every record after them", file=sys.stderr)
        return 2
    have = size // (2 * args.length)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    t0 = time.time()
    teacher, _ = load_teacher(args.teacher)
    teacher.to(device)
    if device.type == "cuda":
        teacher.to(torch.bfloat16)
        torch.backends.cuda.matmul.allow_tf32 = True
    data = Path(args.data)
    tokens = load_tokens(data / "train.u16")
    sources = source_ranges(data, len(tokens), args.source_weights) if args.source_weights else None
    manifest = json.loads((data / "manifest.json").read_text())
    sep = int(manifest["tokenizer"]["separator_id"])
    gen = torch.Generator().manual_seed(args.seed)
    dev_gen = torch.Generator(device=device).manual_seed(args.seed + 1)

    info = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "check", "device")},
            "teacher": Path(args.teacher).name, "separator_id": sep}
    if args.check:
        x, _ = sample_batch(tokens, 2, 64, torch.Generator().manual_seed(args.seed + 2), device, sources)
        err = check_cache(teacher, x, 16, args.attention)
        info["cache_check_rel_err"] = err
        limit = 2e-2 if device.type == "cuda" else 1e-4  # bf16 on the GPU
        print(f"[generate] cached vs full logits: max relative difference {err:.2e} (limit {limit:g})", flush=True)
        if not err < limit:
            print("[generate] the cached decode disagrees with the full pass: stopping", file=sys.stderr)
            return 1

    made, sampled, batches, start = 0, 0, 0, time.time()
    stopper = StopOnSigterm()
    signal.signal(signal.SIGTERM, stopper)  # sample_and_train.sh stops a sampler it kept on
    try:
        while True:
            if args.records > 0 and have + made >= args.records:
                break
            if args.minutes > 0 and time.time() - start > args.minutes * 60:
                break
            free = torch.rand((), generator=gen).item() < args.free_share
            if free:
                prompts = torch.full((args.batch, 1), sep, dtype=torch.long, device=device)
            else:
                prompts, _ = sample_batch(tokens, args.batch, args.prompt_tokens, gen, device, sources)
            records = sample_records(teacher, prompts, args.length, args.temperature, dev_gen,
                                     args.attention, args.sampler)
            data = records.to("cpu", torch.int64).numpy().astype(np.uint16)
            with stopper.deferred():
                with open(out, "ab") as f:
                    data.tofile(f)
                made += records.shape[0]
                sampled += records.shape[0] * (args.length - prompts.shape[1])
                batches += 1
            rate = sampled / (time.time() - start)
            print(f"[generate] batch {batches} ({'free' if free else 'prompted'}): {have + made} records, "
                  f"{rate:.0f} sampled tokens/s", flush=True)
    except Stopped:
        info["stopped"] = "SIGTERM"
        print(f"[generate] stopped by SIGTERM after {batches} whole batches", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
    info.update(records=have + made, records_this_run=made, sampled_tokens_this_run=sampled,
                seconds=round(time.time() - t0, 1), setup_s=round(start - t0, 1))
    Path(str(out) + ".json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[generate] {out}: {have + made} records of {args.length} tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
