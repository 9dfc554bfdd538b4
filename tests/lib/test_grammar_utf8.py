"""Grammars over tokens that split characters (docs/api.md, "Grammars"): a token fits when
its bytes, after the character the text ends inside of, are whole characters the grammar
takes and at most one incomplete one that some code point the grammar takes next can
complete. The library's masks, step by step along token paths, equal the reference
matcher's (tests/reference/grammar.py, on bytes) on random vocabularies that cut every
multi-byte character at every position, with invalid UTF-8 among them, and on random
grammars of non-ASCII literals and classes; EOS never comes inside a character;
generation on the shipped model (SmolLM2's byte-level tokenizer) spells a string whose
characters are split over tokens."""

import codecs

import numpy as np
import pytest

import tinyloop
from reference import grammar as ref_grammar
from testing_hooks import hooks_of, through_testing_library  # noqa: F401 (autouse: the models load through the testing library)
from tinyloop.grammar import Grammar
from tinyloop.fileformat.random_model import make_random_model

V = 256
EOS = V - 1

#: characters at the edges of UTF-8's lengths and blocks, ASCII to U+10FFFF
CHARS = ["a", "b", '"', " ", "\x7f", "\x80", "é", "ÿ", "\u07ff", "\u0800", "€", "☃", "中", "\ud7ff",
         "\ue000", "\uffff", "\U00010000", "😀", "𝄞", "\U0010ffff"]
#: code points classes are drawn between, besides CHARS
BOUNDS = [0x0, 0x7f, 0x80, 0xbf, 0xc0, 0xff, 0x7ff, 0x800, 0xfff, 0x1000, 0x2600, 0x263f, 0xd7ff, 0xe000,
          0xffff, 0x10000, 0x1f600, 0x10ffff]
