"""Integer and decimal ranges as GBNF, for tinyloop.grammar.json_schema's numeric bounds.

Digit-interval decomposition: the texts of the numbers in a range are split by their
count of integer digits, and a run of digit strings between two bounds is written as
"the first digit strictly between the bounds' first digits, then any digits", plus the
two edge digits followed by what the rest of each bound allows (recursively). Full runs
of lengths collapse to `[1-9]` and a bounded repetition, so a range costs rules in
proportion to its bounds' digit counts, not to its size.

`rules` is the converter writing the grammar: `rule(hint, body)` names a body (equal
bodies share one name), `repeat(hint, item, lo, hi)` writes lo..hi repetitions and
`use(name)` pulls in a base rule (`digit`, `fraction`)."""

from __future__ import annotations

from decimal import Decimal
from typing import Protocol, cast

from .gbnf_text import alternatives, seq


class Rules(Protocol):
    """What the ranges need of the converter writing the grammar."""

    def rule(self, hint: str, body: str) -> str: ...

    def repeat(self, hint: str, item: str, lo: int, hi: int | None) -> str: ...

    def use(self, name: str) -> str: ...

#: digits after the point of a bounded number, as the base rule `fraction`
FRACTION_DIGITS = 16


def _digit_class(lo: int, hi: int) -> str:
    return f'"{lo}"' if lo == hi else f"[{lo}-{hi}]"


def _any(rules: Rules, lo: int, hi: int) -> str:
    return rules.repeat("digits", rules.use("digit"), lo, hi)


def _edge(rules: Rules, digit: int, tail: str) -> str:
    """`digit` then `tail`; a long tail gets a rule (one a level, rather than a deep nest)."""
    return seq(f'"{digit}"', rules.rule("digits-tail", tail) if len(tail) > 60 else tail)


def digits_between(rules: Rules, low: str, high: str | None, min_len: int, max_len: int) -> str | None:
    """An expression for the digit strings s, min_len <= len(s) <= max_len, with
    low <= s <= high (high None: no upper bound) where all three compare as if padded
    with zeros on the right: numeric order for strings of one length, order of value for
    the digits after a decimal point. None when no string fits. len(low) and len(high)
    are at most max_len."""
    if high is not None and high[:max_len] == "9" * max_len:
        high = None                      # nothing of max_len digits or fewer is above it
    if not low.strip("0") and high is None:
        return _any(rules, min_len, max_len)
    if not low.strip("0") and not cast(str, high).strip("0"):
        return rules.repeat("zeros", '"0"', min_len, max_len)
    alts = ['""'] if min_len == 0 and not low.strip("0") else []
    if max_len:
        a = int(low[0]) if low else 0
        b = 9 if high is None else int(high[0]) if high else 0
        rest_low, rest_high = low[1:], None if high is None else high[1:]
        n0, n1 = max(min_len - 1, 0), max_len - 1
        if a == b:
            tail = digits_between(rules, rest_low, rest_high, n0, n1)
            if tail is not None:
                alts.append(_edge(rules, a, tail))
        elif a < b:
            # the edge digits join the middle class when the rest of their bound is no bound
            mid_lo = a if not rest_low.strip("0") else a + 1
            mid_hi = b if rest_high is None or rest_high[:n1] == "9" * n1 else b - 1
            if mid_lo > a:
                tail = digits_between(rules, rest_low, None, n0, n1)
                if tail is not None:
                    alts.append(_edge(rules, a, tail))
            if mid_lo <= mid_hi:
                alts.append(seq(_digit_class(mid_lo, mid_hi), _any(rules, n0, n1)))
            if mid_hi < b:
                tail = digits_between(rules, "", rest_high, n0, n1)
                if tail is not None:
                    alts.append(_edge(rules, b, tail))
    return alternatives(alts)


