"""Grammar-constrained generation (docs/python.md, "Grammars").

A Grammar is GBNF text compiled against a model's vocabulary; pass it as
`model.generate(..., grammar=g)` (or stream) and every generated token keeps the text a
prefix of a sentence of the grammar. JSON_GBNF is a built-in grammar of JSON values."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .._handle import ModelChild

if TYPE_CHECKING:
    from ..model import Model

# JSON values (RFC 8259) with whitespace limited to a few characters between tokens, so
# that a model cannot loop on spaces forever; the root is an object or an array of
# values, as OpenAI's json_object asks for an object: see JSON_OBJECT_GBNF.
_JSON_RULES = r'''
value   ::= object | array | string | number | "true" | "false" | "null"
object  ::= "{" ws ( member ( "," ws member )* )? "}"
member  ::= string ws ":" ws value ws
array   ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string  ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex ) )* "\""
hex     ::= [0-9a-fA-F]
number  ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws      ::= ( [ \t\n] ( [ \t\n] ( [ \t\n] [ \t\n]? )? )? )?
'''
#: any JSON value, with at most 4 whitespace characters in a row
JSON_GBNF = "root ::= value\n" + _JSON_RULES
#: a JSON object (what OpenAI's response_format {"type": "json_object"} asks for)
JSON_OBJECT_GBNF = "root ::= object\n" + _JSON_RULES


def _vocabulary_bytes(model: "Model") -> list[bytes]:
    """Each token's bytes (b"" for special tokens, which a grammar never allows)."""
    tok = model.tokenizer
    special = {int(i) for i, t in tok._tok.get_added_tokens_decoder().items() if t.special}
    return [b"" if t in special else tok.token_bytes(t) for t in range(model.info.vocab_size)]


class Grammar(ModelChild):
    """GBNF text compiled against `model`'s vocabulary (see docs/api.md, "Grammars").
    Immutable: several generations, also on other threads, may use one at once.
    A bad grammar raises InvalidArgumentError naming the line and column. token_bytes
    (one bytes per vocabulary id; b"" = never allowed) replaces the tokenizer's, e.g.
    for a model without one."""

    def __init__(self, model: "Model", gbnf: str, token_bytes: Sequence[bytes] | None = None):
        if not isinstance(gbnf, str):
            raise TypeError(f"gbnf must be a str, got {type(gbnf).__name__}")
        self._model = model
        native, ffi = model._native, model._native.ffi
        pieces = _vocabulary_bytes(model) if token_bytes is None else [bytes(p) for p in token_bytes]
        if len(pieces) != model.info.vocab_size:
            raise ValueError(f"token_bytes has {len(pieces)} entries, the vocabulary {model.info.vocab_size}")
        buffers = [ffi.from_buffer(p) if p else ffi.NULL for p in pieces]
        c_bytes = ffi.new("uint8_t *[]", [ffi.cast("uint8_t *", b) for b in buffers])
        c_lengths = ffi.new("size_t[]", [len(p) for p in pieces])
        out = ffi.new("tl_grammar **")
        native.check(native.lib.tl_grammar_create(model._require_open(), gbnf.encode("utf-8"),
                                                   c_bytes, c_lengths, out))
        self._adopt(out[0])
        self.gbnf = gbnf

    @classmethod
    def from_json_schema(cls, model: "Model", schema: Mapping[str, Any] | str | bytes,
                         token_bytes: Sequence[bytes] | None = None) -> "Grammar":
        """The grammar of the JSON documents `schema` (a dict or JSON text) accepts
        (tinyloop.grammar.json_schema: its subset and limits); SchemaError for keywords it cannot
        honour."""
        from .json_schema import json_schema_to_gbnf
        return cls(model, json_schema_to_gbnf(schema), token_bytes=token_bytes)

    def accepts(self, text: str) -> bool:
        """Whether `text` is a whole sentence of the grammar."""
        native, ffi = self._model._native, self._model._native.ffi
        data = text.encode("utf-8")
        ok = ffi.new("int *")
        native.check(native.lib.tl_grammar_accepts(self._require_open(), data, len(data), ok))
        return bool(ok[0])

    def _free(self, handle: Any) -> None:
        self._model._native.lib.tl_grammar_free(handle)


# ---- the server's grammars (docs/server.md, response_format and grammar) ------------

_vocabularies: "weakref.WeakKeyDictionary[Model, list[bytes]]" = weakref.WeakKeyDictionary()
_json_objects: "weakref.WeakKeyDictionary[Model, Grammar]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _cached_vocabulary(model: "Model") -> list[bytes]:
    with _lock:
        pieces = _vocabularies.get(model)
        if pieces is None:
            pieces = _vocabularies[model] = _vocabulary_bytes(model)
        return pieces


def json_object_grammar(model: "Model") -> Grammar:
    """JSON_OBJECT_GBNF compiled for `model` once and shared (a grammar is immutable)."""
    pieces = _cached_vocabulary(model)
    with _lock:
        grammar = _json_objects.get(model)
        if grammar is None or grammar.closed:
            grammar = _json_objects[model] = Grammar(model, JSON_OBJECT_GBNF, token_bytes=pieces)
        return grammar


def request_grammar(model: "Model", gbnf: str) -> Grammar:
    """A request's own GBNF grammar, compiled against the model's cached vocabulary."""
    return Grammar(model, gbnf, token_bytes=_cached_vocabulary(model))
