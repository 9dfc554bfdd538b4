"""JSON Schema to GBNF (python/tinyloop/json_schema.py; docs/python.md, "JSON schemas"):
documents in the grammar's subset are accepted and documents the schema refuses are not,
every sampled generation a grammar completes validates (an independent validator,
fastjsonschema, judges), unsupported keywords are refused by name, and the server's
response_format json_schema gives valid answers."""

import json

import pytest

import tinyloop
from test_grammar import shipped, text_model  # noqa: F401 (fixtures: the shipped model, a byte-level one)
from test_server import paths, server  # noqa: F401 (fixtures: text models, a server of the plain one)
from tinyloop.grammar import Grammar
from tinyloop.json_schema import SchemaError, json_schema_to_gbnf

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

# (schema, documents the grammar must accept, documents the schema refuses)
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
    schema, accepted, refused = CASES[case]
    validate = _validator(schema)
    with Grammar(text_model, json_schema_to_gbnf(schema)) as g:
        for text in accepted:
            assert _valid(validate, text), f"test data: {text!r} should be valid"
            assert g.accepts(text), text
        for text in refused:
            assert not g.accepts(text), text
            if text != '{"name": "Al", "tags": [], "x": 1}':   # valid, outside the subset
                assert not _valid(validate, text), f"test data: {text!r} should be invalid"


@pytest.mark.parametrize("case", range(len(CASES) - 1))
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
    ({"type": "string", "pattern": "^a+$"}, "/pattern: this keyword is not supported"),
    ({"type": "array", "uniqueItems": True}, "/uniqueItems"),
    ({"type": "integer", "maximum": 3}, "/maximum"),
    ({"type": "integer", "minimum": 5}, "/minimum: only minimum 0"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "/properties/a/format"),
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
])
def test_unsupported_keywords_are_refused(schema, where):
    with pytest.raises(SchemaError, match=__import__("re").escape(where)):
        json_schema_to_gbnf(schema)


def test_annotations_are_ignored_and_json_text_is_taken():
    schema = {"title": "T", "description": "d", "type": "object", "examples": [{}],
              "properties": {"a": {"type": "null", "description": "x"}}}
    assert json_schema_to_gbnf(schema) == json_schema_to_gbnf(json.dumps(schema)) == json_schema_to_gbnf(
        {"type": "object", "properties": {"a": {"type": "null"}}})


# ---- the shipped model and the server ------------------------------------------------

def test_shipped_model_answers_in_the_schema(shipped):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    with Grammar(shipped, json_schema_to_gbnf(schema)) as g:
        r = shipped.generate("A JSON object describing a cat, with its name and age:\n", max_tokens=40,
                             grammar=g, temperature=0.0)
    assert r.stop_reason == "eos", r.text
    _validator(schema)(json.loads(r.text))


def test_server_json_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
              "required": ["ok", "n"], "additionalProperties": False}
    validate = _validator(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    ended = 0
    for seed in range(4):
        status, reply = server.post("/v1/completions", {"prompt": "{", "max_tokens": 40, "temperature": 1.5,
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
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a"}}},
     "pattern"),
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
        Grammar.from_json_schema(text_model, {"type": "string", "pattern": "x"})
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
    schema.write_text('{"type": "string", "pattern": "a"}')
    assert cli.main(["generate", str(paths[0]), "x", "--json-schema", str(schema), "--json"]) != 0
    assert "/pattern" in capsys.readouterr().out
