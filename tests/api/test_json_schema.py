"""JSON Schema to GBNF (python/tinyloop/json_schema.py; docs/python.md, "JSON schemas"):
documents in the grammar's subset are accepted and documents the schema refuses are not,
every sampled generation a grammar completes validates (an independent validator,
fastjsonschema, judges), unsupported keywords are refused by name, and the server's
response_format json_schema gives valid answers."""

import ipaddress
import json
import math
import random
import re
from fractions import Fraction

import pytest

import tinyloop
from tinyloop.grammar import Grammar
from tinyloop.grammar.json_schema import SchemaError, json_schema_to_gbnf

fastjsonschema = pytest.importorskip("fastjsonschema", reason="the independent validator")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}

# (schema, documents the grammar must accept, documents the schema refuses[, documents
# the schema accepts that lie outside the grammar's subset[, False: left out of the
# sampled generations, since a random model seldom closes such a string]])
CASES = [
    (PERSON,
     ['{"name": "Al", "tags": []}', '{"name":"Al","age":0,"email":"x","tags":["a",3, null]}',
      '{"name": "é€", "age": 12, "tags": ["b"]}', '{"name": "\\n\\u00e9", "tags": []}'],
     ['{"tags": []}', '{"name": "", "tags": []}', '{"name": "abcdefghi", "tags": []}',
      '{"name": "Al", "tags": ["c"]}', '{"name": "Al", "age": -1, "tags": []}',
      '{"name": "Al", "age": 1.5, "tags": []}', '{"name": "Al", "tags": [1, 2, 3, 4]}',
      '{"name": "Al", "tags": [], "x": 1}', '{"name": "Al"}', '[]', '"Al"']),
    ({"type": "array", "items": {"type": "number", "minimum": 0}, "minItems": 2, "maxItems": 4},
     ["[0, 1.5]", "[1e3, 2, 3.25E-2, 0]"], ["[1]", "[1, 2, 3, 4, 5]", "[-1, 2]", '[1, "2"]']),
    ({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"const": "none"}, {"type": "null"}]},
     ["1", "42", '"none"', "null"], ["0", "-3", '"some"', "1.5", "true"]),
    ({"type": ["string", "boolean"], "maxLength": 2}, ['"ab"', "true", "false", '""'],
     ['"abc"', "1", "null"]),
    ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}},
      "$ref": "#/$defs/node"},
     ['{"v": 1}', '{"v": -2, "kids": [{"v": 3}, {"v": 4, "kids": []}]}'],
     ['{"kids": []}', '{"v": 1, "kids": [{"w": 1}]}', '{"v": "1"}']),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                {"properties": {"b": {"type": "null"}}, "required": ["b"]}]},
     ['{"a": true, "b": null}'], ['{"a": true}', '{"b": null}', '{"a": 1, "b": null}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}},
     ['{}', '{"x": 1, "y": -2}'], ['{"x": "1"}', '[]']),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                       "at": {"type": "string", "format": "date-time"},
                                       "id": {"type": "string", "format": "uuid"}},
      "additionalProperties": False},
     ['{"when": "2024-02-28"}', '{"at": "2024-12-31T23:59:59.123+05:30"}',
      '{"id": "123e4567-e89b-12d3-a456-426614174000"}', '{}'],
     ['{"when": "2024-02-30"}', '{"when": "2024-13-01"}', '{"at": "2024-12-31 23:59:59"}']),
    ({"type": "array", "items": [{"type": "string", "maxLength": 1}, {"type": "integer"}]},
     ['["a", 1]'], ['[1, "a"]', '["ab", 1]']),
    ({"enum": [{"k": [1, 2]}, "x\"y", 1.5]}, ['{"k":[1,2]}', '"x\\"y"', "1.5"], ['{"k": [2, 1]}', '"xy"']),
    # integer ranges: every combination of bounds, negative, large and draft-4 forms
    ({"type": "integer", "minimum": -12, "maximum": 305},
     ["-12", "-1", "0", "7", "99", "100", "305"], ["-13", "306", "1000", "-100", "1.5", '"5"'], ["-0"]),
    ({"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}, ["-4", "0", "4"], ["-5", "5", "-50"]),
    ({"type": "integer", "minimum": 2.5, "exclusiveMaximum": 7.5, "exclusiveMinimum": 2}, ["3", "7"], ["2", "8"]),
    ({"type": "integer", "minimum": 10 ** 18, "maximum": 10 ** 18 + 50},
     [str(10 ** 18 + 7), str(10 ** 18 + 50)], [str(10 ** 18 - 1), str(10 ** 18 + 51), "0"]),
    ({"type": "integer", "maximum": -1000}, ["-1000", "-123456789012"], ["-999", "0", "5"]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
      "minimum": 10, "exclusiveMinimum": True, "maximum": 20, "exclusiveMaximum": False},
     ["11", "20"], ["10", "21"]),
    # bounded numbers: no exponent, no negative zero
    ({"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25},
     ["-1.5", "-1.25", "-0.5", "0", "2", "2.2499", "1.0000000000000000"], ["-1.51", "2.25", "3", "-2"],
     ["1e0", "-0.0"]),
    ({"type": "number", "exclusiveMinimum": 0.1, "maximum": 0.3},
     ["0.2", "0.3", "0.1000000000000001", "0.29999"], ["0.1", "0.3000000000000001", "0", "1"]),
    ({"type": "array", "items": {"type": "number", "exclusiveMinimum": -1, "maximum": 0}, "maxItems": 3},
     ["[-0.5, 0, -0.999]"], ["[-1]", "[0.5]"]),
    # patterns: anchored, unanchored, alternatives of both, JSON escapes, sets
    ({"type": "string", "pattern": "^[A-Z]{2,3}-\\d{4}$"}, ['"AB-1234"', '"XYZ-0000"'],
     ['"AB-123"', '"ABCD-1234"', '"ab-1234"', '"AB-12345"', '" AB-1234"', '"AB-1234\\n"']),
    ({"pattern": "c[ao]t"}, ['"cat"', '"a cot!"', '"concat"', '"\\n\\u00e9cat"'], ['"ct"', '"cut"', '""'], [], False),
    ({"type": "string", "pattern": "^ab|cd$|^x$"}, ['"abz"', '"zcd"', '"x"', '"ab"'],
     ['"zab"', '"cdz"', '"xx"', '""'], [], False),
    ({"type": "string", "pattern": '^a"b\\\\c\\n(?:\\t|\\u0001)$'}, ['"a\\"b\\\\c\\n\\t"', '"a\\"b\\\\c\\n\\u0001"'],
     ['"a\\"b\\\\c\\n"', '"a\\"b\\\\c"']),
    ({"type": "string", "pattern": "^[^@\\s]+@[^@\\s]+\\.[a-z]{2,}$"},
     ['"a@b.io"', '"jo.smith@example.com"', '"\u00e9@x.fr"'], ['"a b@c.de"', '"a@b.c"', '"@b.cd"', '"a@@b.cd"'],
     [], False),
    ({"type": "string", "pattern": "^a.b$"}, ['"axb"', '"a b"', '"a\u00e9b"', '"a\\tb"'], ['"a\\nb"', '"ab"'],
     ['"a\\rb"', '"a\U0001F600b"']),                           # ECMA's . leaves out \r; one BMP character
    ({"type": "string", "pattern": "^\\W\\w(?:[^\\d]|\\D)\\S\\s$"}, ['"-a_x "', '"\\n9.!\\t"'],
     ['"aa_x "', '"-a9x "', '"-a_  "'], ['"\u20aca_x "', '"-\u00e9_x "']),   # ASCII \W, \w and \D
    ({"type": "string", "pattern": "^(?:yes|no)(?: [0-9]{1,2})?$", "minLength": 2, "maxLength": 6},
     ['"yes"', '"no 42"', '"no 7"'], ['"maybe"', '"yes 123"', '"yes "']),
    # formats written exactly, uniqueItems false
    ({"type": "string", "format": "ipv4"}, ['"192.168.0.1"', '"0.0.0.0"', '"255.255.255.255"'],
     ['"256.1.1.1"', '"01.2.3.4"', '"1.2.3"', '"1.2.3.4."']),
    ({"type": "string", "format": "ipv6"},
     ['"::1"', '"2001:db8::8a2e:370:7334"', '"::ffff:192.0.2.128"', '"1:2:3:4:5:6:7:8"', '"::"'],
     ['"1:2:3:4:5:6:7:8:9"', '"1::2::3"', '"12345::"', '":1"', '"::ffff:192.0.2.256"']),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": False, "maxItems": 3},
     ["[1, 1]", "[]", "[0, 3, 3]"], ["[4]", "[1, 2, 3, 0]", "[-1]"]),
    (True, ['{"a": [1, {"b": null}]}', '"s"'], []),
]


