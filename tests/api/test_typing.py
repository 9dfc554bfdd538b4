"""The package is typed (PEP 561): py.typed is installed with it, and a client using the
public API (typed_client.py) passes `mypy --strict`, the package's own modules that the
client reaches included."""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import tinyloop

HERE = Path(__file__).resolve().parent

# internal modules the public API reaches that are not annotated yet: checked for the
# types they give, their own errors not reported (docs/python.md, "Types")
UNCHECKED = ["tinyloop.convert.*", "tinyloop.fileformat.*"]


def test_py_typed_is_installed():
    # under an editable install the package's resources are meson's install plan, so this
    # also checks that meson.build installs the marker
    assert importlib.resources.files("tinyloop").joinpath("py.typed").is_file()


def test_strict_client_type_checks(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("SKIPPED LOUDLY: mypy is not installed (pip install 'tinyloop[test]' has it); "
                    "the public API's annotations were not checked")
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\nwarn_unused_configs = True\n"
                      f"cache_dir = {tmp_path / 'cache'}\n\n"
                      f"[mypy-{','.join(UNCHECKED)}]\nfollow_imports = silent\n")
    env = dict(os.environ)
    package_root = Path(tinyloop.__file__).resolve().parent.parent
    site_dirs = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    if package_root not in site_dirs:
        # a source checkout (an editable install's loader is invisible to mypy): its
        # modules are then checked as sources, their errors reported
        env["MYPYPATH"] = str(package_root)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config),
                           str(HERE / "typed_client.py")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
