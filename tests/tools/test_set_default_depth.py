"""tools/train/set_default_depth.py: a copy with another default depth, every tensor's
bytes and all metadata unchanged; bad depths and an in-place target are refused."""

import subprocess
import sys
from pathlib import Path

import pytest

import textmodel
from tinyloop.fileformat.tinyloop_file import read_file

TOOL = Path(__file__).resolve().parents[2] / "tools" / "train" / "set_default_depth.py"


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model(model_path):
    """The text model of conftest.py: the tool reads it and must leave it as it is."""
    return model_path


def test_copy_changes_only_the_default_depth(model, tmp_path):
    out = tmp_path / "d3.tinyloop"
    proc = run_tool(model, out, "--depth", 3)
    assert proc.returncode == 0, proc.stderr
    with read_file(model) as a, read_file(out, verify_checksums=True) as b:
        assert a.dims["default_depth"] == textmodel.DIMS["default_depth"] != 3
        assert b.dims == {**a.dims, "default_depth": 3}
        assert b.metadata == a.metadata
        assert list(b.tensors) == list(a.tensors)
        for name in a.tensors:
            assert bytes(b.raw(name)) == bytes(a.raw(name)), name


@pytest.mark.parametrize("depth", [0, textmodel.MAX_DEPTH + 1])
def test_depth_outside_the_files_range_is_refused(model, tmp_path, depth):
    out = tmp_path / "bad.tinyloop"
    proc = run_tool(model, out, "--depth", depth)
    assert proc.returncode != 0
    assert "outside 1.." in proc.stderr
    assert not out.exists()


def test_writing_over_the_input_is_refused(model):
    before = model.read_bytes()
    proc = run_tool(model, model, "--depth", 1)
    assert proc.returncode != 0 and "must differ" in proc.stderr
    assert model.read_bytes() == before