def _validator(schema):
    return fastjsonschema.compile(schema if isinstance(schema, dict) else {})


def _valid(validate, text) -> bool:
    try:
        validate(json.loads(text))
        return True
    except (ValueError, fastjsonschema.JsonSchemaException):
        return False


@pytest.mark.parametrize("case", range(len(CASES)))
def test_grammar_accepts_valid_and_refuses_invalid(text_model, case):
    schema, accepted, refused, outside = (CASES[case] + ([],))[:4]
    validate = _validator(schema)
    with Grammar(text_model, json_schema_to_gbnf(schema)) as g:
        for text in accepted:
            assert _valid(validate, text), f"test data: {text!r} should be valid"
            assert g.accepts(text), text
        for text in refused:
            assert not _valid(validate, text), f"test data: {text!r} should be invalid"
            assert not g.accepts(text), text
        for text in outside:
            assert _valid(validate, text), f"test data: {text!r} should be valid"
            assert not g.accepts(text), text


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0] is not True and c[4:5] != (False,)])
def test_sampled_generations_validate(text_model, case):
    """Random-model generations under the schema's grammar (temperature 1.5 over every
    byte): each one the grammar completed validates."""
    schema = CASES[case][0]
    validate = _validator(schema)
    ended = 0
    with Grammar(text_model, json_schema_to_gbnf(schema)) as g:
        for seed in range(10):
            r = text_model.generate("", max_tokens=160, grammar=g, temperature=1.5, top_k=0, top_p=1.0,
                                    min_p=0.0, seed=seed)
            assert r.stop_reason in ("eos", "max_tokens", "context_full"), r
            if r.stop_reason == "eos":
                assert _valid(validate, r.text), r.text
                ended += 1
    assert ended >= 2, "too few generations ended: the test would check little"


