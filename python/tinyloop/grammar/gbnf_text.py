"""Pieces of GBNF text (docs/api.md "Grammars"), for the modules that write grammars
(tinyloop.grammar.json_schema and its number and pattern parts)."""

from __future__ import annotations

import re
from typing import Iterable

_LITERAL_OR_CLASS = r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'
_PRIMARY = re.compile(r'[\w-]+|' + _LITERAL_OR_CLASS)


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    out = []
    for ch in text:
        cp = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= cp < 0x7f:
            out.append(ch)
        elif cp <= 0xffff:
            out.append(f"\\u{cp:04X}")
        else:
            out.append(f"\\U{cp:08X}")
    return '"' + "".join(out) + '"'


def seq(*parts: str) -> str:
    """The parts one after another (empty literals left out)."""
    kept = [p for p in parts if p != '""']
    return " ".join(kept) if kept else '""'


def alternatives(exprs: Iterable[str | None]) -> str | None:
    """The distinct expressions as one alternative (None when there are none)."""
    distinct = list(dict.fromkeys(e for e in exprs if e is not None))
    if not distinct:
        return None
    return distinct[0] if len(distinct) == 1 else "( " + " | ".join(distinct) + " )"


def group(expr: str) -> str:
    """`expr` as one primary (a name, a literal or a class as it is, else parenthesised),
    ready for a repetition operator."""
    return expr if _PRIMARY.fullmatch(expr) else f"( {expr} )"


def names(body: str) -> list[str]:
    """The rule names a rule body refers to."""
    return re.findall(r"[\w-]+", re.sub(_LITERAL_OR_CLASS, " ", body))
