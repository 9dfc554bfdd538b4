"""Hugging Face `tokenizers` JSON for a GGUF "gpt2"-style byte-level BPE vocabulary.

SmolLM2 (tokenizer.ggml.pre = "smollm") splits digits one by one, then applies the GPT-2
byte-level regex; tokens of type 3 (control) are special added tokens.
"""

from __future__ import annotations

import json

_CONTROL = 3


def tokenizer_json(metadata: dict) -> str:
    """tokenizer.json text built from GGUF tokenizer metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') is supported")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "default", "gpt-2"):
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = list(metadata["tokenizer.ggml.merges"])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    pre_tokenizers = [byte_level]
    if pre == "smollm":
        pre_tokenizers.insert(0, {"type": "Digits", "individual_digits": True})
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": merges},
    }
    return json.dumps(spec, ensure_ascii=False)


def special_ids(metadata: dict) -> dict:
    """BOS/EOS ids and the add-BOS flag as the format's tokenizer.* keys expect."""
    return {
        "bos_id": int(metadata.get("tokenizer.ggml.bos_token_id", -1)),
        "eos_id": int(metadata.get("tokenizer.ggml.eos_token_id", -1)),
        "add_bos": int(bool(metadata.get("tokenizer.ggml.add_bos_token", False))),
    }
