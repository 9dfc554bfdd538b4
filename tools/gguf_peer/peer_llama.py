"""llama.cpp's side: quantize the f32 GGUFs of make_models.py with llama.cpp's quantizer and
save llama.cpp's logits of every position. Run in a venv with llama-cpp-python (not a
TinyLoop dependency):

    python tools/gguf_peer/peer_llama.py OUT_DIR

KV_F32=1 keeps llama.cpp's KV cache in f32 (its default f16 cache alone moves logits by
~5e-3) and reuses the quantized files of a first run."""
import ctypes
import os
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

M = sys.argv[1]
TEXT = "The quick brown fox jumps over the lazy dog. Llamas eat 42 apples, naïvely!"
QUANTS = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
          "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_K_S": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S}
PLAN = {"llama-spm": ["f32", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"],
        "llama3-ropefreqs": ["f32", "Q4_K_M"], "llama-linear": ["f32"],
        "qwen2": ["f32", "Q8_0"], "qwen2-tied": ["f32"]}
only = sys.argv[2:]

def quantize(src, dst, ftype):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    assert rc == 0, (src, dst, rc)

results = {}
for base, kinds in PLAN.items():
    if only and base not in only:
        continue
    for kind in kinds:
        name = base if kind == "f32" else f"{base}-{kind}"
        path = f"{M}/{name}.gguf"
        if kind != "f32" and not os.environ.get("KV_F32"):
            quantize(f"{M}/{base}.gguf", path, QUANTS[kind])
        kv = dict(type_k=0, type_v=0) if os.environ.get("KV_F32") else {}
        llm = Llama(model_path=path, logits_all=True, n_ctx=128, n_batch=128, n_threads=2, verbose=False, **kv)
        tokens = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
        llm.eval(tokens)
        logits = np.array(llm.scores[:len(tokens)], dtype=np.float32)
        np.savez(f"{M}/{name}.llama{os.environ.get('KV_F32', '')}.npz", text=TEXT, tokens=np.array(tokens, np.int32), logits=logits)
        print(name, len(tokens), "tokens", flush=True)
        del llm
