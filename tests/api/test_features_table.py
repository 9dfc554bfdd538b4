"""docs/features.md names real things: every row fills every column, and outside the rows
marked (planned) each C name is in tinyloop.h, each `Model.x` / `Context.x` exists, each
CLI flag is a flag of some command, each TOML key a key, each mode a mode, each test file
a file. Removing a row's (planned) mark makes this test check it."""

import argparse
import re
from pathlib import Path

import pytest

import tinyloop
from tinyloop.cli import build_parser
from tinyloop.config import EXIT_OPTIONS, MODEL_OPTIONS, SAMPLING_OPTIONS
from tinyloop.plugins import default_registry

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "features.md"
HEADER = ROOT / "libtinyloop" / "include" / "tinyloop" / "tinyloop.h"
#: what a Model sets in __init__ rather than on the class
INSTANCE_ATTRIBUTES = {"info", "path", "modes"}
COLUMNS = ["feature", "C call", "Python", "CLI", "TOML", "server", "test"]


def _rows():
    lines = [line for line in TABLE.read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]


def _flags() -> set:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for p in sub.choices.values() for a in p._actions for flag in a.option_strings}


def test_every_row_fills_every_column():
    rows = _rows()
    assert len(rows) > 30
    for row in rows:
        assert len(row) == len(COLUMNS) and all(row), row


def test_the_rows_name_what_exists():
    if not HEADER.exists():
        pytest.skip("needs the source tree")
    header = HEADER.read_text(encoding="utf-8")
    flags, keys = _flags(), {f"{section}.{o.name}" for section, options in
                             (("model", MODEL_OPTIONS), ("sampling", SAMPLING_OPTIONS), ("exit", EXIT_OPTIONS))
                             for o in options}
    modes = set(default_registry().names())
    for feature, c_call, python, cli, toml, server, test in _rows():
        if "(planned)" in feature:
            continue
        for name in re.findall(r"\btl_[a-z0-9_]+", c_call):
            assert name in header, (feature, name)
        for cls, attr in re.findall(r"`(Model|Context)\.([a-z_]+)", python):
            assert hasattr(getattr(tinyloop, cls), attr) or attr in INSTANCE_ATTRIBUTES, (feature, cls, attr)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", cli):
            assert flag in flags, (feature, flag)
        for key in re.findall(r"`((?:model|sampling|exit)\.[a-z_]+)", toml):
            assert key in keys, (feature, key)
        for mode in re.findall(r"\[modes\.([a-z_]+)\]", toml):
            assert mode in modes, (feature, mode)
        for path in re.findall(r"tests/[\w/]+\.py", test):
            assert (ROOT / path).exists(), (feature, path)
