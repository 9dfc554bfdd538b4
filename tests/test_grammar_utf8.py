"""The reference matcher on bytes (tests/reference/grammar.py): text made of tokens may
end inside a character, which stands for the code points that can complete it; the
premise that those are an interval, found by trying completions, is checked on every
code point."""

from reference import grammar as ref_grammar


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
