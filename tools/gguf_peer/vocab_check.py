"""The tokenizer.json the GGUF import builds against llama.cpp's own tokenizer tests: its
vocabulary-only files `models/ggml-vocab-NAME.gguf` come with `.inp` (test strings) and
`.out` (llama.cpp's ids, no BOS). Prints the mismatches and round-trip failures.

    python tools/gguf_peer/vocab_check.py LLAMA_CPP/models/ggml-vocab-llama-spm.gguf"""
import sys
import time

from tokenizers import Tokenizer

from tinyloop.convert.gguf_reader import GGUFFile
from tinyloop.convert.gguf_tokenizer import tokenizer_json_from_gguf
base = sys.argv[1]
g = GGUFFile(base)
t0 = time.time()
tok = Tokenizer.from_str(tokenizer_json_from_gguf(g.metadata, base))
print("built in", round(time.time() - t0, 2), "s")
inp = open(base + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
out = open(base + ".out", encoding="utf-8").read().split("\n")
bad = 0
for text, ids in zip(inp, out):
    want = [int(x) for x in ids.split()]
    got = tok.encode(text, add_special_tokens=False).ids
    if got != want:
        bad += 1
        print("MISMATCH", repr(text)[:80], got[:20], want[:20])
    back = tok.decode(got, skip_special_tokens=False)
    if back != text:
        print("ROUNDTRIP", repr(text)[:60], repr(back)[:60])
print(len(inp), "cases,", bad, "mismatches")