#: never UTF-8 wherever they come: 4 continuation bytes, a stray one after ASCII, overlong
#: forms, surrogates, past U+10FFFF, bytes never used, a character cut by another
NEVER = [b"\x80\x80\x80\x80", b"a\x80", b"\xc0\x80", b"\xc1\xbf", b"\xc1", b"\xe0\x80", b"\xe0\x9f\xbf",
         b"\xed\xa0", b"\xed\xbf\xbf", b"\xf0\x8f", b"\xf4\x90", b"\xf4\x90\x80\x80", b"\xf5", b"\xff",
         b"\xfe\x80", b"\xc3a", b"\xe2\x82a", b"\xf0\x9f\x98a", b"\xc3\xc3"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar-utf8") / "v256.tinyloop"
    make_random_model(path, seed=11, vocab_size=V, d_model=32, n_head=2, n_kv_head=1, head_dim=16,
                      ffn_dim=64, n_pre=1, n_core=0, n_post=0, default_depth=0, max_depth=0,
                      max_seq_len=64)
    with tinyloop.Model(path, device="cpu", threads=1) as m:
        yield m


def random_vocabulary(rng) -> list:
    """V token byte strings: every piece of every multi-byte character of CHARS (each cut
    at every position), ASCII, pieces across characters, NEVER, a few empty, EOS last."""
    pieces = set()
    for c in CHARS:
        e = c.encode()
        pieces |= {e[i:j] for i in range(len(e)) for j in range(i + 1, len(e) + 1)}
    pieces |= set(NEVER)
    while len(pieces) < V - 12:
        text = "".join(rng.choice(CHARS, rng.integers(2, 5))).encode()
        i = int(rng.integers(0, len(text)))
        pieces.add(text[i:int(rng.integers(i + 1, len(text) + 1))])
    vocab = sorted(pieces) + [b""] * (V - 1 - len(pieces))
    vocab = [vocab[i] for i in rng.permutation(len(vocab))]
    vocab[int(rng.integers(0, V - 1))] = b"\xc3"   # a token twice: both fit or neither
    return vocab + [b""]


def _spell(rng, cp: int, in_class: bool) -> str:
    c = chr(cp)
    if c.isprintable() and c not in '"\\' + ("[]-^" if in_class else "") and rng.random() < 0.6:
        return c
    if cp < 0x100 and rng.random() < 0.5:
        return f"\\x{cp:02x}"
    return f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def random_grammar(rng) -> str:
    """GBNF of literals and classes over CHARS and BOUNDS (negated ones too), groups,
    repetitions and helper rules; no recursion."""
    rules = []
    points = [ord(c) for c in CHARS] + BOUNDS

    def item(depth):
        k = rng.random()
        if k < 0.3:
            return '"' + "".join(_spell(rng, ord(c), False) for c in rng.choice(CHARS, rng.integers(1, 3))) + '"', False
        if k < 0.65:
            ranges = []
            for _ in range(int(rng.integers(1, 4))):
                lo, hi = sorted(int(x) for x in rng.choice(points, 2))
                ranges.append(_spell(rng, lo, True) + ("" if lo == hi else "-" + _spell(rng, hi, True)))
            return "[" + ("^" if rng.random() < 0.4 else "") + "".join(ranges) + "]", False
        if k < 0.7:
            return ".", False
        if depth < 2 and k < 0.85:
            text, nullable = alternatives(depth + 1)
            return "( " + text + " )", nullable
        if depth < 2:
            text, nullable = alternatives(depth + 1)
            rules.append(f"r{len(rules)} ::= {text}")
            return f"r{len(rules) - 1}", nullable
        return '"a"', False

    def sequence(depth):
        parts, nullable = [], True
        for _ in range(int(rng.integers(1, 4))):
            text, null = item(depth)
            if rng.random() < 0.35:   # a repetition of what may be empty would recurse on the left
                op = "?" if null else str(rng.choice(list("*+?")))
                text, null = text + op, null or op != "+"
            parts.append(text)
            nullable = nullable and null
        return " ".join(parts), nullable

    def alternatives(depth):
        seqs = [sequence(depth) for _ in range(int(rng.integers(1, 4)))]
        return " | ".join(s for s, _ in seqs), any(n for _, n in seqs)

    root, _ = alternatives(0)
    return "\n".join(["root ::= " + root] + rules) + "\n"


def library_masks(grammar: Grammar, path, eos=EOS):
    """(allowed [len(path) + 1, V] bool, complete [len(path) + 1] bool) of the library's
    matcher before each token of path and after the last."""
    native = grammar._model._native
    ffi, lib = hooks_of(native)
    vocab = grammar._model.info.vocab_size
    tokens = np.ascontiguousarray(list(path) + [0], dtype=np.int32)   # one spare: never empty
    allowed = np.zeros((len(path) + 1, vocab), dtype=np.uint8)
    complete = np.zeros(len(path) + 1, dtype=np.uint8)
    native.check(lib.tl_testing_grammar_masks(
        grammar._require_open(), ffi.from_buffer("int32_t[]", tokens), len(path), eos,
        ffi.from_buffer("uint8_t[]", allowed, require_writable=True),
        ffi.from_buffer("uint8_t[]", complete, require_writable=True)))
    return allowed.astype(bool), complete.astype(bool)


def reference_mask(matcher, vocab, done: bytes, eos=EOS) -> np.ndarray:
    ok = np.array([t != eos and bool(p) and matcher.viable_bytes(done + p) for t, p in enumerate(vocab)])
    ok[eos] = matcher.accepts_bytes(done)
    return ok


def pending(done: bytes) -> bool:
    split = ref_grammar.split_utf8(done)
    return split is not None and split[1] is not None


def walk_and_compare(grammar: Grammar, matcher, vocab, rng, steps: int):
    """A random path of tokens the reference allows (preferring ones that end inside a
    character), then the library's masks along it held to the reference's. Returns how
    many steps ended inside a character."""
    path, done, masks, inside = [], b"", [], 0
    for _ in range(steps + 1):
        ok = reference_mask(matcher, vocab, done)
        masks.append(ok)
        choices = [t for t in np.flatnonzero(ok) if t != EOS]
        if len(path) == steps or not choices:
            break
        cut = [t for t in choices if pending(done + vocab[t])]
        t = int(rng.choice(cut if cut and rng.random() < 0.5 else choices))
        path.append(t)
        done += vocab[t]
        inside += pending(done)
    allowed, complete = library_masks(grammar, path)
    done = b""
    for k, ok in enumerate(masks):
        differ = np.flatnonzero(allowed[k] != ok)
        assert not len(differ), (f"step {k} after {done!r}: the library allows "
                                 f"{[vocab[t] for t in differ if allowed[k][t]]}, the reference "
                                 f"{[vocab[t] for t in differ if ok[t]]}")
        assert complete[k] == matcher.complete_bytes(done), (k, done)
        if k < len(path):
            done += vocab[path[k]]
    return inside


HAND = [
    'root ::= "\\"" [^"]* "\\""',
    "root ::= [à-ÿ]+ \"!\"",
    'root ::= ( "café" | "\\u00e9\\U0001F600" | [\\u2600-\\u263f] ) " "?',
    "root ::= [^\\u0080-\\U0010FFFF]*",           # ASCII only
    "root ::= [\\x7f-\\u0800\\uffff-\\U00010000]+",  # the ends of the lengths
    "root ::= [^a\\u00e9-\\u00ff] [\\U0001F600-\\U0001F64F]?",
    "root ::= . . .",
]


@pytest.mark.parametrize("case", range(len(HAND) + 12))
def test_masks_equal_reference(model, case):
    """Along random token paths through each grammar, the library's mask at every step
    equals the reference's, EOS and completion included."""
    rng = np.random.default_rng(100 + case)
    gbnf = HAND[case] if case < len(HAND) else random_grammar(rng)
    vocab = random_vocabulary(rng)
    matcher = ref_grammar.Matcher(ref_grammar.parse(gbnf))
    inside = 0
    with Grammar(model, gbnf, token_bytes=vocab) as g:
        for _ in range(4):
            inside += walk_and_compare(g, matcher, vocab, rng, steps=10)
    if case < len(HAND) and case != 3:
        assert inside > 0, "no path ended inside a character: the test would check little"


def test_reference_prefixes_are_intervals():
    """The reference's premise, checked on every code point: the code points whose UTF-8
    begins with given bytes are an interval, which completions() finds; and the 1- and
    2-byte strings that begin no character are refused."""
    starts = {}
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        e = chr(cp).encode()
        for k in range(1, len(e)):
            lo_hi = starts.setdefault(e[:k], [cp, cp, 0])
            lo_hi[1] = cp
            lo_hi[2] += 1
    for prefix, (lo, hi, count) in starts.items():
        assert count == hi - lo + 1, prefix
        assert ref_grammar.completions(prefix) == (lo, hi), prefix
    for b in range(256):
        one = bytes([b])
        assert (ref_grammar.split_utf8(one) is not None) == (b < 0x80 or one in starts), one
        for c in range(256):
            two = one + bytes([c])
            whole = b >= 0xC0 and _decodes(two)
            valid = two in starts or whole or (b < 0x80 and (c < 0x80 or bytes([c]) in starts))
            assert (ref_grammar.split_utf8(two) is not None) == valid, two


def _decodes(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_eos_waits_for_the_character(text_model):
    """Tokens "a", "\\xc3", "\\xa9" (é cut in two) and EOS, EOS favoured by the bias: after
    "a" EOS may come; after "a\\xc3" only "\\xa9" fits, however EOS is favoured, and the
    grammar is complete only once é is whole."""
    eos = 257
    vocab = [b""] * text_model.info.vocab_size
    vocab[97], vocab[195], vocab[169] = b"a", b"\xc3", b"\xa9"
    with Grammar(text_model, 'root ::= "a" "é"?', token_bytes=vocab) as g:
        allowed, complete = library_masks(g, [97, 195, 169], eos=eos)
        assert [list(np.flatnonzero(a)) for a in allowed] == [[97], [195, eos], [169], [eos]]
        assert complete.tolist() == [False, False, False, True]
        r = text_model.generate("x", max_tokens=8, grammar=g, temperature=0.0,
                                logit_bias={195: 100.0, eos: 50.0})
        assert r.tokens == [97, 195, 169] and r.stop_reason == "eos" and r.text == "aé"
        # a character no token can finish: the text ends in a dead end inside it
        vocab[169] = b""
    with Grammar(text_model, 'root ::= "a" "é"?', token_bytes=vocab) as g:
        r = text_model.generate("x", max_tokens=8, grammar=g, temperature=0.0, logit_bias={195: 100.0})
        assert r.tokens == [97, 195] and r.stop_reason == "grammar"


def test_invalid_utf8_is_never_generated(text_model):
    """Every byte a token, the bias on every byte that is never a lead (continuation
    bytes, C0, C1, F5-FF) and on the leads whose second byte is narrowed (E0, ED, F0,
    F4): sampled generations under a grammar of any text are UTF-8 (but for a character
    cut by max_tokens) and use those leads; the library's masks along them equal the
    reference's."""
    bias = {b: 30.0 for b in [*range(0x80, 0xC2), *range(0xF5, 0x100), 0xE0, 0xED, 0xF0, 0xF4]}
    vocab = [bytes([b]) for b in range(256)] + [b"", b""]
    gbnf = "root ::= [^\\x00]*"
    matcher = ref_grammar.Matcher(ref_grammar.parse(gbnf))
    leads = set()
    with Grammar(text_model, gbnf) as g:
        for seed in range(4):
            r = text_model.generate("x", max_tokens=40, grammar=g, temperature=1.0, top_k=0, seed=seed,
                                    logit_bias=bias)
            data = bytes(r.tokens)
            codecs.getincrementaldecoder("utf-8")().decode(data, final=False)   # raises on bad UTF-8
            leads |= set(data) & {0xE0, 0xED, 0xF0, 0xF4}
            allowed, _ = library_masks(g, r.tokens, eos=257)
            for k in range(len(r.tokens) + 1):
                expected = reference_mask(matcher, vocab, data[:k], eos=257)
                assert (allowed[k] == expected).all(), (k, data[:k])
    assert leads == {0xE0, 0xED, 0xF0, 0xF4}, leads


def test_shipped_model_spells_split_characters(shipped):
    """SmolLM2's byte-level tokenizer cuts ☃ over three tokens and 😀 over two. Its own
    tokens of '"café ☃ 😀"' as a tiny vocabulary under a grammar of any JSON-like string:
    greedy copying of the prompt's line gives the string, token for token."""
    target = '"café ☃ 😀"'
    tok = shipped.tokenizer
    ids = tok.encode(target)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == target.encode()
    assert sum(not _decodes(p) for p in pieces) >= 4, pieces   # the test is about cut characters
    vocab = [b""] * shipped.info.vocab_size
    for t, p in zip(ids, pieces):
        vocab[t] = p
    prompt = "".join(f"{target}\n" for _ in range(4))
    with Grammar(shipped, 'root ::= "\\"" [^"]* "\\""', token_bytes=vocab) as g:
        r = shipped.generate(prompt, max_tokens=20, grammar=g, temperature=0.0)
        assert r.text == target and r.tokens == ids and r.stop_reason == "eos", (r.text, r.tokens)
        allowed, complete = library_masks(g, ids, eos=-1)
        for k in range(len(ids)):
            assert allowed[k][ids[k]], k
        assert complete[-1] and not complete[:-1].any()
