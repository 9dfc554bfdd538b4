"""Grammar-constrained generation (docs/api.md, "Grammars"): the GBNF parser (what it
accepts, what it refuses and where), the matcher on whole strings, and generation with
a grammar: greedy equals greedy over the masked logits replayed step by step (the mask
computed here independently, from the finite language the grammar spells), outputs are
sentences of the grammar (JSON parses), a fixed sentence comes out exactly, a dead end
stops with TL_STOP_GRAMMAR; on random models and on the shipped model."""

import json
import re

import numpy as np
import pytest

import textmodel
import tinyloop
from reference import sampling as reference
from sampling_hook import reference_tokens
from tinyloop.errors import InvalidArgumentError, TinyLoopError, UnsupportedError
from tinyloop.grammar import JSON_GBNF, JSON_OBJECT_GBNF, Grammar
from tinyloop.fileformat.random_model import make_random_model


# ---- the parser ------------------------------------------------------------------

@pytest.mark.parametrize("gbnf, where", [
    ('root ::= "abc', "line 1 column 10: unterminated string literal"),
    ('root ::= [a-z', "line 1 column 10: unterminated character class"),
    ('root ::= "a"\nitem ::= ( "b" | "c"', "line 2 column 21: expected ')'"),
    ('root ::= "a" )', "line 1 column 14: unexpected ')'"),
    ('root = "a"', "line 1 column 6: expected '::='"),
    ('root ::= "\\q"', "line 1 column 11: unknown escape"),
    ('root ::= "\\x4"', "expected a hexadecimal digit"),
    ('root ::= [z-a]', "end below its start"),
    ('root ::= @', "line 1 column 10: expected a string literal, a character class, a rule name"),
    ('root ::= "a"\n\nroot ::= "b"', "line 3 column 1: rule defined twice"),
    ('# a comment\nroot ::= item other\nitem ::= "x"', "line 2 column 15: rule 'other' is used but not defined"),
    ('item ::= "x"', "no rule 'root'"),
    ('root ::= root "a" | "b"', "rule 'root' is left-recursive"),
    ('root ::= a\na ::= b? a "x"\nb ::= "y"', "rule 'a' is left-recursive"),
    ('root ::= ("")* "a"', "left-recursive"),
    ('root ::= "\\uD800"', "line 1 column 11: escape of a code point that is not a character"),
    ('root ::= [a-\\U00110000]', "line 1 column 13: escape of a code point that is not a character"),
    ('root ::= "é€\\q"', "line 1 column 13: unknown escape"),   # columns count characters
])
def test_parser_refuses_with_the_position(text_model, gbnf, where):
    with pytest.raises(InvalidArgumentError, match="grammar: .*" + re.escape(where)):
        Grammar(text_model, gbnf)


# ---- the matcher on whole strings ---------------------------------------------------

MATCHES = [
    ('root ::= "a"+ "b"* "c"?', ["a", "aab", "aabbc", "ac"], ["", "b", "acc", "aba"]),
    ('root ::= [a-c0-9_]+ [^x]', ["a1_z", "__-"], ["a1x", "d1z", "a"]),
    ('root ::= [α-ω]+ "€"', ["αβ€", "ω€"], ["ab€", "αβ", "α€€"]),
    ('root ::= "\\n\\t\\"\\\\\\x41\\u00e9"', ['\n\t"\\Aé'], ['\n\t"\\A', "ntA"]),
    ('root ::= [\\]\\-\\\\]+', ["]-\\"], ["a", ""]),
    ('root ::= . "!"', ["x!", "€!"], ["!", "xy!"]),
    ('root ::= [à-ÿ]+ "\\u00e9" "\\U0001F600"?', ["àÿé", "ééé😀"], ["aé", "ā", "é😀😀", "é"]),
    ('root ::= [\\x7f-\\u0800\\uffff-\\U00010000]+', ["\x7f\u0800", "\uffff\U00010000ß"],
     ["\u0801", "~", "\U00010001"]),
    ('root ::= [^\\u0080-\\U0010FFFF]* "☃"', ["abc☃", "☃"], ["é☃", "☃☃"]),
    ('# a comment\nroot ::= item   # trailing\n  | "x" item\nitem ::= ( "a"\n    | "b" )\n',
     ["a", "b", "xa"], ["x", "ab", ""]),
    ('root ::= "(" root ")" | ""', ["", "()", "((()))"], ["(()", ")(", "(x)"]),
    ('root ::= ("ab" | "a") "b"', ["ab", "abb"], ["a", "abbb"]),
    ('root ::= x?\nx ::= "y"', ["", "y"], ["yy"]),
    (JSON_GBNF, ['{"a": 1}', '[1, 2.5e3, -0.5E-2, "x\\n", true, false, null]', '"\\u00e9"', "{}",
                 '{\n  "k": [ ]}', "[    1]", '"é"'],
     ['{"a" 1}', "  1", "[     1]", "01", '"\x01"', '"\\x"', "[1,]", "{'a': 1}", "tru", '{"a": 1}}']),
    (JSON_OBJECT_GBNF, ['{"a": {"b": []}}'], ["[]", "1", '"s"']),
]