def test_non_ascii_strings_validate(text_model):
    """Strings of characters cut over the byte-level model's tokens: a name of 2 to 4
    characters (leads of 2-, 3- and 4-byte characters favoured) and an enum of non-ASCII
    words; every generation the grammar completed validates, lengths counted in
    characters, and names hold characters of every length."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 4},
        "city": {"enum": ["Zürich", "東京", "🏔"]}},
        "required": ["name", "city"], "additionalProperties": False}
    validate = _validator(schema)
    lengths = set()
    with Grammar.from_json_schema(text_model, schema) as g:
        assert g.accepts('{"name": "çé☃😀", "city": "東京"}') and not g.accepts('{"name": "çé☃😀!", "city": "東京"}')
        for seed in range(8):
            r = text_model.generate("", max_tokens=80, grammar=g, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                    seed=seed, logit_bias={0xC3: 4.0, 0xE2: 4.0, 0xF0: 4.0})
            if r.stop_reason == "eos":
                assert _valid(validate, r.text), r.text
                lengths |= {len(c.encode()) for c in json.loads(r.text)["name"]}
    assert {2, 3, 4} <= lengths, lengths


@pytest.mark.parametrize("schema, where", [
    ({"type": "array", "uniqueItems": True}, "/uniqueItems: only false"),
    ({"type": "number", "multipleOf": 2}, "/multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "/properties/a/format"),
    ({"type": "string", "format": "hostname"}, "/format: 'hostname' is not supported"),
    ({"type": "string", "maxLength": 10**6}, "/maxLength: 1000000 is above"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "/maxLength: 2 is below minLength 3"),
    ({"type": "bogus"}, "/type: unknown type 'bogus'"),
    ({"$ref": "https://example.com/s.json"}, "/$ref: only references inside the schema"),
    ({"$ref": "#/$defs/missing"}, "points nowhere"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}, "no object fits"),
    (False, "accepts no value"),
    ({"not": {"type": "null"}}, "/not"),
    ({"enum": []}, "/enum: must be a non-empty list"),
    ("{not json", "not valid JSON"),
    # numeric bounds
    ({"type": "integer", "minimum": 5, "maximum": 3}, "/maximum: no integer lies between the bounds"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "/exclusiveMaximum: no integer"),
    ({"type": "integer", "exclusiveMinimum": True}, "/exclusiveMinimum: true needs minimum"),
    ({"type": "integer", "maximum": "3"}, "/maximum: must be a number"),
    ({"type": "integer", "minimum": 10 ** 150}, "/minimum: more than 100 digits"),
    ({"type": "integer", "maximum": -(10 ** 400)}, "/maximum: more than 100 digits"),
    ({"type": "number", "maximum": 10 ** 5000}, "/maximum: 1.000000e+5000 is not exactly a double"),
    ({"type": "integer", "minimum": 10 ** 5000}, "/minimum: more than 100 digits"),
    ({"type": "number", "minimum": float("inf")}, "/minimum: must be a number"),
    ({"type": "number", "minimum": 2 ** 53 + 1}, "/minimum: 9007199254740993 is not exactly a double"),
    ({"type": "number", "minimum": 1e20}, "/minimum: outside the numbers the grammar writes"),
    ({"type": "number", "minimum": 1e-20, "maximum": 2e-20}, "with at most 16 digits after the point"),
    # patterns: what the subset leaves out, and length bounds it does not imply
    ({"type": "string", "pattern": "(?=a)b"}, "/pattern: lookahead (at offset 0) is not supported"),
    ({"type": "string", "pattern": "(?<!a)b"}, "/pattern: lookbehind"),
    ({"type": "string", "pattern": "(a)\\1"}, "/pattern: the backreference \\1 (at offset 3)"),
    ({"type": "string", "pattern": "\\bword"}, "/pattern: the word boundary \\b"),
    ({"type": "string", "pattern": "(?<n>a)"}, "/pattern: a named group"),
    ({"type": "string", "pattern": "(?i)a"}, "/pattern: a group with flags"),
    # nested counts multiply the matcher's work: refused past 1000 copies of one atom
    ({"type": "string", "pattern": "^(a{0,1000}){0,1000}$"}, "nested repetitions that allow 1000000 copies"),
    ({"type": "string", "pattern": "^x((ab){0,40}c){0,30}$"}, "allow 1200 copies"),
    ({"type": "string", "pattern": "\\p{L}"}, "/pattern: Unicode property escapes"),
    ({"type": "string", "pattern": "\\q"}, "/pattern: the escape \\q"),
    ({"type": "string", "pattern": "\\01"}, "/pattern: an octal escape"),
    ({"type": "string", "pattern": "a[]"}, "/pattern: an empty class"),
    ({"type": "string", "pattern": "[\\w-z]"}, "/pattern: a range with a class escape"),
    ({"type": "string", "pattern": "[a[]"}, "/pattern: a '[' inside a class"),
    ({"type": "string", "pattern": "[a--]"}, "/pattern: '--' inside a class"),
    ({"type": "string", "pattern": "[z-a]"}, "/pattern: the range at offset 1 is out of order"),
    ({"type": "string", "pattern": "a{,3}"}, "/pattern: a '{' that starts no quantifier"),
    ({"type": "string", "pattern": "a{3,2}"}, "/pattern: {3,2} (at offset 1): the counts are out of order"),
    ({"type": "string", "pattern": "a{1001}"}, "/pattern: a count above 1000"),
    ({"type": "string", "pattern": "a**"}, "/pattern: a quantifier after a quantifier"),
    ({"type": "string", "pattern": "*a"}, "/pattern: a quantifier with nothing to repeat"),
    ({"type": "string", "pattern": "^*a"}, "/pattern: a quantifier on the anchor ^"),
    ({"type": "string", "pattern": "(a"}, "/pattern: a '(' without its ')'"),
    ({"type": "string", "pattern": "a)"}, "/pattern: an unmatched ')'"),
    ({"type": "string", "pattern": "[a"}, "/pattern: a '[' without its ']'"),
    ({"type": "string", "pattern": "a\\"}, "/pattern: a '\\' that ends the pattern"),
    ({"type": "string", "pattern": "\U0001F600"}, "/pattern: the character U+1F600"),
    ({"type": "string", "pattern": "\\ud83d"}, "/pattern: the character U+D83D"),
    ({"type": "string", "pattern": "^a$b"}, "/pattern: no string the grammar can write matches it"),
    ({"type": "string", "pattern": 5}, "/pattern: must be a string"),
    ({"type": "string", "pattern": "^a", "format": "date"}, "/pattern: not supported together with format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "/maxLength: not supported together with pattern"),
    ({"type": "string", "pattern": "^a{2}$", "minLength": 3}, "/minLength: not supported together with pattern"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "which matches any number of characters"),
])
def test_unsupported_keywords_are_refused(schema, where):
    with pytest.raises(SchemaError, match=re.escape(where)):
        json_schema_to_gbnf(schema)


# ---- random integer ranges, number ranges and patterns -------------------------------

_BOUND_KEYS = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]


def _integer_extent(schema):
    """The smallest and largest integer the schema's bounds admit (None: unbounded)."""
    lo = [math.ceil(Fraction(v)) for k, v in schema.items() if k == "minimum"]
    lo += [math.floor(Fraction(v)) + 1 for k, v in schema.items() if k == "exclusiveMinimum"]
    hi = [math.floor(Fraction(v)) for k, v in schema.items() if k == "maximum"]
    hi += [math.ceil(Fraction(v)) - 1 for k, v in schema.items() if k == "exclusiveMaximum"]
    return max(lo, default=None), min(hi, default=None)


