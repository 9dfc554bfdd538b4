"""JSON Schema to GBNF (docs/python.md, "JSON schemas").

`json_schema_to_gbnf(schema)` writes a grammar whose every sentence is a JSON document
that the schema accepts, so that generation constrained by it (tinyloop.Grammar) gives
valid output by construction. The grammar covers a subset of the valid documents where
the full set cannot be written as a grammar or would invite runaway output: properties
come in the schema's order, properties a schema does not declare are never generated,
numbers have at most 16 digits in each part (bounded numbers have no exponent, bounded
integers and numbers no negative zero), and whitespace between tokens is limited as in
JSON_GBNF. Numeric bounds are json_schema_numbers' ranges, `pattern` is
json_schema_pattern's. A keyword that constrains values but cannot be honoured
(`uniqueItems: true`, `multipleOf`, a lookahead in a pattern, ...) raises SchemaError
naming it and where it is, rather than being ignored: the promise is that output
validates."""

from __future__ import annotations

import json
import math
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any, Mapping, cast

from . import json_schema_numbers as numbers
from .gbnf_text import literal, names
from .json_schema_pattern import PatternError, pattern_content

#: the longest run a length or count bound may ask for (each step is a grammar rule)
MAX_BOUND = 1000
#: the most digits an integer bound may have
MAX_INTEGER_DIGITS = 100

# Keywords that describe a value without constraining it.
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}

_BASE_RULES = {
    "ws": r'( [ \t\n] ( [ \t\n] ( [ \t\n] [ \t\n]? )? )? )?',
    "hex": r'[0-9a-fA-F]',
    "char": r'[^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex )',
    # one code point: no \u escape of a UTF-16 surrogate, which would count as two
    "char1": r'[^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" ( [0-9a-cA-Ce-fE-F] hex | [dD] [0-7] ) hex hex )',
    "string": r'"\"" char* "\""',
    "digit": r'[0-9]',
    "digits16": r'digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit '
                r'( digit ( digit ( digit ( digit ( digit digit? )? )? )? )? )? )? )? )? )? )? )? )? )? )?',
    "natural": r'"0" | [1-9] digits15?',
    "digits15": r'digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit ( digit '
                r'( digit ( digit ( digit ( digit digit? )? )? )? )? )? )? )? )? )? )? )? )? )?',
    "integer": r'"-"? natural',
    "fraction": r'"." digits16',
    "exponent": r'[eE] [-+]? digit ( digit digit? )?',
    "number": r'"-"? natural fraction? exponent?',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
    "value": r'object | array | string | number | boolean | null',
    "object": r'"{" ws ( member ( "," ws member )* )? "}"',
    "member": r'string ws ":" ws value ws',
    "array": r'"[" ws ( value ws ( "," ws value ws )* )? "]"',
    # every day of every month except 29 February, which only leap years have
    "date": r'digit digit digit digit "-" ( ( "0" [13578] | "1" [02] ) "-" ( "0" [1-9] | [12] digit | "3" [01] ) '
            r'| ( "0" [469] | "11" ) "-" ( "0" [1-9] | [12] digit | "30" ) | "02-" ( "0" [1-9] | "1" digit | "2" [0-8] ) )',
    "time": r'( [01] digit | "2" [0-3] ) ":" [0-5] digit ":" [0-5] digit ( "." digit ( digit ( digit ( digit '
            r'( digit digit? )? )? )? )? )? ( [zZ] | [-+] ( [01] digit | "2" [0-3] ) ":" [0-5] digit )',
    "uuid": r'hex hex hex hex hex hex hex hex "-" hex hex hex hex "-" hex hex hex hex "-" '
            r'hex hex hex hex "-" hex hex hex hex hex hex hex hex hex hex hex hex',
    # RFC 3986's IPv4address and IPv6address (no zone)
    "dec-octet": r'"25" [0-5] | "2" [0-4] digit | "1" digit digit | [1-9] digit | digit',
    "ipv4": r'dec-octet "." dec-octet "." dec-octet "." dec-octet',
    "h16": r'hex ( hex ( hex hex? )? )?',
    "h16c": r'h16 ":"',
    "ls32": r'h16 ":" h16 | ipv4',
    "ipv6": r'h16c h16c h16c h16c h16c h16c ls32 | "::" h16c h16c h16c h16c h16c ls32 '
            r'| h16? "::" h16c h16c h16c h16c ls32 | ( h16 ( ":" h16 )? )? "::" h16c h16c h16c ls32 '
            r'| ( h16 ( ":" h16 ( ":" h16 )? )? )? "::" h16c h16c ls32 '
            r'| ( h16 ( ":" h16 ( ":" h16 ( ":" h16 )? )? )? )? "::" h16c ls32 '
            r'| ( h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 )? )? )? )? )? "::" ls32 '
            r'| ( h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 )? )? )? )? )? )? "::" h16 '
            r'| ( h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 ( ":" h16 )? )? )? )? )? )? )? "::"',
}
_FORMATS: dict[str, str | None] = {"date": "date", "time": "time", "date-time": None, "uuid": "uuid", "ipv4": "ipv4", "ipv6": "ipv6"}