@pytest.mark.parametrize("case", range(len(MATCHES)))
def test_matcher_accepts_and_refuses(text_model, case):
    gbnf, accepted, refused = MATCHES[case]
    with Grammar(text_model, gbnf) as g:
        for s in accepted:
            assert g.accepts(s), s
        for s in refused:
            assert not g.accepts(s), s


# ---- generation, the mask replayed ---------------------------------------------------

ANIMALS = ["cat", "dog", "cow", "élan"]
#: the finite language of ANIMAL_GBNF, spelled out
SENTENCES = {a + tail for a in ANIMALS for tail in
             ["", "."] + [" and " + b + end for b in ANIMALS for end in ("", ".")]}
ANIMAL_GBNF = 'root ::= animal (" and " animal)? "."?\nanimal ::= "cat" | "dog" | "cow" | "élan"'
EOS = 150
PIECES = [b"c", b"a", b"t", b"d", b"o", b"g", b"w", b" ", b"and", b" and ", b"an", b"d ", b".", b"cat", b"dog",
          b"co", b"ow", b"x", "é".encode(), b"", b" a", b"nd", b"ca", b"t.", b"g ", b"cow.", b"at", b"og",
          b" and c", b"\xa9", b"\xa9lan", b" \xc3", b"l", b"\xa9l", b"\xa9la", b"n", b"\xa9\xa9", b"\xc3\xa9l"]


def _vocabulary():
    """Token bytes for a 160-token random model: the pieces above spread over the ids
    (some hold part of the é of "élan"), a cut UTF-8 character, others that never fit,
    and EOS (no bytes)."""
    vocab = [f"q{i}".encode() for i in range(160)]
    for k, piece in enumerate(PIECES):
        vocab[(k * 37) % 149] = piece
    vocab[149] = b"\xc3"
    vocab[EOS] = b""
    return vocab


def _allowed(done: bytes, vocab) -> np.ndarray:
    """The independent mask: a token fits when some sentence's bytes start with the
    text's and then its."""
    ok = np.zeros(len(vocab), dtype=bool)
    for t, piece in enumerate(vocab):
        ok[t] = t != EOS and piece != b"" and any(x.encode().startswith(done + piece) for x in SENTENCES)
    ok[EOS] = done.decode("utf-8", errors="replace") in SENTENCES
    return ok


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "small.tinyloop"
    make_random_model(path, seed=5, vocab_size=160, d_model=64, n_head=4, n_kv_head=2, head_dim=16,
                      ffn_dim=128, n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=3,
                      max_seq_len=128, tied_embeddings=0)
    with tinyloop.Model(path, device="cpu", threads=1) as m:
        yield m


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("prompt_seed", range(6))
def test_generation_equals_masked_replay(small_model, sampled, prompt_seed):
    """Greedy (and sampled) generation with a grammar picks, at each step, the token
    the reference picks from that step's logits with the independent mask applied; it
    ends with EOS exactly when EOS wins or the sentence cannot go on."""
    vocab = _vocabulary()
    options = (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) if sampled else dict(temperature=0.0))
    seed = 3 + prompt_seed
    prompt = np.random.default_rng(prompt_seed).integers(0, 160, 8).tolist()
    with Grammar(small_model, ANIMAL_GBNF, token_bytes=vocab) as g:
        result = small_model.generate(prompt, max_tokens=30, eos=EOS, grammar=g, seed=seed, **options)
    tokens = result.tokens
    text = b"".join(vocab[t] for t in tokens).decode()
    assert result.stop_reason == "eos"
    assert text in SENTENCES
    with small_model.context() as replay:
        logits = replay.append(prompt)
        for k in range(len(tokens) + 1):
            done = b"".join(vocab[t] for t in tokens[:k])
            ok = _allowed(done, vocab)
            if k == len(tokens):   # the end: EOS was picked, or nothing but EOS could follow
                only_eos = ok.sum() == 1 and ok[EOS]
                if not only_eos:
                    masked = np.where(ok, logits, -np.inf).astype(np.float32)
                    picked = reference_tokens(reference, [masked], options, history=prompt + tokens,
                                              seed=seed, first_step=k)[0]
                    assert picked == EOS
                break
            masked = np.where(ok, logits, -np.inf).astype(np.float32)
            expected = reference_tokens(reference, [masked], options, history=prompt + tokens[:k],
                                        seed=seed, first_step=k)[0]
            assert tokens[k] == expected, f"step {k}"
            logits = replay.append([tokens[k]])


