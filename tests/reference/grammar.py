"""GBNF (the subset of docs/api.md, "Grammars") written out plainly: a parser to a tree
of nodes and a memoized recursive matcher over a string's characters, which says where
a node's matches starting at position i can end, and whether the rest of the string is a
proper prefix of some match (so the text could still go on).

Text made of tokens is bytes and may end inside a character: the *_bytes methods split
bytes with Python's own UTF-8 decoder into whole characters and, at the end, an
incomplete one, which stands for the set of code points that can complete it (found by
trying completions, an interval: tests/lib/test_grammar.py checks that on every prefix); the
text is then a prefix of a sentence when the characters are and the next character the
grammar takes can be one of that set.

It never calls libtinyloop and shares nothing with its pushdown matcher: the tests hold
the library's whole-string answers and its per-step token masks to it.

Nodes: ("lit", text), ("cls", negated, [(lo, hi), ...]), ("ref", name),
("seq", [node, ...]), ("alt", [node, ...]), ("rep", node, least, most or None).
"""

import codecs
from functools import lru_cache

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "[": "[", "]": "]", "-": "-",
           "^": "^", "'": "'"}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class GrammarError(ValueError):
    pass


class _Parser:
    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.rules: dict = {}

    def peek(self, k=0):
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def space(self, newlines: bool):
        while True:
            c = self.peek()
            if c in (" ", "\t", "\r") or (newlines and c == "\n"):
                self.i += 1
            elif c == "#":
                while self.peek() not in ("", "\n"):
                    self.i += 1
            else:
                return

    def char(self) -> str:
        c = self.peek()
        self.i += 1
        if c != "\\":
            return c
        e = self.peek()
        self.i += 1
        if e in HEX_DIGITS:
            digits = self.s[self.i:self.i + HEX_DIGITS[e]]
            self.i += HEX_DIGITS[e]
            value = int(digits, 16)
            if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                raise GrammarError(f"escape of {value:#x}, not a character")
            return chr(value)
        if e not in ESCAPES:
            raise GrammarError(f"unknown escape \\{e}")
        return ESCAPES[e]

    def name(self) -> str:
        start = self.i
        while self.peek().isascii() and (self.peek().isalnum() or self.peek() in "-_"):
            self.i += 1
        if start == self.i:
            raise GrammarError(f"expected a name at {start}")
        return self.s[start:self.i]

    def primary(self, nested: bool):
        c = self.peek()
        if c == '"':
            self.i += 1
            text = []
            while self.peek() != '"':
                if self.peek() in ("", "\n"):
                    raise GrammarError("unterminated literal")
                text.append(self.char())
            self.i += 1
            return ("lit", "".join(text))
        if c == "[":
            self.i += 1
            negated = self.peek() == "^"
            self.i += negated
            ranges = []
            while self.peek() != "]":
                if self.peek() in ("", "\n"):
                    raise GrammarError("unterminated class")
                lo = self.char()
                hi = lo
                if self.peek() == "-" and self.peek(1) not in ("]", ""):
                    self.i += 1
                    hi = self.char()
                ranges.append((ord(lo), ord(hi)))
            self.i += 1
            return ("cls", negated, ranges)
        if c == ".":
            self.i += 1
            return ("cls", True, [])
        if c == "(":
            self.i += 1
            node = self.alternatives(True)
            self.space(True)
            if self.peek() != ")":
                raise GrammarError("expected )")
            self.i += 1
            return node
        return ("ref", self.name())

    def sequence(self, nested: bool):
        items = []
        while True:
            self.space(nested)
            if self.peek() in ("", "|", ")", "\n"):
                return ("seq", items)
            node = self.primary(nested)
            op = self.peek()
            if op in ("*", "+", "?"):
                self.i += 1
                node = ("rep", node, 1 if op == "+" else 0, 1 if op == "?" else None)
            items.append(node)

    def alternatives(self, nested: bool):
        alts = [self.sequence(nested)]
        while True:
            if self.peek() == "\n" and not nested:
                save = self.i
                self.space(True)
                if self.peek() != "|":
                    self.i = save
                    return ("alt", alts)
            if self.peek() != "|":
                return ("alt", alts)
            self.i += 1
            alts.append(self.sequence(nested))

    def grammar(self) -> dict:
        while True:
            self.space(True)
            if not self.peek():
                break
            name = self.name()
            if name in self.rules:
                raise GrammarError(f"rule {name} defined twice")
            self.space(False)
            if self.s[self.i:self.i + 3] != "::=":
                raise GrammarError("expected ::=")
            self.i += 3
            self.space(True)
            self.rules[name] = self.alternatives(False)
            if self.peek() not in ("", "\n"):
                raise GrammarError(f"unexpected {self.peek()!r}")
        if "root" not in self.rules:
            raise GrammarError("no root")
        return self.rules