class SchemaError(ValueError):
    """A schema that cannot be turned into a grammar: the message names the keyword and
    its place (a JSON pointer into the schema)."""


def _json_text(value: Any) -> str:
    """The compact JSON text of a const or enum value."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise SchemaError(f"{value!r} is not a JSON value") from None


class _Converter:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.rules: dict[str, str | None] = {}   # name -> body, in the order written
        self.bodies: dict[str, str] = {}   # body -> name, so that equal rules are written once
        self.refs: dict[str, str] = {}           # "#/$defs/x" -> rule name (set before its body: recursion)

    # ---- rules --------------------------------------------------------------------------
    @staticmethod
    def use(name: str) -> str:
        """A base rule's name (the grammar writes the rules its root reaches)."""
        assert name in _BASE_RULES, name
        return name

    def rule(self, hint: str, body: str) -> str:
        """A rule named after `hint` holding `body` (an existing one if the body is known)."""
        if body in self.bodies:
            return self.bodies[body]
        name = self.fresh(hint)
        self.rules[name] = body
        self.bodies[body] = name
        return name

    def fresh(self, hint: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "r"
        if base in _BASE_RULES:
            base += "-1"
        name, k = base, 1
        while name in self.rules or name in _BASE_RULES:
            k += 1
            name = f"{base}-{k}"
        return name

    def repeat(self, hint: str, item: str, lo: int, hi: int | None) -> str:
        """An expression for lo to hi (None = any number of) repetitions of `item`."""
        parts = [item] * lo
        if hi is None:
            parts.append(f"{item}*")
        elif hi > lo:
            more = '""'
            for k in range(1, hi - lo + 1):   # more_k ::= ( item more_{k-1} )?
                more = self.rule(f"{hint}-upto-{k}", f"( {item} {more} )?" if k > 1 else f"{item}?")
            parts.append(more)
        return " ".join(parts) if parts else '""'

    # ---- schemas ------------------------------------------------------------------------
    def visit(self, schema: Any, path: str, hint: str) -> str:
        """An expression (a rule name or a parenthesised alternative) for `schema`."""
        if schema is True or (isinstance(schema, dict) and not set(schema) - _ANNOTATIONS):
            return self.use("value")
        if schema is False:
            raise SchemaError(f"{path or '/'}: the schema false accepts no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"{path or '/'}: a schema must be an object or a boolean, "
                              f"got {type(schema).__name__}")
        if "$ref" in schema:
            return self.ref(schema, path)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.alternatives(schema, key, path, hint)
        if "allOf" in schema:
            return self.visit(self.merge_all_of(schema, path), path, hint)
        if "const" in schema:
            self.only(schema, {"const"}, path)
            return self.rule(f"{hint}-const", literal(_json_text(schema["const"])))
        if "enum" in schema:
            self.only(schema, {"enum", "type"}, path)
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}/enum: must be a non-empty list")
            return self.rule(f"{hint}-enum", " | ".join(literal(_json_text(v)) for v in values))
        types = schema.get("type")
        if types is None:
            types = self.implied_type(schema, path)
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types:
            raise SchemaError(f"{path}/type: must be a type name or a non-empty list of them")
        if schema.get("nullable") is True and "null" not in types:
            types = [*types, "null"]
        exprs = [self.typed(schema, t, path, hint) for t in dict.fromkeys(types)]
        return exprs[0] if len(exprs) == 1 else self.rule(hint, " | ".join(exprs))

    def only(self, schema: dict[str, Any], allowed: set[str], path: str) -> None:
        extra = set(schema) - allowed - _ANNOTATIONS - {"nullable"}
        if extra:
            raise SchemaError(f"{path}/{sorted(extra)[0]}: not supported beside "
                              f"{'/'.join(sorted(allowed))}")

    def implied_type(self, schema: dict[str, Any], path: str) -> Any:
        """The type a schema without `type` constrains, from its keywords."""
        if {"properties", "required", "additionalProperties"} & set(schema):
            return "object"
        if {"items", "prefixItems", "minItems", "maxItems"} & set(schema):
            return "array"
        if {"minLength", "maxLength", "format", "pattern"} & set(schema):
            return "string"
        self.check_keywords(schema, set(), path)
        return ["object", "array", "string", "number", "boolean", "null"]

    def ref(self, schema: dict[str, Any], path: str) -> str:
        self.only(schema, {"$ref"}, path)
        target = schema["$ref"]
        if target in self.refs:
            return self.refs[target]
        node = self.resolve(target, path)
        name = self.fresh(target.rsplit("/", 1)[-1] or "root-ref")
        self.refs[target] = name
        self.rules[name] = None           # reserved while its body is built
        self.rules[name] = self.visit(node, target[1:], name)
        return name

    def alternatives(self, schema: dict[str, Any], key: str, path: str, hint: str) -> str:
        self.only(schema, {key}, path)
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise SchemaError(f"{path}/{key}: must be a non-empty list of schemas")
        exprs = [self.visit(s, f"{path}/{key}/{i}", f"{hint}-{i}") for i, s in enumerate(branches)]
        return self.rule(hint, " | ".join(dict.fromkeys(exprs)))

    def merge_all_of(self, schema: dict[str, Any], path: str) -> dict[str, Any]:
        """allOf of object schemas (or references to them) as one object schema."""
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"{path}/allOf: must be a non-empty list of schemas")
        props = dict(merged.get("properties", {}))
        required = list(merged.get("required", []))
        for i, part in enumerate(parts):
            where = f"{path}/allOf/{i}"
            while isinstance(part, dict) and set(part) - _ANNOTATIONS == {"$ref"}:
                part = self.resolve(part["$ref"], where)
            if not isinstance(part, dict) or set(part) - _ANNOTATIONS - {
                    "type", "properties", "required", "additionalProperties"} or \
                    part.get("type", "object") != "object" or part.get("additionalProperties") is True:
                raise SchemaError(f"{where}: allOf is supported for object schemas with "
                                  f"properties and required only")
            for name, sub in part.get("properties", {}).items():
                if name in props and props[name] != sub:
                    raise SchemaError(f"{where}/properties/{name}: differs from an earlier "
                                      f"allOf member's (not supported)")
                props[name] = sub
            required += [r for r in part.get("required", []) if r not in required]
        merged.update(type="object", properties=props, required=required)
        return merged

    def resolve(self, target: Any, where: str) -> Any:
        """The node a local reference (#, #/a/b, with JSON-pointer escapes) points to."""
        if not isinstance(target, str) or not (target == "#" or target.startswith("#/")):
            raise SchemaError(f"{where}/$ref: only references inside the schema (#/...) are "
                              f"supported, got {target!r}")
        node = self.root
        for part in target[2:].split("/") if target != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"{where}/$ref: {target!r} points nowhere")
        return node

    _TYPE_KEYWORDS = {
        "string": {"minLength", "maxLength", "format", "pattern"},
        "integer": {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"},
        "number": {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"},
        "boolean": set(), "null": set(),
        "object": {"properties", "required", "additionalProperties"},
        "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
    }

    def check_keywords(self, schema: dict[str, Any], allowed: set[str], path: str) -> None:
        known = set().union(*self._TYPE_KEYWORDS.values())
        for key in schema:
            if key in _ANNOTATIONS or key in ("type", "nullable") or key in allowed:
                continue
            if key in known:
                continue          # another type's keyword: it does not apply to this type
            raise SchemaError(f"{path}/{key}: this keyword is not supported (generated values "
                              f"could not be guaranteed to satisfy it)")

    def typed(self, schema: dict[str, Any], t: Any, path: str, hint: str) -> str:
        if t not in self._TYPE_KEYWORDS:
            raise SchemaError(f"{path}/type: unknown type {t!r}")
        self.check_keywords(schema, self._TYPE_KEYWORDS[t], path)
        if t == "string":
            return self.string(schema, path, hint)
        if t in ("integer", "number"):
            return self.numeric(schema, t, path, hint)
        if t == "object":
            return self.object(schema, path, hint)
        if t == "array":
            return self.array(schema, path, hint)
        return self.use(t)

    def bound(self, schema: dict[str, Any], key: str, path: str, default: Any) -> Any:
        value = schema.get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SchemaError(f"{path}/{key}: must be a non-negative integer")
        if value > MAX_BOUND:
            raise SchemaError(f"{path}/{key}: {value} is above the largest supported bound "
                              f"({MAX_BOUND})")
        return value

    def bounds(self, schema: dict[str, Any], lo_key: str, hi_key: str, path: str) -> tuple[Any, Any]:
        lo = self.bound(schema, lo_key, path, 0)
        hi = self.bound(schema, hi_key, path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}/{hi_key}: {hi} is below {lo_key} {lo}: no value fits")
        return lo, hi

    def string(self, schema: dict[str, Any], path: str, hint: str) -> str:
        fmt = schema.get("format")
        if "pattern" in schema:
            return self.pattern(schema, path, hint)
        if fmt is not None:
            if fmt not in _FORMATS:
                raise SchemaError(f"{path}/format: {fmt!r} is not supported (supported: "
                                  f"{', '.join(_FORMATS)})")
            if "minLength" in schema or "maxLength" in schema:
                raise SchemaError(f"{path}/format: not supported together with a length bound")
            inner = (f'{self.use("date")} [tT] {self.use("time")}' if fmt == "date-time"
                     else self.use(cast(str, _FORMATS[fmt])))
            return self.rule(f"{hint}-{fmt}", f'"\\"" {inner} "\\""')
        lo, hi = self.bounds(schema, "minLength", "maxLength", path)
        if lo == 0 and hi is None:
            return self.use("string")
        chars = self.repeat(f"{hint}-chars", self.use("char1"), lo, hi)
        return self.rule(f"{hint}-string", f'"\\"" {chars} "\\""')

    def pattern(self, schema: dict[str, Any], path: str, hint: str) -> str:
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise SchemaError(f"{path}/pattern: must be a string")
        if "format" in schema:
            raise SchemaError(f"{path}/pattern: not supported together with format")
        try:
            content, shortest, longest = pattern_content(self, pattern, hint)
        except PatternError as e:
            raise SchemaError(f"{path}/pattern: {e}") from None
        lo, hi = self.bounds(schema, "minLength", "maxLength", path)
        # a length bound is honoured only where every match already keeps it
        if lo > shortest:
            raise SchemaError(f"{path}/minLength: not supported together with pattern, "
                              f"which matches {shortest} characters")
        if hi is not None and (longest is None or longest > hi):
            raise SchemaError(f"{path}/maxLength: not supported together with pattern, which "
                              f"matches {'any number of' if longest is None else longest} characters")
        return self.rule(f"{hint}-pattern", f'"\\"" {content} "\\""')

    def numeric(self, schema: dict[str, Any], t: str, path: str, hint: str) -> str:
        (lo, lo_key), (hi, hi_key) = self.numeric_bounds(schema, t, path)
        if lo is None and hi is None:
            return self.use(t)
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"{path}/{hi_key}: no {t} lies between the bounds"
                              + (" (with at most 16 digits after the point)" if t == "number" else ""))
        if t == "integer":
            # the integers of 16 digits or fewer (or as many as the admitted one nearest 0 has)
            nearest = lo if lo is not None and lo > 0 else -hi if hi is not None and hi < 0 else 0
            if nearest >= 10 ** MAX_INTEGER_DIGITS:
                raise SchemaError(f"{path}/{lo_key if nearest == lo else hi_key}: more than "
                                  f"{MAX_INTEGER_DIGITS} digits (not supported)")
            cap = 10 ** max(16, len(str(nearest))) - 1
            lo, hi = max(-cap, lo if lo is not None else -cap), min(cap, hi if hi is not None else cap)
            return self.rule(f"{hint}-range", numbers.integer_range(self, lo, hi))
        if lo == 0 and hi is None:       # exponents stay: no exponent changes the sign
            return self.rule(f"{hint}-non-negative",
                             f"{self.use('natural')} {self.use('fraction')}? {self.use('exponent')}?")
        cap = Decimal(10 ** 16) - Decimal(1).scaleb(-numbers.FRACTION_DIGITS)
        if (lo is not None and lo > cap) or (hi is not None and hi < -cap):
            raise SchemaError(f"{path}/{lo_key if lo is not None and lo > cap else hi_key}: "
                              f"outside the numbers the grammar writes (16 digits before the point)")
        lo = None if lo is not None and lo < -cap else lo
        hi = None if hi is not None and hi > cap else hi
        return self.rule(f"{hint}-range", cast(str, numbers.number_range(self, lo, hi, 16)))

    def numeric_bounds(self, schema: dict[str, Any], t: str, path: str) -> list[tuple[Any, Any]]:
        """((lo, key), (hi, key)): the tightest inclusive bounds (None: none) and the
        keywords they come from. Integers get ints; numbers get decimals with at most
        FRACTION_DIGITS places, rounded inwards, that a text must reach so that its
        double (as a validator parses it) satisfies the bound: a bound is taken as the
        double its keyword's value is, a strict one as the next double inside it."""
        sides = []
        for key, strict_key, up in (("minimum", "exclusiveMinimum", False), ("maximum", "exclusiveMaximum", True)):
            given = []
            flag = schema.get(strict_key)
            if isinstance(flag, bool):           # draft 4: a flag on minimum / maximum
                if flag and key not in schema:
                    raise SchemaError(f"{path}/{strict_key}: true needs {key} beside it (draft 4)")
                if key in schema:
                    given.append((key, flag))
            else:
                given += [(k, k == strict_key) for k in (key, strict_key) if k in schema]
            best: tuple[Any, Any] = (None, None)
            for k, strict in given:
                v = schema[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                        isinstance(v, float) and not math.isfinite(v):
                    raise SchemaError(f"{path}/{k}: must be a number")
                b = (self.integer_bound(v, strict, up) if t == "integer"
                     else self.number_bound(v, strict, up, f"{path}/{k}"))
                if best[0] is None or (b < best[0] if up else b > best[0]):
                    best = (b, k)
            sides.append(best)
        return sides

    @staticmethod
    def integer_bound(v: Any, strict: bool, up: bool) -> int:
        exact = Fraction(v)
        if up:
            return math.ceil(exact) - 1 if strict else math.floor(exact)
        return math.floor(exact) + 1 if strict else math.ceil(exact)

    @staticmethod
    def number_bound(v: Any, strict: bool, up: bool, where: str) -> Decimal:
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if f != v:
            shown = v if abs(v) < 10 ** 30 else f"{Decimal(v):.6e}"
            raise SchemaError(f"{where}: {shown} is not exactly a double (not supported for numbers)")
        if strict:
            f = math.nextafter(f, -math.inf if up else math.inf)
        d = Decimal(int(f)) if f.is_integer() else Decimal(repr(f))
        step = Decimal(1).scaleb(-numbers.FRACTION_DIGITS)
        with localcontext() as ctx:
            ctx.prec = 400
            return d.quantize(step, rounding=ROUND_FLOOR if up else ROUND_CEILING)

    def object(self, schema: dict[str, Any], path: str, hint: str) -> str:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}/properties: must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}/required: must be a list of property names")
        missing = [r for r in required if r not in props]
        extra = schema.get("additionalProperties", True)
        if missing and extra is False:
            raise SchemaError(f"{path}/required: {missing[0]!r} is required but not a property, "
                              f"and additionalProperties is false: no object fits")
        if missing:
            raise SchemaError(f"{path}/required: {missing[0]!r} is required but has no schema "
                              f"under properties (not supported)")
        ws = self.use("ws")
        if not props:
            if extra is False:
                return self.rule(f"{hint}-empty", f'"{{" {ws} "}}"')
            value = self.visit(extra if isinstance(extra, dict) else True,
                               f"{path}/additionalProperties", f"{hint}-value")
            member = self.rule(f"{hint}-member", f'{self.use("string")} {ws} ":" {ws} {value} {ws}')
            return self.rule(hint, f'"{{" {ws} ( {member} ( "," {ws} {member} )* )? "}}"')
        members = []
        for name, sub in props.items():
            value = self.visit(sub, f"{path}/properties/{name}", f"{hint}-{name}")
            members.append((self.rule(f"{hint}-{name}-kv",
                                      f'{literal(json.dumps(name, ensure_ascii=False))} {ws} ":" {ws} {value} {ws}'),
                            name in required))
        # after_k: the members from k on when one is already written (each then starts
        # with a comma); from_k: the same with none written yet. None = nothing left.
        after = start = None
        for k in range(len(members) - 1, -1, -1):
            kv, req = members[k]
            comma_kv = f'"," {ws} {kv}'
            new_after = comma_kv if req else f"( {comma_kv} )?"
            first = kv if after is None else f"{kv} {after}"
            if after is not None:
                new_after += f" {after}"
            if req:
                new_start = first
            elif start is None:
                new_start = f"( {first} )?"
            else:
                new_start = f"{first} | {start}"
            if k:
                after = self.rule(f"{hint}-after-{k}", new_after)
            start = self.rule(f"{hint}-from-{k}", new_start)
        return self.rule(hint, f'"{{" {ws} {start} "}}"')

    def array(self, schema: dict[str, Any], path: str, hint: str) -> str:
        if schema.get("uniqueItems", False) is not False:
            raise SchemaError(f"{path}/uniqueItems: only false is supported (a grammar cannot "
                              f"compare items)")
        ws = self.use("ws")
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if isinstance(items, list):           # draft 7 tuples
            prefix, items = items, schema.get("additionalItems", True)
        lo, hi = self.bounds(schema, "minItems", "maxItems", path)
        if prefix is not None:
            if not isinstance(prefix, list) or not prefix:
                raise SchemaError(f"{path}/prefixItems: must be a non-empty list of schemas")
            if "minItems" in schema or "maxItems" in schema:
                raise SchemaError(f"{path}/minItems: not supported with a tuple (prefixItems)")
            exprs = [self.visit(s, f"{path}/prefixItems/{i}", f"{hint}-{i}") for i, s in enumerate(prefix)]
            body = f' "," {ws} '.join(f"{e} {ws}" for e in exprs)
            return self.rule(hint, f'"[" {ws} {body} "]"')
        item = self.visit(items, f"{path}/items", f"{hint}-item")
        if hi == 0:
            return self.rule(f"{hint}-empty", f'"[" {ws} "]"')
        rest = self.rule(f"{hint}-next", f'"," {ws} {item} {ws}')
        tail = self.repeat(f"{hint}-next", rest, max(lo - 1, 0), None if hi is None else hi - 1)
        elems = f"{item} {ws} {tail}"
        return self.rule(hint, f'"[" {ws} {elems} "]"' if lo > 0 else f'"[" {ws} ( {elems} )? "]"')

    def grammar(self) -> str:
        top = self.visit(self.root, "", "root")
        bodies: dict[str, Any] = {"root": top} if top != "root" else {}
        bodies.update(self.rules)
        bodies.update(_BASE_RULES)
        reached, todo = set(), ["root"]
        while todo:                      # only the rules the root reaches are written
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo += [n for n in names(bodies[name]) if n in bodies]
        return "".join(f"{name} ::= {body}\n" for name, body in bodies.items() if name in reached)


def json_schema_to_gbnf(schema: Mapping[str, Any] | str | bytes) -> str:
    """GBNF for the JSON documents `schema` (a dict or a JSON string) accepts (within the
    limits the module docstring lists); SchemaError for what cannot be honoured."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    return _Converter(schema).grammar()
