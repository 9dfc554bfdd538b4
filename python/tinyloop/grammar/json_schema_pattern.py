"""JSON Schema `pattern` (ECMA-262 regular expressions, a subset) as GBNF over the
content of a JSON string, for tinyloop.grammar.json_schema (docs/python.md, "JSON schemas").

A pattern constrains the decoded string and is unanchored: a string is valid when the
pattern matches some part of it. The grammar is written over the JSON text, so each
character a pattern names is spelled as JSON spells it (`"`, `\\` and control characters
escaped as json.dumps escapes them), and the free text around an unanchored match is any
JSON string content. `^` and `$` may stand anywhere: every expression is split into what
it matches with no anchor passed, after passing `^` (which must come first), before `$`
(which must come last) and with both, and search = any M any | S any | any E | B.

Character sets are those of ECMA-262, narrowed so that a Python validator (`re`, as
fastjsonschema uses) agrees on every character the grammar may write: `.` and negated
sets stay in the Basic Multilingual Plane (a character above it is two code units to
ECMA, one to Python), `\\w` `\\d` are ASCII, `\\W` `\\D` and a negated set holding `\\w` or
`\\d` keep to ASCII (Python's `\\w` and `\\d` take letters and digits of every script),
and `\\s` `\\S` drop the characters only one of the two counts as space. Constructs the two
read differently, or that a grammar cannot follow (backreferences, lookaround, word
boundaries), raise PatternError naming them."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, NoReturn, Sequence, TypeAlias, cast

from .gbnf_text import alternatives, group, literal, seq
from .json_schema_numbers import Rules

#: a character set: sorted, disjoint inclusive code point ranges
Ranges: TypeAlias = "tuple[tuple[int, int], ...]"
#: a set as (ECMA's, a subset of Python's, a superset of Python's)
Triple: TypeAlias = "tuple[Ranges, Ranges, Ranges]"
#: a parsed node (the shapes the parser's comment lists)
Node: TypeAlias = "tuple[Any, ...]"

#: the largest count a {n,m} may give
MAX_COUNT = 1000


class PatternError(ValueError):
    """A pattern outside the supported subset (the message says what and where)."""


# ---- character sets: tuples of inclusive (lo, hi) code point ranges, sorted, disjoint ---

_TOP = 0x10FFFF


def _norm(ranges: Iterable[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _union(*sets: Ranges) -> Ranges:
    return _norm([r for s in sets for r in s])


def _complement(s: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    at = 0
    for lo, hi in s:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _TOP:
        out.append((at, _TOP))
    return tuple(out)


def _intersect(*sets: Ranges) -> Ranges:
    return _complement(_union(*(_complement(s) for s in sets)))


def _chars(*cps: int) -> Ranges:
    return _norm([(c, c) for c in cps])


#: the characters a pattern's sets may yield: the BMP without surrogates
_WRITABLE = ((0, 0xD7FF), (0xE000, 0xFFFF))
#: those JSON writes as themselves (not `"`, `\`, or a control character)
_RAW = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, 0xFFFF))

_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_NON_ASCII = ((0x80, _TOP),)
_ECMA_SPACE = _union(((9, 13), (0x2000, 0x200A), (0x2028, 0x2029)),
                     _chars(0x20, 0xA0, 0x1680, 0x202F, 0x205F, 0x3000, 0xFEFF))
_PY_SPACE = _union(((9, 13), (0x1C, 0x20), (0x2000, 0x200A), (0x2028, 0x2029)),
                   _chars(0x85, 0xA0, 0x1680, 0x202F, 0x205F, 0x3000))

# A set as (ECMA's set, a subset of Python's, a superset of Python's): Python's own \w,
# \d and \s depend on its Unicode tables, so only bounds on them are known.
_SHORTHANDS: dict[str, Triple] = {
    "d": (_DIGIT, _DIGIT, _union(_DIGIT, _NON_ASCII)),
    "w": (_WORD, _WORD, _union(_WORD, _NON_ASCII)),
    "s": (_ECMA_SPACE, _PY_SPACE, _union(_PY_SPACE, _chars(0x180E, 0x200B, 0xFEFF))),
}
_DOT: Triple = (_complement(_chars(10, 13, 0x2028, 0x2029)),) + (_complement(_chars(10)),) * 2


def _negate(triple: Triple) -> Triple:
    ecma, inner, outer = triple
    return _complement(ecma), _complement(outer), _complement(inner)


def _triple_union(triples: Sequence[Triple]) -> Triple:
    ecma, inner, outer = (_union(*(t[i] for t in triples)) for i in range(3))
    return ecma, inner, outer


def _safe(triple: Triple) -> Ranges:
    """The characters both ECMA and Python put in the set, that the grammar may write."""
    return _intersect(triple[0], triple[1], _WRITABLE)


# ---- the parser: pattern text -> nodes ---------------------------------------------------
# ("set", ranges) | ("str", text) | ("cat", [nodes]) | ("alt", [nodes])
# | ("rep", node, lo, hi or None) | ("bol",) | ("eol",)

_QUANTIFIER = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_SIMPLE_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_REFUSED_ESCAPES = {
    "b": "the word boundary \\b", "B": "the word boundary \\B", "k": "named backreferences (\\k)",
    "p": "Unicode property escapes (\\p)", "P": "Unicode property escapes (\\P)",
    "c": "control escapes (\\c)",
}


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, what: str, at: int | None = None) -> NoReturn:
        raise PatternError(f"{what} (at offset {self.pos if at is None else at}) is not supported")

    def peek(self, k: int = 0) -> str:
        return self.text[self.pos + k] if self.pos + k < len(self.text) else ""

    def parse(self) -> Node:
        node = self.disjunction()
        if self.pos < len(self.text):        # only an unmatched ")" stops a disjunction early
            self.fail("an unmatched ')'")
        return node

    def disjunction(self) -> Node:
        alts = [self.alternative()]
        while self.peek() == "|":
            self.pos += 1
            alts.append(self.alternative())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def alternative(self) -> Node:
        items: list[Node] = []
        while self.peek() not in ("", "|", ")"):
            item = self.term()
            if item[0] == "set" and len(item[1]) == 1 and item[1][0][0] == item[1][0][1]:
                item = ("str", chr(item[1][0][0]))
            if item[0] == "str" and items and items[-1][0] == "str":
                items[-1] = ("str", items[-1][1] + item[1])
            else:
                items.append(item)
        return items[0] if len(items) == 1 else ("cat", items)

    def term(self) -> Node:
        at, c = self.pos, self.peek()
        if c in "^$":
            self.pos += 1
            if self.quantifier_here():
                self.fail(f"a quantifier on the anchor {c}", self.pos)
            return ("bol",) if c == "^" else ("eol",)
        if c in "*+?" or self.quantifier_here():
            self.fail(f"a quantifier with nothing to repeat ({c})")
        if c == "{":
            self.fail("a '{' that starts no quantifier (write \\{)")
        if c == "(":
            atom: Node = self.group()
        elif c == "[":
            atom = ("set", _safe(self.char_class()))
        elif c == ".":
            self.pos += 1
            atom = ("set", _safe(_DOT))
        elif c == "\\":
            escaped = self.escape(in_class=False)
            atom = ("set", _safe(escaped)) if isinstance(escaped, tuple) else ("str", self.char(escaped, at))
        else:
            self.pos += 1
            atom = ("str", self.char(ord(c), at))
        return self.quantified(atom)

    def char(self, cp: int, at: int) -> str:
        if not _intersect(((cp, cp),), _WRITABLE):
            self.fail(f"the character U+{cp:04X} (beyond U+FFFF, or a surrogate)", at)
        return chr(cp)

    def quantifier_here(self) -> bool:
        return self.peek() in ("*", "+", "?") or bool(_QUANTIFIER.match(self.text, self.pos))

    def quantified(self, atom: Node) -> Node:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            bounds: dict[str, tuple[int, int | None]] = {"*": (0, None), "+": (1, None), "?": (0, 1)}
            lo, hi = bounds[c]
        elif c == "{" and (m := _QUANTIFIER.match(self.text, self.pos)):
            lo = int(m[1])
            hi = lo if not m[2] else int(m[3]) if m[3] else None
            if max(lo, hi or 0) > MAX_COUNT:
                self.fail(f"a count above {MAX_COUNT} ({m[0]})")
            if hi is not None and hi < lo:
                raise PatternError(f"{m[0]} (at offset {self.pos}): the counts are out of order")
            self.pos = m.end()
        else:
            return atom
        if self.peek() == "?":               # lazy: the same strings match
            self.pos += 1
        if self.quantifier_here():
            self.fail("a quantifier after a quantifier")
        return ("rep", atom, lo, hi)

    def group(self) -> Node:
        at = self.pos
        if self.text.startswith("(?:", at):
            self.pos += 3
        elif self.text.startswith("(?", at):
            kind = ("lookahead" if self.peek(2) in "=!" else
                    "lookbehind" if self.text.startswith(("(?<=", "(?<!"), at) else
                    "a named group" if self.peek(2) in "<P" else "a group with flags or options")
            self.fail(kind, at)
        else:
            self.pos += 1
        node = self.disjunction()
        if self.peek() != ")":
            self.fail("a '(' without its ')'", at)
        self.pos += 1
        return node

    def escape(self, in_class: bool) -> int | Triple:
        """After a backslash: a code point, or a set (ECMA, Python inner, outer)."""
        at = self.pos
        self.pos += 1
        c = self.peek()
        self.pos += 1
        if not c:
            self.fail("a '\\' that ends the pattern", at)
        if c.lower() in _SHORTHANDS:
            triple = _SHORTHANDS[c.lower()]
            return _negate(triple) if c.isupper() else triple
        if c in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[c]
        if c == "b" and in_class:
            return 8
        if c in _REFUSED_ESCAPES:
            self.fail(_REFUSED_ESCAPES[c], at)
        if c == "0":
            if self.peek().isdigit():
                self.fail("an octal escape", at)
            return 0
        if c.isdigit():
            self.fail(f"the backreference \\{c}", at)
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.text[self.pos:self.pos + n]
            if len(digits) < n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} without {n} hexadecimal digits", at)
            self.pos += n
            return int(digits, 16)
        if c.isascii() and c.isalnum():
            self.fail(f"the escape \\{c}", at)
        return ord(c)                        # an escaped punctuation or other character

    def no_set_operator(self) -> None:
        if self.text.startswith(("--", "&&", "~~", "||"), self.pos):
            c = self.peek()
            self.fail(f"'{c}{c}' inside a class (an operator in other dialects; escape it)")

    def class_atom(self) -> int | Triple:
        self.no_set_operator()
        at, c = self.pos, self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[":
            self.fail("a '[' inside a class (write \\[)", at)
        self.pos += 1
        return ord(c)

    def class_char(self) -> int | Triple:
        """A class atom; a code point must be one the grammar can write."""
        at = self.pos
        atom = self.class_atom()
        if not isinstance(atom, tuple):
            self.char(atom, at)
        return atom

    def char_class(self) -> Triple:
        """A [...] set as (ECMA, Python inner, Python outer)."""
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        if self.peek() == "]":
            self.fail("an empty class (ECMA matches nothing, Python reads a ']')", start)
        items: list[Triple] = []
        while self.peek() != "]":
            if not self.peek():
                self.fail("a '[' without its ']'", start)
            at = self.pos
            lo = self.class_char()
            self.no_set_operator()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.class_char()
                if isinstance(lo, tuple) or isinstance(hi, tuple):
                    self.fail("a range with a class escape as an end", at)
                if hi < lo:
                    raise PatternError(f"the range at offset {at} is out of order")
                items.append((((lo, hi),),) * 3)
            else:
                items.append(lo if isinstance(lo, tuple) else (((lo, lo),),) * 3)
        self.pos += 1
        triple = _triple_union(items)
        return _negate(triple) if negated else triple


def parse(pattern: str) -> Node:
    """The node tree of `pattern`; PatternError for what the subset leaves out."""
    tree = _Parser(pattern).parse()
    copies = _nested_copies(tree)
    if copies > MAX_COUNT:
        # nested counts multiply the places a match can be at: (a{0,1000}){0,1000} cost
        # the matcher ~30 s a token; a product within MAX_COUNT stays in milliseconds
        raise PatternError(f"nested repetitions that allow {copies} copies of one atom (at most "
                           f"{MAX_COUNT}: write the repetition once)")
    return tree


def _nested_copies(node: Node) -> int:
    """The largest product of repetition counts along one nesting path (an unbounded
    repetition counts its minimum, at least 1)."""
    if node[0] == "rep":
        _, atom, lo, hi = node
        copies: int = max(lo, hi or 0, 1) * _nested_copies(atom)
        return copies
    if node[0] in ("cat", "alt"):
        return max((_nested_copies(n) for n in node[1]), default=1)
    return 1


# ---- nodes -> GBNF ----------------------------------------------------------------------

class _Part:
    """A language: its expression and length bounds (hi None: unbounded); `nonempty()`
    gives it without the empty string (what a repetition repeats: `x*` of an x that
    may match nothing is left recursion to the grammar)."""

    def __init__(self, expr: str, lo: int, hi: int | None,
                 nonempty: Callable[[], str | None] | None = None):
        self.expr, self.lo, self.hi = expr, lo, hi
        self._nonempty = nonempty
        self._ne: Any = ...   # not worked out yet

    def nonempty(self) -> str | None:
        if self._ne is ...:
            self._ne = self.expr if self.lo > 0 else self._nonempty() if self._nonempty else None
        found: str | None = self._ne
        return found


_EPS = _Part('""', 0, 0)


def _cat(a: _Part | None, b: _Part | None) -> _Part | None:
    if a is None or b is None:
        return None
    hi = None if a.hi is None or b.hi is None else a.hi + b.hi
    return _Part(seq(a.expr, b.expr), a.lo + b.lo, hi,
                 lambda: alternatives([a.nonempty() and seq(cast(str, a.nonempty()), b.expr), b.nonempty()]))


def _alt(*given: _Part | None) -> _Part | None:
    parts = [p for p in given if p is not None]
    if not parts:
        return None
    highs = [p.hi for p in parts]
    hi = None if any(h is None for h in highs) else max(cast("list[int]", highs))
    return _Part(cast(str, alternatives(p.expr for p in parts)), min(p.lo for p in parts), hi,
                 lambda: alternatives(p.nonempty() for p in parts))


def _star(p: _Part | None) -> _Part:
    body = None if p is None else p.nonempty()
    if body is None:
        return _EPS
    return _Part(f"{group(body)}*", 0, None, lambda: f"{group(body)}+")


def _eps(*parts: _Part | None) -> _Part | None:
    return _EPS if any(p is not None and p.lo == 0 for p in parts) else None


class _Lang:
    """What a node matches with no anchor passed (m), after passing ^ (s), before $ (e)
    and with both (b); None where it matches nothing so."""

    def __init__(self, m: _Part | None = None, s: _Part | None = None, e: _Part | None = None,
                 b: _Part | None = None):
        self.m, self.s, self.e, self.b = m, s, e, b

    def anchored(self) -> bool:
        return any(x is not None for x in (self.s, self.e, self.b))


def _lang_cat(x: _Lang, y: _Lang) -> _Lang:
    return _Lang(
        m=_cat(x.m, y.m),
        s=_alt(_cat(x.s, y.m), _cat(_eps(x.m, x.s), y.s)),
        e=_alt(_cat(x.m, y.e), _cat(x.e, _eps(y.m, y.e))),
        b=_alt(_cat(x.s, y.e), _cat(x.b, _eps(y.m, y.e)), _cat(_eps(x.m, x.s), y.b),
               _cat(_eps(x.b, x.e), _eps(y.s, y.b))))


def _lang_alt(langs: Sequence[_Lang]) -> _Lang:
    return _Lang(*(_alt(*(getattr(x, k) for x in langs)) for k in "mseb"))


def _lang_star(x: _Lang) -> _Lang:
    ms = _star(x.m)
    return _Lang(m=ms, s=_cat(x.s, ms), e=_cat(ms, x.e),
                 b=_alt(_cat(_cat(x.s, ms), x.e), x.b, _cat(_eps(x.e, x.b), _eps(x.s, x.b))))


class _Writer:
    def __init__(self, rules: Rules, hint: str):
        self.rules, self.hint = rules, hint

    def named(self, p: _Part | None, what: str) -> _Part | None:
        """p with its expression as a rule (so that expressions stay linear in size)."""
        if p is None or group(p.expr) == p.expr:
            return p
        name = self.rules.rule(f"{self.hint}-{what}", p.expr)
        return _Part(name, p.lo, p.hi,
                     lambda: p.nonempty() and self.rules.rule(f"{self.hint}-{what}-1", cast(str, p.nonempty())))

    def lang(self, node: Node) -> _Lang:
        kind = node[0]
        if kind == "set":
            return _Lang(m=_Part(self.set_expr(node[1]), 1, 1) if node[1] else None)
        if kind == "str":
            return _Lang(m=_Part(literal(json.dumps(node[1], ensure_ascii=False)[1:-1]), len(node[1]), len(node[1])))
        if kind == "bol":
            return _Lang(s=_EPS)
        if kind == "eol":
            return _Lang(e=_EPS)
        if kind == "alt":
            return self.tidy(_lang_alt([self.lang(n) for n in node[1]]))
        if kind == "cat":
            out = _Lang(m=_EPS)
            for n in node[1]:
                out = self.tidy(_lang_cat(out, self.lang(n)))
            return out
        return self.repeat(self.lang(node[1]), node[2], node[3])

    def tidy(self, x: _Lang) -> _Lang:
        """Name the parts of a language with several: they share subexpressions."""
        if sum(getattr(x, k) is not None for k in "mseb") < 2:
            return x
        return _Lang(*(self.named(getattr(x, k), f"pattern-{k}") for k in "mseb"))

    def repeat(self, x: _Lang, lo: int, hi: int | None) -> _Lang:
        if x.anchored():        # rare: spelled out, one copy a step
            out = _Lang(m=_EPS)
            for _ in range(lo):
                out = self.tidy(_lang_cat(out, x))
            if hi is None:
                return self.tidy(_lang_cat(out, _lang_star(x)))
            opt = _Lang(m=_EPS)
            for _ in range(hi - lo):
                opt = self.tidy(_lang_alt([_lang_cat(x, opt), _Lang(m=_EPS)]))
            return self.tidy(_lang_cat(out, opt))
        p = x.m
        if p is None:
            return _Lang(m=_EPS if lo == 0 else None)
        item = cast(_Part, self.named(p, "pattern-item"))   # p is not None: neither is it
        longest: int | None
        if hi is None:
            expr = seq(*([item.expr] * lo), _star(item).expr)
            longest = 0 if p.hi == 0 else None
        else:
            expr = self.rules.repeat(f"{self.hint}-pattern", item.expr, lo, hi)
            longest = None if p.hi is None else p.hi * hi

        def nonempty() -> str | None:          # a first copy that is not empty, then any of the rest
            if hi == 0 or item.nonempty() is None:
                return None
            rest = _star(item).expr if hi is None else self.rules.repeat(
                f"{self.hint}-pattern", item.expr, 0, hi - 1)
            return seq(group(cast(str, item.nonempty())), rest)
        return _Lang(m=_Part(expr, p.lo * lo, longest, nonempty))

    def set_expr(self, ranges: Ranges) -> str:
        """A rule for one character of `ranges`, as JSON writes it."""
        alts: list[str | None] = []
        raw = _intersect(ranges, _RAW)
        if raw:
            alts.append(_gbnf_class(raw))
        escaped = [c for lo, hi in _intersect(ranges, ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)))
                   for c in range(lo, hi + 1)]
        by_nibble: dict[str, list[str]] = {}
        for c in escaped:
            text = json.dumps(chr(c))[1:-1]
            if text.startswith("\\u"):
                by_nibble.setdefault(text[:-1], []).append(text[-1])
            else:
                alts.append(literal(text))
        for prefix, lows in by_nibble.items():
            alts.append(f"{literal(prefix)} {_gbnf_class(_norm((ord(h), ord(h)) for h in lows))}")
        expr = cast(str, alternatives(alts))   # a set the parser kept is not empty
        return expr if len(alts) == 1 and group(expr) == expr else self.rules.rule(f"{self.hint}-char", expr)


def _gbnf_class(ranges: Ranges) -> str:
    def one(cp: int) -> str:
        ch = chr(cp)
        return ch if ch.isascii() and ch.isalnum() else f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}"
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return literal(chr(ranges[0][0]))
    return "[" + "".join(one(lo) if lo == hi else f"{one(lo)}-{one(hi)}" for lo, hi in ranges) + "]"


def pattern_content(rules: Rules, pattern: str, hint: str) -> tuple[str, int, int | None]:
    """(expression, shortest, longest): the JSON string content (between the quotes)
    whose decoded text `pattern` matches somewhere, and the bounds of its length in
    characters (longest None: unbounded). PatternError for what is not supported."""
    writer = _Writer(rules, hint)
    x = writer.lang(parse(pattern))
    free = _Part(f"{rules.use('char')}*", 0, None)
    if any(p is not None and p.lo == 0 for p in (x.m, x.s, x.e)):
        return free.expr, 0, None           # matches the empty text, so somewhere in any
    whole = _alt(_cat(_cat(free, x.m), free), _cat(x.s, free), _cat(free, x.e), x.b)
    if whole is None:
        raise PatternError("no string the grammar can write matches it")
    return whole.expr, whole.lo, whole.hi