def test_random_integer_ranges(text_model):
    """Random bounds (any combination, negative, single values, up to 30 digits, some not
    integers): on integers around each bound and at the digit limits the grammar accepts
    exactly what fastjsonschema does, within the integers of 16 digits (or of as many as
    the admitted integer nearest zero has)."""
    rnd = random.Random(11)
    checked = accepted = 0
    for _ in range(70):
        scale = 10 ** rnd.choice([0, 1, 2, 3, 6, 15, 16, 17, 25, 30])
        centre = rnd.randint(-scale, scale)
        schema = {"type": "integer"}
        for key in rnd.sample(_BOUND_KEYS, rnd.randint(1, 4)):
            b = centre + rnd.randint(-scale // 4 - 2, scale // 4 + 2)
            schema[key] = b if rnd.random() < 0.8 or abs(b) > 10 ** 15 else b + 0.5
        if rnd.random() < 0.1:
            schema = {"type": "integer", "minimum": centre, "maximum": centre}
        lo, hi = _integer_extent(schema)
        if lo is not None and hi is not None and lo > hi:
            with pytest.raises(SchemaError, match="no integer lies between the bounds"):
                json_schema_to_gbnf(schema)
            continue
        nearest = lo if lo is not None and lo > 0 else -hi if hi is not None and hi < 0 else 0
        digits = max(16, len(str(nearest)))
        validate = _validator(schema)
        candidates = {0, 1, -1, 9, -9, 10, 10 ** 15, 10 ** 16 - 1, 10 ** 16, -(10 ** 16 - 1), -(10 ** 16)}
        for b in (v for k, v in schema.items() if k != "type"):
            candidates |= {int(b) + d for d in (-1000, -100, -10, -3, -2, -1, 0, 1, 2, 3, 10, 100, 1000, scale, -scale)}
        with Grammar(text_model, json_schema_to_gbnf(schema)) as g:
            for x in sorted(candidates):
                want = _valid(validate, str(x)) and len(str(abs(x))) <= digits
                assert g.accepts(str(x)) == want, (schema, x)
                checked += 1
                accepted += want
            assert not g.accepts("-0") and not g.accepts("01") and not g.accepts("1.0")
    assert checked > 1000 and accepted > 200, (checked, accepted)


def test_random_number_ranges(text_model):
    """Random bounds on numbers (integers, decimals, doubles with no short binary value
    such as 0.1, strict or not): no text the grammar accepts is invalid, and every valid
    text without an exponent or a negative zero, of 12 digits or fewer after the point
    (further from a bound than a double's rounding reaches), is accepted."""
    rnd = random.Random(12)
    checked = accepted = 0

    def bound():
        k = rnd.random()
        return (rnd.randint(-300, 300) if k < 0.3 else round(rnd.uniform(-50, 50), rnd.randint(0, 3)) if k < 0.6
                else rnd.choice([0.1, 0.2, -0.3, 2.675, 1e-5, -1.5, 0.5, 1000.1, 0, 0.0]))
    for _ in range(60):
        schema = {"type": "number"}
        for key in rnd.sample(_BOUND_KEYS, rnd.randint(1, 3)):
            schema[key] = bound()
        validate = _validator(schema)
        try:
            gbnf = json_schema_to_gbnf(schema)
        except SchemaError as e:         # only bounds that leave no number
            assert "no number lies between the bounds" in str(e), (schema, e)
            assert not any(_valid(validate, t) for t in ("0", "-1", "1", "0.5", "-0.5", "100", "-100")), schema
            continue
        texts = {"0", "-0", "-0.0", "1", "-1", "1e2"}
        for b in (v for k, v in schema.items() if k != "type"):
            for d in (0, 1e-12, 1e-9, 0.001, 0.5, 1, 3):
                for x in (b - d, b + d):
                    texts |= {f"{x:.0f}", f"{x:.1f}", f"{x:.3f}", f"{x:.12f}", f"{x:.16f}", repr(float(x))}
        with Grammar(text_model, gbnf) as g:
            for t in sorted(texts):
                ok, got = _valid(validate, t), g.accepts(t)
                assert ok or not got, (schema, t)
                plain = "e" not in t.lower() and not (t.startswith("-") and float(t) == 0)
                if ok and plain and len(t.partition(".")[2]) <= 12:
                    assert got, (schema, t)
                checked += 1
                accepted += got
    assert checked > 1500 and accepted > 500, (checked, accepted)


# Pattern pieces: (ECMA text, a sampler of a string it matches). The strings tried are
# over an alphabet on which ECMA-262 and Python's re agree for every piece (no \r, no
# \x1c-\x1f, ASCII only); $ is \Z to Python (as fastjsonschema writes it).
_ALPHABET = "abc1 -._\n\t\"\\"
_PIECES = [
    ("a", "a"), ("b", "b"), ("c", "c"), ("-", "-"), (" ", " "), ("\\.", "."), ("\\\\", "\\"), ('"', '"'),
    ("\\n", "\n"), ("\\t", "\t"), ("[a-c]", "abc"), ("[^ab]", "c1 -._\n\t\"\\"), ("[\\d.]", "1."), ("\\d", "1"),
    ("\\w", "abc1_"), ("\\s", " \n\t"), ("\\W", " -.\n\"\\"), ("\\D", "ab -"), ("\\S", "ab1-."),
    (".", "abc1 -._\t\"\\"), ("[^\\s]", "ab."), ("[^\\w-]", " .\n"), ("[\\s\\-a]", " -a"), ("\\x61", "a"),
    ("\\u0062", "b"),
]


def _random_pattern(rnd, depth):
    """(pattern text, sampler, kind): kind "atom" may take a quantifier as it is."""
    k = rnd.random()
    if depth <= 0 or k < 0.35:
        text, chars = rnd.choice(_PIECES)
        return text, lambda: rnd.choice(chars), "atom"
    if k < 0.7:
        parts = [_random_pattern(rnd, depth - 1) for _ in range(rnd.randint(2, 3))]
        if k < 0.55:
            return "".join(p[0] for p in parts), lambda: "".join(p[1]() for p in parts), "seq"
        return "|".join(p[0] for p in parts), lambda: rnd.choice(parts)[1](), "alt"
    text, sample, _ = _random_pattern(rnd, depth - 1)
    if k < 0.8:
        return rnd.choice(["(", "(?:"]) + text + ")", sample, "atom"
    if k < 0.9:
        return rnd.choice(["^", ""]) + "(?:" + text + ")" + rnd.choice(["$", ""]), sample, "seq"
    quantifier, lo, hi = rnd.choice([("*", 0, 3), ("+", 1, 3), ("?", 0, 1), ("{2}", 2, 2), ("{0,2}", 0, 2),
                                     ("{1,3}", 1, 3), ("{2,}", 2, 4)])
    text = text if _ == "atom" else f"(?:{text})"
    return (text + quantifier + rnd.choice(["", "", "", "?"]),
            lambda: "".join(sample() for _ in range(rnd.randint(lo, hi))), "seq")


def test_random_patterns(text_model):
    """Random patterns of the subset (anchors anywhere, nested quantifiers, lazy ones,
    classes, escapes): the grammar accepts a JSON string exactly when Python's re.search
    finds the pattern in its text; a pattern refused as matching nothing matches none of
    the strings tried."""
    rnd = random.Random(13)
    checked = matched = refused = 0
    for _ in range(150):
        text, sample, _ = _random_pattern(rnd, 3)
        text = ("^" if rnd.random() < 0.3 else "") + text + ("$" if rnd.random() < 0.3 else "")
        python = re.compile(text.replace("$", "\\Z"))
        strings = {"".join(rnd.choice(_ALPHABET) for _ in range(rnd.randint(0, 6))) for _ in range(20)}
        strings |= {"".join(rnd.choice(_ALPHABET) for _ in range(rnd.randint(0, 2))) + sample()
                    + "".join(rnd.choice(_ALPHABET) for _ in range(rnd.randint(0, 2))) for _ in range(30)}
        try:
            gbnf = json_schema_to_gbnf({"type": "string", "pattern": text})
        except SchemaError as e:
            assert "no string the grammar can write matches it" in str(e), (text, e)
            assert not any(python.search(s) for s in strings), text
            refused += 1
            continue
        with Grammar(text_model, gbnf) as g:
            for s in sorted(strings):
                want = bool(python.search(s))
                assert g.accepts(json.dumps(s, ensure_ascii=False)) == want, (text, s)
                checked += 1
                matched += want
    assert checked > 5000 and matched > 2000 and checked - matched > 1000 and refused < 20, (checked, matched, refused)


def test_random_ip_addresses(text_model):
    """format ipv4 / ipv6: on random addresses, near misses and mangled ones the grammar
    accepts exactly what fastjsonschema does."""
    rnd = random.Random(14)
    octets = [0, 1, 9, 10, 99, 100, 199, 200, 249, 250, 255, 256, 300]
    for fmt in ("ipv4", "ipv6"):
        schema = {"type": "string", "format": fmt}
        validate = _validator(schema)
        texts = set()
        for _ in range(600):
            if fmt == "ipv4":
                parts = [str(rnd.choice(octets + [rnd.randint(0, 255)])) for _ in range(rnd.choice([3, 4, 4, 4, 5]))]
                if rnd.random() < 0.1:
                    parts[0] = "0" + parts[0]
                texts.add(".".join(parts))
                continue
            mask = rnd.choice([2 ** 128 - 1, (2 ** 128 - 1) ^ (2 ** 64 - 1), 2 ** 32 - 1, (2 ** 16 - 1) << 64, 0])
            a = ipaddress.IPv6Address(rnd.getrandbits(128) & mask)
            t = rnd.choice([a.compressed, a.exploded, a.compressed.upper(), a.exploded.replace(":0", ":", 1)])
            t += rnd.choice(["", "", "", ":", ":1", "::", ":1.2.3.4"])
            texts.add(("::" if rnd.random() < 0.1 else "") + t)
        valid = 0
        with Grammar(text_model, json_schema_to_gbnf(schema)) as g:
            for t in sorted(texts):
                ok = _valid(validate, json.dumps(t))
                assert g.accepts(json.dumps(t)) == ok, (fmt, t)
                valid += ok
        assert 100 < valid < len(texts) - 100, (fmt, valid, len(texts))


def test_range_grammars_are_compact():
    """Digit-interval decomposition: rules grow with the bounds' digits, not the range."""
    small = json_schema_to_gbnf({"type": "integer", "minimum": 123456789, "maximum": 987654321})
    large = json_schema_to_gbnf({"type": "integer", "minimum": -(10 ** 29) + 7, "maximum": 10 ** 29 - 3})
    assert len(small.splitlines()) < 20 and len(large.splitlines()) < 80, (small, large)
    assert len(json_schema_to_gbnf({"type": "number", "minimum": -2.675, "maximum": 1000.1})) < 4000


def test_annotations_are_ignored_and_json_text_is_taken():
    schema = {"title": "T", "description": "d", "type": "object", "examples": [{}],
              "properties": {"a": {"type": "null", "description": "x"}}}
    assert json_schema_to_gbnf(schema) == json_schema_to_gbnf(json.dumps(schema)) == json_schema_to_gbnf(
        {"type": "object", "properties": {"a": {"type": "null"}}})


# ---- the shipped model and the server ------------------------------------------------

def test_shipped_model_answers_in_the_schema(shipped):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "age"], "additionalProperties": False}
    with Grammar(shipped, json_schema_to_gbnf(schema)) as g:
        r = shipped.generate("A JSON object describing a cat, with its name and age:\n", max_tokens=40,
                             grammar=g, temperature=0.0)
    assert r.stop_reason == "eos", r.text
    _validator(schema)(json.loads(r.text))


