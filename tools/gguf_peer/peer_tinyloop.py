"""TinyLoop's side: convert each GGUF peer_llama.py ran, and print per case (one JSON line)
the max |logit difference| against llama.cpp, whether the token ids of the text agree, and
the C runtime's and llama.cpp's distance to the float64 oracle on the imported weights:

    python tools/gguf_peer/peer_tinyloop.py OUT_DIR [CASE ...]"""
import glob
import json
import os
import sys
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.convert.from_gguf import convert_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from reference import ReferenceModel  # noqa: E402

M = sys.argv[1]

KV = os.environ.get("KV_F32", "")
for npz in sorted(glob.glob(f"{M}/*.llama{KV}.npz")):
    name = os.path.basename(npz)[: -len(f".llama{KV}.npz")]
    if sys.argv[2:] and name not in sys.argv[2:]:
        continue
    src, dst = f"{M}/{name}.gguf", f"{M}/{name}.tinyloop"
    summary = convert_gguf(src, dst, show_progress=False)   # its note/warning lines go to stderr
    peer = np.load(npz)
    tokens, want = peer["tokens"], peer["logits"].astype(np.float64)
    with tinyloop.Model(dst) as m:
        ours_ids = m.tokenizer.encode(str(peer["text"]), add_bos=False)
        got = np.stack([m.score_last_token(tokens[: k + 1]) for k in range(len(tokens))]).astype(np.float64)
    ref = ReferenceModel.from_file(dst).logits(tokens) if os.path.getsize(dst) < 100e6 else None
    row = dict(case=name, tokens=len(tokens), same_ids=list(ours_ids) == tokens.tolist(),
               max_abs_diff=float(np.abs(got - want).max()), logit_scale=float(np.abs(want).max()),
               argmax_agree=float(np.mean(got.argmax(1) == want.argmax(1))),
               ours_vs_reference=None if ref is None else float(np.abs(got - ref).max()),
               llama_vs_reference=None if ref is None else float(np.abs(want - ref).max()),
               imported={k: v for k, v in summary["tensors"].items()},
               decoded=len(summary["lossy"]), rounded=len(summary["rounded"]))
    print(json.dumps(row), flush=True)