def natural_range(rules: Rules, lo: int, hi: int) -> str:
    """The decimal texts (no leading zeros) of the integers lo..hi, 0 <= lo <= hi."""
    alts: list[str | None] = []
    full: tuple[int, int] | None = None   # a run of lengths whose every number is in
    if lo == 0:
        alts.append('"0"')
        lo = 1
    for n in range(len(str(lo)), len(str(hi)) + 1) if lo <= hi else ():
        a, b = max(lo, 10 ** (n - 1)), min(hi, 10 ** n - 1)
        if (a, b) == (10 ** (n - 1), 10 ** n - 1):
            full = (full[0] if full else n, n)
            continue
        if full:
            alts.append(seq("[1-9]", rules.repeat("digits", rules.use("digit"), full[0] - 1, full[1] - 1)))
            full = None
        alts.append(digits_between(rules, str(a), str(b), n, n))
    if full:
        alts.append(seq("[1-9]", rules.repeat("digits", rules.use("digit"), full[0] - 1, full[1] - 1)))
    # lo <= hi: some text fits
    return cast(str, alternatives(alts))


def integer_range(rules: Rules, lo: int, hi: int) -> str:
    """The JSON texts of the integers lo..hi (lo <= hi), without a negative zero."""
    alts: list[str | None] = []
    if lo < 0:
        alts.append(f'"-" {natural_range(rules, max(-hi, 1), -lo)}')
    if hi >= 0:
        alts.append(natural_range(rules, max(lo, 0), hi))
    return cast(str, alternatives(alts))


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and the digits after its point (no
    trailing zeros)."""
    whole, _, frac = format(value, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _fraction(rules: Rules, low: str, high: str | None) -> str | None:
    """An optional fraction ("." and 1 to FRACTION_DIGITS digits) whose value lies in
    [0.low, 0.high] (high None: below 1)."""
    if not low and high is None:
        return f"{rules.use('fraction')}?"
    digits = digits_between(rules, low, high, 1, FRACTION_DIGITS)
    alts = ['""'] if not low else []
    if digits is not None:
        alts.append(f'"." {digits}')
    return alternatives(alts)


def magnitude_range(rules: Rules, lo: Decimal, hi: Decimal | None, int_digits: int) -> str | None:
    """The texts `I ("." F)?` (I without leading zeros, of at most int_digits digits; F
    of at most FRACTION_DIGITS) whose value lies in [lo, hi] (hi None: any of those
    texts at or above lo). lo >= 0 and hi have at most FRACTION_DIGITS places."""
    lo_int, lo_frac = _split(lo)
    hi_int, hi_frac = (10 ** int_digits - 1, None) if hi is None else _split(hi)
    if lo_int == hi_int:
        frac = _fraction(rules, lo_frac, hi_frac)
        return None if frac is None else seq(f'"{lo_int}"', frac)
    any_frac = _fraction(rules, "", None)
    top = _fraction(rules, "", hi_frac)
    first = lo_int if not lo_frac else lo_int + 1
    last = hi_int if top == any_frac else hi_int - 1
    alts: list[str | None] = []
    if lo_frac:
        alts.append(seq(f'"{lo_int}"', cast(str, _fraction(rules, lo_frac, None))))
    if first <= last:
        alts.append(seq(natural_range(rules, first, last), cast(str, any_frac)))
    if last < hi_int and top is not None:
        alts.append(seq(f'"{hi_int}"', top))
    return alternatives(alts)


def number_range(rules: Rules, lo: Decimal | None, hi: Decimal | None, int_digits: int) -> str | None:
    """The JSON texts without an exponent, and without a negative zero, whose value lies
    in [lo, hi] (None: unbounded on that side, within int_digits integer digits). The
    bounds have at most FRACTION_DIGITS places. None when no text fits."""
    alts: list[str | None] = []
    smallest = Decimal(1).scaleb(-FRACTION_DIGITS)
    if lo is None or lo < 0:
        below = max(-hi, smallest) if hi is not None and hi < 0 else smallest
        neg = magnitude_range(rules, below, None if lo is None else -lo, int_digits)
        if neg is not None:
            alts.append(f'"-" {neg}')
    if hi is None or hi >= 0:
        pos = magnitude_range(rules, max(lo, Decimal(0)) if lo is not None else Decimal(0), hi, int_digits)
        if pos is not None:
            alts.append(pos)
    return alternatives(alts)
