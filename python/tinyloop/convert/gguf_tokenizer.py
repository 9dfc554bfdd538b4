"""GGUF `tokenizer.ggml.*` metadata -> a Hugging Face `tokenizers` JSON.

Byte-level BPE (`tokenizer.ggml.model = gpt2`): GGUF stores the vocabulary (`tokens`,
`token_type`), the BPE `merges` and the name of the pre-tokenizer (`pre`) that llama.cpp
applies before BPE. We rebuild the same pipeline with the `tokenizers` building blocks:
control and user-defined tokens become added tokens (matched before pre-tokenization), the
pre-tokenizer follows `pre`, decoding is byte-level.

SentencePiece BPE (`llama`: Llama 2, Mistral, ...): pieces with `▁` for spaces, a score per
piece and `<0xNN>` byte tokens, no merges. llama.cpp joins the adjacent pair whose joined
text is the highest-scoring piece; a BPE whose merges are every (left, right) split of every
piece, ranked by that piece's score, does the same. Text gets `▁` for spaces and one in front
(`add_space_prefix`), characters outside the vocabulary become their UTF-8 byte tokens.
"""

from __future__ import annotations

import json

from ..errors import FormatError

# tokenizer.ggml.token_type values
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 split is what ByteLevel(use_regex=True) applies by itself.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = dict(_BYTE_LEVEL, use_regex=False)
_SINGLE_DIGITS = {"type": "Digits", "individual_digits": True}

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> dict:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL_NO_REGEX]}


_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [_SINGLE_DIGITS, _BYTE_LEVEL]}

# tokenizer.ggml.pre -> HF pre-tokenizer (same splits as llama.cpp uses for that name)
PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL, "gpt-2": _BYTE_LEVEL, "mpt": _BYTE_LEVEL, "olmo": _BYTE_LEVEL,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT), "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}


def tokenizer_json_from_gguf(metadata: dict, source: str = "GGUF") -> str:
    """Build the tokenizer.json text from GGUF metadata; FormatError when unsupported."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_json(metadata, source)
    if model != "gpt2":
        raise FormatError(f"{source}: tokenizer.ggml.model {model!r} is not supported; only "
                          "byte-level BPE ('gpt2') and SentencePiece BPE ('llama') tokenizers "
                          "can be imported")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise FormatError(f"{source}: pre-tokenizer {pre!r} is not supported; known: "
                          f"{sorted(PRE_TOKENIZERS)}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise FormatError(f"{source}: tokenizer.ggml.tokens and tokenizer.ggml.merges are required")
    types = _token_types(metadata, tokens, source)
    return build_tokenizer_json(list(tokens), [str(m) for m in merges], types, PRE_TOKENIZERS[pre])


def _token_types(metadata: dict, tokens: list, source: str) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    types = [TOKEN_NORMAL] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise FormatError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    return types


def _vocab(tokens: list[str]) -> dict:
    vocab = {}
    for i, tok in enumerate(tokens):
        # duplicates would make ids ambiguous; the first id wins as in llama.cpp's map
        vocab.setdefault(tok, i)
    return vocab


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict]:
    return [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t == TOKEN_CONTROL}
        for i, (tok, t) in enumerate(zip(tokens, types))
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Every split of every text piece into two text pieces, best-scoring result first (ties:
    the lower id of the result, then of the left and right pieces)."""
    vocab = _vocab(tokens)
    mergeable = {tok for tok, t in zip(tokens, types) if t in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    ranked = []
    for piece in mergeable:
        pid = vocab[piece]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[pid]), pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def _merges_field(merges: list[list[str]]) -> list:
    """tokenizers' "left right" strings, which every version reads, unless a piece holds a
    space; then [left, right] pairs (tokenizers >= 0.20)."""
    if any(" " in part for pair in merges for part in pair):
        return merges
    return [f"{left} {right}" for left, right in merges]


def _sentencepiece_json(metadata: dict, source: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    scores = metadata.get("tokenizer.ggml.scores")
    if tokens is None or scores is None:
        raise FormatError(f"{source}: tokenizer.ggml.tokens and tokenizer.ggml.scores are required "
                          "for a SentencePiece ('llama') tokenizer")
    tokens = [str(t) for t in tokens]
    if len(scores) != len(tokens):
        raise FormatError(f"{source}: {len(scores)} scores for {len(tokens)} tokens")
    types = _token_types(metadata, tokens, source)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
    byte_fallback = all(f"<0x{b:02X}>" in tokens for b in range(256))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    normalizers = ([{"type": "Prepend", "prepend": "\u2581"}] if add_prefix else []) + [
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,  # BOS is added by the runtime per tokenizer.add_bos
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None,
            "unk_token": tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
            "byte_fallback": byte_fallback, "ignore_merges": False, "vocab": _vocab(tokens),
            "merges": _merges_field(sentencepiece_merges(tokens, list(scores), types)),
        },
    }
    return json.dumps(doc, ensure_ascii=False)


def build_tokenizer_json(tokens: list[str], merges: list[str], types: list[int], pre_tokenizer: dict) -> str:
    vocab = _vocab(tokens)
    for m in merges:
        # GGUF and tokenizers share the "left right" form; byte-level pieces have no spaces
        if m.count(" ") != 1:
            raise FormatError(f"BPE merge {m!r} is not two pieces separated by one space")
    added = _added_tokens(tokens, types)
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,  # BOS is added by the runtime per tokenizer.add_bos
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": list(merges),
        },
    }
    return json.dumps(doc, ensure_ascii=False)


def check_round_trip(tokenizer_json: str, samples: list[str]) -> None:
    """Encode and decode `samples` with the built tokenizer; FormatError on a mismatch."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False).ids
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            raise FormatError(f"tokenizer round trip failed: {text!r} -> {ids} -> {back!r}")