def test_server_json_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -3,
                                                                                "exclusiveMaximum": 3},
                                               "id": {"type": "string", "pattern": "^[a-c]\\d$"}},
              "required": ["ok", "n", "id"], "additionalProperties": False}
    validate = _validator(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    ended = 0
    for seed in range(4):
        status, reply = server.post("/v1/completions", {"prompt": "{", "max_tokens": 80, "temperature": 1.5,
                                                        "seed": seed, "response_format": fmt})
        assert status == 200, reply
        choice = reply["choices"][0]
        if choice["finish_reason"] == "stop":
            validate(json.loads(choice["text"]))
            ended += 1
    assert ended >= 2


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "response_format.json_schema.schema/pattern: lookahead"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}},
     "schema/maximum: no integer"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "schema/uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "bogus": 1}}, "bogus"),
    ({"type": "xml"}, "response_format"),
])
def test_server_json_schema_errors(server, fmt, words):
    status, reply = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "response_format": fmt})
    assert status == 400, reply
    assert words in reply["error"]["message"]
    assert reply["error"]["param"] == "response_format"


def test_grammar_from_json_schema(text_model):
    with Grammar.from_json_schema(text_model, {"enum": ["yes", "no"]}) as g:
        assert g.accepts('"yes"') and not g.accepts('"maybe"')
        r = text_model.generate("", max_tokens=8, grammar=g, temperature=0.0)
        assert r.text in ('"yes"', '"no"')
    with pytest.raises(SchemaError, match="/pattern"):
        Grammar.from_json_schema(text_model, {"type": "string", "pattern": "(?!x)"})
    assert tinyloop.json_schema_to_gbnf is json_schema_to_gbnf


def test_cli_generate_with_a_schema_or_a_grammar(paths, tmp_path, capsys):
    from tinyloop import cli
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"enum": [1, 2, 3]}))
    assert cli.main(["generate", str(paths[0]), "x", "--json-schema", str(schema), "--json",
                     "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] in ("1", "2", "3") and out["stop_reason"] == "eos"
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "ok"\n')
    assert cli.main(["generate", str(paths[0]), "x", "--grammar", str(gbnf), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == "ok"
    schema.write_text('{"type": "string", "pattern": "\\\\1"}')
    assert cli.main(["generate", str(paths[0]), "x", "--json-schema", str(schema), "--json"]) != 0
    assert "/pattern" in capsys.readouterr().out
