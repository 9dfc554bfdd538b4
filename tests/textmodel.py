"""A tiny random model that carries a real tokenizer, for the binding and CLI tests.

The tokenizer is byte-level BPE without merges: 256 byte tokens plus <s> and </s>, so
any text encodes, and a character outside ASCII spans several tokens (which is what
incremental detokenization must handle). The model's vocab is exactly that size.
"""

from __future__ import annotations

import os

from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import TinyLoopWriter, read_file

BOS, EOS = 256, 257
VOCAB = 258
MAX_SEQ_LEN = 96
MAX_DEPTH = 4

DIMS = dict(vocab_size=VOCAB, d_model=32, n_head=4, n_kv_head=2, head_dim=8, ffn_dim=64,
            n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=MAX_DEPTH,
            max_seq_len=MAX_SEQ_LEN)

# a chat template in ChatML's shape, with the model's own <s> and </s> around each turn
CHATML = ("{% for message in messages %}{{'<s>' + message['role'] + '\n' + message['content'] "
          "+ '</s>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


def byte_level_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # ids follow byte values: a byte's token id is the byte itself
    vocab = {char: b for b, char in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok.to_str()


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte value 0..255."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_text_model(path, *, seed: int = 7, add_bos: bool = True,
                    chat_template: str | None = None, tokenizer_json: str | None = None,
                    max_seq_len: int = MAX_SEQ_LEN) -> None:
    """Write a random model with the byte-level tokenizer (or `tokenizer_json`, one of
    VOCAB tokens with <s> and </s> at BOS and EOS; and a chat template, when given) to
    `path`."""
    plain = f"{path}.plain"
    make_random_model(plain, seed=seed, dtype="f32", **dict(DIMS, max_seq_len=max_seq_len))
    with read_file(plain) as src:
        writer = TinyLoopWriter(dict(src.dims))
        for key, value in src.metadata.items():
            writer.add_metadata(key, value)
        writer.add_metadata("tokenizer.json", tokenizer_json or byte_level_tokenizer_json())
        writer.add_metadata("tokenizer.bos_id", BOS)
        writer.add_metadata("tokenizer.eos_id", EOS)
        writer.add_metadata("tokenizer.add_bos", int(add_bos))
        if chat_template is not None:
            writer.add_metadata("tokenizer.chat_template", chat_template)
        for entry in src.tensors.values():
            writer.add_raw_tensor(entry.name, entry.dtype, entry.shape, entry.group_size,
                                  bytes(src.raw(entry.name)))
        writer.write(path)
    os.remove(plain)
