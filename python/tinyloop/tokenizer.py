"""Text <-> token ids through the Hugging Face tokenizer stored in a model file.

BOS handling follows the file's `tokenizer.add_bos` / `tokenizer.bos_id` metadata, not
the tokenizer.json post-processor, so a prompt gets exactly one BOS whatever the
tokenizer's own template says.
"""

from __future__ import annotations

from typing import Iterable

from .errors import TinyLoopError

# decode() yields this when the ids so far end inside a multi-byte UTF-8 character
_INCOMPLETE = "\ufffd"
# a character spans at most 4 byte tokens, so at most 3 trailing tokens can still be
# completed by the next one; anything older that decodes to U+FFFD is invalid for good
_MAX_PENDING = 3
# tokens before a continuation that its decoding reads, so that the continuation's text
# is what it adds after them (a word-initial SentencePiece token keeps its space)
_CONTEXT_TOKENS = 4


def _byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE vocabulary writes for each byte, reversed: bytes
    that are printable Latin-1 stand for themselves, the others (controls, space, soft
    hyphen, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    def __init__(self, tokenizer_json: str, *, bos_id: int = -1, eos_id: int = -1,
                 add_bos: bool = False):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:  # pragma: no cover - a declared dependency
            raise TinyLoopError("the 'tokenizers' package is needed for text in/out") from None
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TinyLoopError(f"the model's tokenizer.json cannot be loaded: {e}") from None
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos) and bos_id >= 0
        self._byte_level: dict[str, int] | None = None   # built on first use by token_bytes
        self._texts: dict[int, str] = {}   # token_text's, as asked

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS is prepended when `add_bos` (default: the model's
        tokenizer.add_bos) is true and the model has a BOS token."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id >= 0:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token: int) -> str | None:
        return self._tok.id_to_token(int(token))

    def token_bytes(self, token: int) -> bytes:
        """The bytes of text one token stands for, also when it holds only part of a
        character (byte-level BPE pieces, `<0xHH>` byte-fallback tokens)."""
        piece = self.token_to_str(token) or ""
        if type(self._tok.decoder).__name__ == "ByteLevel":
            if self._byte_level is None:
                self._byte_level = _byte_level_alphabet()
            if all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        # decoders drop a word-initial space at the start of a text (SentencePiece's
        # Metaspace, Llama's Strip): the token's text after a copy of itself keeps it
        alone = self.decode([token], skip_special_tokens=False)
        twice = self.decode([token, token], skip_special_tokens=False)
        return (twice[len(alone):] if twice.startswith(alone) else alone).encode("utf-8")

    def token_text(self, token: int) -> str:
        """One token's text (token_bytes as UTF-8): what it adds to a text, its
        word-initial space included; a token holding part of a character gives U+FFFD
        for the bytes of it (token_bytes has them)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.token_bytes(token).decode("utf-8", "replace")
        return text

    def incremental_decoder(self, context: Iterable[int] = ()) -> "IncrementalDecoder":
        """A decoder of the tokens that follow `context` (e.g. a prompt; () = the start of
        a text): its pieces join to decode(context + tokens) after decode(context)."""
        return IncrementalDecoder(self, context)

    def decode_continuation(self, context: Iterable[int], ids: Iterable[int]) -> str:
        """The text `ids` add after `context`, as an incremental decoder gives it whole
        (decode(ids) alone would lose a word-initial SentencePiece space)."""
        decoder = IncrementalDecoder(self, context)
        return decoder.push_all(ids) + decoder.flush()


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces as soon as they are printable.

    Decoding token by token breaks byte-fallback tokens (a character split over
    several tokens) and the leading-space rules of SentencePiece-style decoders, so
    each step decodes a short window of recent tokens and emits what was added,
    holding back text that still ends in an incomplete character. The first window starts
    with the last tokens of `context` (what the tokens follow, e.g. the prompt): decoded
    alone, the first token of a text loses a SentencePiece word-initial space (Metaspace,
    Llama's Strip), which the text after a prompt keeps. Context tokens that end inside a
    character are left out of that window (their character is the prompt's, not text of
    the continuation)."""

    def __init__(self, tokenizer: Tokenizer, context: Iterable[int] = ()):
        self._tokenizer = tokenizer
        seed = [int(t) for t in list(context)[-_CONTEXT_TOKENS:]]
        while seed and tokenizer.decode(seed).endswith(_INCOMPLETE):
            seed.pop()
        self._ids: list[int] = seed
        self._prefix_offset = 0           # start of the window that gives decode its context
        self._read_offset = len(seed)     # tokens up to here have been emitted as text

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(int(token))
        full = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if not full.endswith(_INCOMPLETE):
            return self._emit_until(len(self._ids), full)
        if len(self._ids) - self._read_offset > _MAX_PENDING:
            return self._emit_until(len(self._ids) - _MAX_PENDING)
        return ""

    def _emit_until(self, end: int, text: str | None = None) -> str:
        """Emit the text of the tokens before `end` not emitted yet."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        if text is None:
            text = self._tokenizer.decode(self._ids[self._prefix_offset:end])
        if len(text) <= len(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        return text[len(prefix):]

    def push_all(self, tokens: Iterable[int]) -> str:
        return "".join(self.push(t) for t in tokens)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of the stream)."""
        return self._emit_until(len(self._ids))