def test_fixed_sentence_comes_out_exactly(text_model):
    with Grammar(text_model, 'root ::= "hello, world"') as g:
        for options in (dict(temperature=0.0), dict(temperature=1.5, top_k=0, seed=4)):
            r = text_model.generate("x", max_tokens=40, grammar=g, **options)
            assert r.text == "hello, world"
            assert r.stop_reason == "eos"


def test_split_characters_and_dead_ends(text_model):
    """Each token is one byte: "é" comes out of two tokens. A class that takes nothing is
    a dead end, after "a" or at once."""
    with Grammar(text_model, 'root ::= "a" "é"') as g:
        r = text_model.generate("x", max_tokens=10, grammar=g, temperature=0.0)
    assert r.tokens == [ord("a"), 0xC3, 0xA9] and r.text == "aé" and r.stop_reason == "eos"
    with Grammar(text_model, 'root ::= "a" [^\\x00-\\U0010FFFF]') as g:
        r = text_model.generate("x", max_tokens=10, grammar=g, temperature=0.0)
    assert r.tokens == [ord("a")] and r.stop_reason == "grammar"
    with Grammar(text_model, 'root ::= [^\\x00-\\U0010FFFF]') as g:
        r = text_model.generate("x", max_tokens=10, grammar=g)
    assert r.tokens == [] and r.stop_reason == "grammar"


def test_json_generations_parse(text_model):
    """Sampled JSON on a random model: every generation that the grammar ended parses,
    and the grammar never dead-ends (every ASCII byte is a token)."""
    ended = 0
    with Grammar(text_model, JSON_GBNF) as g:
        for seed in range(12):
            r = text_model.generate("{", max_tokens=60, grammar=g, temperature=1.5, top_k=0, top_p=1.0,
                                    min_p=0.0, seed=seed)
            assert r.stop_reason in ("eos", "max_tokens"), r
            if r.stop_reason == "eos":
                json.loads(r.text)
                assert g.accepts(r.text)
                ended += 1
            stream = list(text_model.stream("{", max_tokens=60, grammar=g, temperature=1.5, top_k=0,
                                            top_p=1.0, min_p=0.0, seed=seed))
            assert stream == r.tokens
    assert ended >= 3, "too few generations ended: the test would check little"


def test_grammar_errors(text_model, small_model):
    with Grammar(text_model, 'root ::= "a"') as g:
        with pytest.raises(UnsupportedError, match="draft_depth"):
            text_model.generate("x", grammar=g, draft_depth=1)
        with pytest.raises(TypeError, match="Grammar of this model"):
            small_model.generate([1], grammar=g)
    with pytest.raises(TinyLoopError, match="closed"):
        text_model.generate("x", grammar=g)
    # a running stream holds the grammar: closing it early changes nothing
    g = Grammar(text_model, 'root ::= "abcdef"')
    stream = text_model.stream("x", max_tokens=20, grammar=g)
    first = next(stream)
    g.close()
    assert bytes([first] + list(stream)) == b"abcdef"

    with pytest.raises(ValueError, match="token_bytes has 3 entries"):
        Grammar(text_model, 'root ::= "a"', token_bytes=[b"a", b"b", b"c"])
    with pytest.raises(TypeError):
        Grammar(text_model, b'root ::= "a"')


# ---- the shipped model -----------------------------------------------------------------

