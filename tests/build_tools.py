"""Locating the build tools (meson, ninja) the [test] extra installs next to python."""

import shutil
import sys
from pathlib import Path

import pytest


def find_tool(name, purpose):
    """Path of `name` beside the running interpreter or on PATH; fails the test (never
    skips) when it is missing, saying what it was needed for."""
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is needed to {purpose}; install the [test] extra")
    return found