def parse(text: str) -> dict:
    """The rules of GBNF text: name -> node."""
    return _Parser(text).grammar()


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _starts_utf8(b: bytes) -> bool:
    """Python's incremental decoder takes b without an error (it catches most bad
    beginnings at once, not all: a surrogate's shows only once it is whole)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(b, final=False)
        return True
    except UnicodeDecodeError:
        return False


@lru_cache(maxsize=None)
def completions(tail: bytes):
    """(lo, hi): the least and greatest code points whose UTF-8 begins with the
    incomplete character `tail` (found by trying continuation bytes in order); None when
    none does."""
    def first(b: bytes, order):
        if _decodes(b):
            return ord(b.decode("utf-8"))
        if len(b) >= 4 or not _starts_utf8(b):
            return None
        for c in order:
            found = first(b + bytes([c]), order)
            if found is not None:
                return found
        return None
    lo = first(tail, range(0x80, 0xC0))
    return None if lo is None else (lo, first(tail, range(0xBF, 0x7F, -1)))


def split_utf8(b: bytes):
    """(text, pending) of bytes: the whole characters and, when b ends inside one, the
    (lo, hi) of the code points that can complete it, else None; None for bytes that
    cannot begin a UTF-8 text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(b, final=False)
    except UnicodeDecodeError:
        return None
    tail = decoder.getstate()[0]
    if not tail:
        return text, None
    span = completions(tail)
    return None if span is None else (text, span)


def class_meets(negated: bool, ranges, lo: int, hi: int) -> bool:
    """Whether a class takes some code point of [lo, hi]."""
    if not negated:
        return any(a <= hi and b >= lo for a, b in ranges)
    x = lo   # the least code point of [lo, hi] not yet known to be covered
    for a, b in sorted(ranges):
        if a > x:
            break
        x = max(x, b + 1)
    return x <= hi


class Matcher:
    """Matches strings against parsed rules (no left recursion: the parser of the library
    refuses it, and this matcher would not end on it)."""

    def __init__(self, rules: dict):
        self.rules = rules

    def analyse(self, s: str, pending=None):
        """(ends, prefix) of the root rule on s from position 0: the positions where a
        match can end, and whether s is a proper prefix of a longer sentence; with
        pending = (lo, hi), a prefix whose next character can be one of lo..hi."""
        nodes = {}   # id -> node, so that the memo's keys are hashable

        @lru_cache(maxsize=None)
        def run(key, i):
            return go(nodes[key], i)

        def at(node, i):
            nodes[id(node)] = node
            return run(id(node), i)

        def go(node, i):
            kind = node[0]
            if kind == "lit":
                text = node[1]
                if s.startswith(text, i):
                    return frozenset([i + len(text)]), False
                rest = s[i:]
                fits = len(rest) < len(text) and text.startswith(rest)
                if fits and pending:
                    fits = pending[0] <= ord(text[len(rest)]) <= pending[1]
                return frozenset(), fits
            if kind == "cls":
                if i == len(s):
                    return frozenset(), pending is None or class_meets(node[1], node[2], *pending)
                inside = any(lo <= ord(s[i]) <= hi for lo, hi in node[2])
                return (frozenset([i + 1]) if inside != node[1] else frozenset()), False
            if kind == "ref":
                return at(self.rules[node[1]], i)
            if kind == "alt":
                ends, prefix = set(), False
                for alt in node[1]:
                    e, p = at(alt, i)
                    ends |= e
                    prefix |= p
                return frozenset(ends), prefix
            if kind == "seq":
                here, prefix = {i}, False
                for item in node[1]:
                    after = set()
                    for p in here:
                        e, pr = at(item, p)
                        after |= e
                        prefix |= pr
                    here = after
                return frozenset(here), prefix
            if kind == "rep":
                item, least, most = node[1], node[2], node[3]
                ends, prefix = set(), False
                frontier, count = {i}, 0
                if least == 0:
                    ends |= frontier
                seen = set(frontier)
                while frontier and (most is None or count < most):
                    after = set()
                    for p in frontier:
                        e, pr = at(item, p)
                        prefix |= pr
                        after |= {x for x in e if x != p}
                    count += 1
                    if count >= least:
                        ends |= after
                    frontier = after - seen if most is None else after
                    seen |= after
                return frozenset(ends), prefix
            raise AssertionError(kind)

        return at(self.rules["root"], 0)

    def accepts(self, s: str) -> bool:
        return len(s) in self.analyse(s)[0]

    def viable(self, s: str) -> bool:
        """s is a sentence or the beginning of one."""
        ends, prefix = self.analyse(s)
        return prefix or len(s) in ends

    def complete(self, s: str) -> bool:
        """s is a sentence that nothing can extend."""
        ends, prefix = self.analyse(s)
        return len(s) in ends and not prefix

    def viable_bytes(self, b: bytes) -> bool:
        """b is UTF-8 that is a sentence or the beginning of one, also when it ends
        inside a character."""
        split = split_utf8(b)
        if split is None:
            return False
        text, pending = split
        if pending is None:
            return self.viable(text)
        return self.analyse(text, pending)[1]

    def accepts_bytes(self, b: bytes) -> bool:
        split = split_utf8(b)
        return split is not None and split[1] is None and self.accepts(split[0])

    def complete_bytes(self, b: bytes) -> bool:
        split = split_utf8(b)
        return split is not None and split[1] is None and self.complete(split[0])