def test_shipped_model_json(shipped):
    """The shipped model (49,152 tokens) answers in JSON: greedy and sampled generations
    that the grammar ended parse as JSON objects."""
    prompt = "A JSON object describing a cat, with its name and age:\n"
    with Grammar(shipped, JSON_OBJECT_GBNF) as g:
        for options in (dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=2)):
            r = shipped.generate(prompt, max_tokens=48, grammar=g, **options)
            assert r.stop_reason in ("eos", "max_tokens")
            if r.stop_reason == "eos":
                assert isinstance(json.loads(r.text), dict)
        r = shipped.generate(prompt, max_tokens=48, grammar=g, temperature=0.0)
        assert r.stop_reason == "eos", r.text
        assert isinstance(json.loads(r.text), dict)


# ---- the server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(paths):
    from serving import Running
    running = [Running(paths[0]), Running(paths[1])]
    yield running
    for r in running:
        r.close()


JSON_OBJECT = {"type": "json_object"}


def test_server_json_object(servers):
    """response_format json_object: completions and chat answers that the grammar ended
    parse as JSON objects (finish_reason "stop"), streamed ones too."""
    plain, chat = servers
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    stopped = 0
    for seed in range(6):
        body = {"prompt": "{", "max_tokens": 40, "temperature": 1.5, "seed": seed, "response_format": JSON_OBJECT}
        status, reply = plain.post("/v1/completions", body)
        assert status == 200, reply
        choice = reply["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
            stopped += 1
        events = plain.events("/v1/completions", dict(body, stream=True))
        assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
        status, reply = chat.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "json please"}], "max_tokens": 40, "temperature": 1.5,
            "seed": seed, "response_format": JSON_OBJECT})
        assert status == 200, reply
        choice = reply["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
            stopped += 1
    assert stopped >= 3, "too few answers ended: the test would check little"


def test_server_grammar_field(servers):
    plain, _ = servers
    status, reply = plain.post("/v1/completions", {"prompt": "x", "max_tokens": 20,
                                                   "grammar": 'root ::= "yes" | "no"'})
    assert status == 200, reply
    assert reply["choices"][0]["text"] in ("yes", "no")
    assert reply["choices"][0]["finish_reason"] == "stop"
    status, reply = plain.post("/v1/completions", {"prompt": "x", "max_tokens": 20, "grammar": 'root ::= "é"'})
    assert status == 200 and reply["choices"][0]["text"] == "é"   # two byte tokens
    assert reply["choices"][0]["finish_reason"] == "stop"
    status, reply = plain.post("/v1/completions", {"prompt": "x", "max_tokens": 20,
                                                   "grammar": 'root ::= [^\\x00-\\U0010FFFF]'})
    assert status == 200 and reply["choices"][0]["text"] == ""
    assert reply["choices"][0]["finish_reason"] == "stop"   # a dead end
    body = {"prompt": "x", "max_tokens": 5, "temperature": 0}
    assert (plain.post("/v1/completions", dict(body, response_format={"type": "text"}))[1]["choices"][0]["text"]
            == plain.post("/v1/completions", body)[1]["choices"][0]["text"])


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"response_format": "json"}, "response_format", "must be"),
    ({"grammar": 5}, "grammar", "GBNF"),
    ({"grammar": 'root ::= "a'}, "grammar", "line 1 column 10: unterminated string literal"),
    ({"grammar": 'root ::= "a"', "response_format": JSON_OBJECT}, "grammar", "exclude each other"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "grammar", "exclude each other"),
    ({"grammar": 'root ::= "a"', "draft_depth": 1}, None, "speculative"),
])
def test_server_grammar_errors(servers, extra, param, words):
    plain, _ = servers
    status, reply = plain.post("/v1/completions", dict({"prompt": "x"}, **extra))
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply


# ---- against the independent reference matcher (tests/reference/grammar.py) --------------

from reference import grammar as ref_grammar  # noqa: E402

EXTRA = [
    ('root ::= ( "ab" | "a" "b"? )* "c"', []),
    ('root ::= item ( "," item )*\nitem ::= [0-9]+ | "-" [0-9]+ | "(" root ")"', []),
    ('root ::= "x" ( [a-c] [^a] )? "y"?', []),
]


