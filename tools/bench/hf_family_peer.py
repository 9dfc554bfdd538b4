"""A looped family's own Hugging Face modeling code as a benchmark peer (never part of
TinyLoop): the checkpoint directory that `tinyloop convert` imports (for instance one that
`tools/bench/looped_families.py checkpoint` wrote), loaded with transformers in bf16 on the
GPU through the family's modeling files (copied into the directory from --code, as a
downloaded checkpoint carries them), then batch-1 greedy decode and one 512-token prefill
at the given loop depth, as `looped_families.py bench` times TinyLoop.

    python tools/bench/hf_family_peer.py DIR --code DIR_WITH_MODELING_PY \
        --forward-kwargs '{"num_steps": 32}' --cache-class HuginnDynamicCache --out F.json

The modeling code is the family's (Huginn: raven_modeling_minimal.py and
raven_config_minimal.py of seal-rg/recurrent-pretraining); it is carried to the benchmark
machine, not committed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import traceback
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--code", required=True, help="a directory with the family's modeling .py files")
    p.add_argument("--forward-kwargs", default="{}", help="JSON: the depth argument of forward()")
    p.add_argument("--cache-class", default="HuginnDynamicCache", help="the modeling code's KV cache class")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"dir": args.dir, "peer": "transformers, bf16, the family's modeling code"}
    try:
        import torch
        import transformers
        out["transformers"] = transformers.__version__
        for f in Path(args.code).glob("*.py"):
            shutil.copy(f, Path(args.dir) / f.name)
        t0 = time.monotonic()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.dir, trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
        out["load_s"] = time.monotonic() - t0
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        fwd = json.loads(args.forward_kwargs)
        with torch.no_grad():
            ids = torch.randint(0, vocab, (1, 512), generator=g).cuda()
            times = []
            for _ in range(3):   # the first pass warms up
                torch.cuda.synchronize()
                t = time.monotonic()
                model(input_ids=ids, **fwd)
                torch.cuda.synchronize()
                times.append(time.monotonic() - t)
            out["prefill_512_ms"] = 1000 * min(times[1:])
            prompt = torch.randint(0, vocab, (1, 64), generator=g).cuda()
            # greedy decode through forward() and the family's cache, as its generate loop
            # does (transformers' generate() helpers it uses change between versions)
            import sys
            cache_class = getattr(sys.modules[type(model).__module__], args.cache_class)

            def decode(n):
                torch.cuda.synchronize()
                t = time.monotonic()
                cache, pos, tok = cache_class(), 0, prompt
                for _ in range(n):
                    out_ = model(input_ids=tok, past_key_values=cache, use_cache=True,
                                 cache_position=torch.arange(pos, pos + tok.shape[1], device=tok.device), **fwd)
                    cache, pos = out_.past_key_values, pos + tok.shape[1]
                    tok = out_.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                return time.monotonic() - t
            decode(4)   # warm-up
            first = decode(1)   # the prompt's prefill and the first token
            wall = decode(args.new_tokens)
            out["new_tokens"] = args.new_tokens
            # the steps after the first token, as TinyLoop's decode_tokens_per_s counts them
            out["decode_tok_s"] = (args.new_tokens - 1) / max(wall - first, 1e-9)
    except Exception as e:   # recorded for the report, not raised
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    raise SystemExit(main())