@pytest.mark.parametrize("case", range(len(MATCHES) + len(EXTRA)))
def test_matcher_equals_reference_on_random_strings(text_model, case):
    """Whole strings drawn from the characters the grammar's examples use: the library
    and the reference agree on every one (and the reference on the hand-written cases)."""
    if case < len(MATCHES):
        gbnf, accepted, refused = MATCHES[case]
    else:
        (gbnf, _), accepted, refused = EXTRA[case - len(MATCHES)], [], []
    reference_matcher = ref_grammar.Matcher(ref_grammar.parse(gbnf))
    for s in accepted:
        assert reference_matcher.accepts(s), s
    for s in refused:
        assert not reference_matcher.accepts(s), s
    alphabet = sorted(set("".join(accepted + refused) + "".join(c for c in gbnf if c.isprintable())) - {"\\"})
    rng = np.random.default_rng(case)
    strings = accepted + refused + ["".join(rng.choice(alphabet, size=n)) for n in rng.integers(0, 9, 400)]
    with Grammar(text_model, gbnf) as g:
        disagree = [s for s in strings if g.accepts(s) != reference_matcher.accepts(s)]
    assert not disagree, disagree[:5]
    assert any(reference_matcher.accepts(s) for s in strings)


#: strings of any characters, and non-ASCII classes over characters of 2, 3 and 4 bytes
REPLAYED = [JSON_GBNF, 'root ::= "\\"" [^"]* "\\""', 'root ::= ( [à-ÿ] | [☀-☃] | [😀-🙏] | " " )+ "."']


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("prompt_text, gbnf", [("{", JSON_GBNF), ("x", JSON_GBNF), ('"', REPLAYED[1]),
                                               ("x", REPLAYED[2])])
def test_generation_follows_the_reference_mask(text_model, sampled, prompt_text, gbnf):
    """Generations on the byte-level model (every byte a token, so every non-ASCII
    character is cut over tokens), replayed: each step's token is the sampling
    reference's pick over the logits masked by the reference matcher (a byte fits when
    the bytes so far and it can still begin a sentence, also inside a character; EOS
    when the text is one)."""
    matcher = ref_grammar.Matcher(ref_grammar.parse(gbnf))
    options = (dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0) if sampled else dict(temperature=0.0))
    prompt = text_model.tokenizer.encode(prompt_text)   # objects, strings, numbers with exponents
    seed = 2
    with Grammar(text_model, gbnf) as g:
        r = text_model.generate(prompt, max_tokens=20, grammar=g, seed=seed, **options)
    tokens = r.tokens
    if sampled and gbnf != JSON_GBNF:
        assert max(tokens) >= 0xC0, "no character of several bytes: the test would check little"

    def mask(done):
        ok = np.zeros(textmodel.VOCAB, dtype=bool)
        for b in range(256):
            ok[b] = matcher.viable_bytes(done + bytes([b]))
        ok[textmodel.EOS] = matcher.accepts_bytes(done)
        return ok

    with text_model.context() as replay:
        logits = replay.append(prompt)
        for k in range(len(tokens) + (r.stop_reason == "eos")):
            done = bytes(tokens[:k])
            if k == len(tokens) and matcher.complete_bytes(done):
                break   # the library stops without a step: nothing else could follow
            masked = np.where(mask(done), logits, -np.inf).astype(np.float32)
            expected = reference_tokens(reference, [masked], options, history=prompt + tokens[:k],
                                        seed=seed, first_step=k)[0]
            assert (tokens[k] if k < len(tokens) else textmodel.EOS) == expected, f"step {k}: {done!r}"
            if k < len(tokens):
                logits = replay.append([tokens[k]])
    if r.stop_reason == "eos":
        text = bytes(tokens).decode()
        assert matcher.accepts(text)
        if gbnf == JSON_GBNF:
            json.loads(text)


def test_one_grammar_serves_threads(text_model):
    """A grammar is immutable: generations on four threads at once, each on a context of
    its own, equal the same generations one after another."""
    import threading
    with Grammar(text_model, JSON_GBNF) as g:
        def run(seed):
            with text_model.context() as ctx:
                return ctx.generate("{", max_tokens=24, grammar=g, temperature=1.3, top_k=0, seed=seed).tokens
        serial = [run(seed) for seed in range(4)]
        results = [None] * 4

        def worker(i):
            results[i] = run(i)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == serial
    assert len({tuple(r) for r in serial}) > 1
