"""tools/build_wheels: the CPU wheel it builds installs into a fresh venv with no compiler
on PATH and generates text with the default model it carries (docs/install.md, "Wheels").

Part of the default run (docs/testing.md, "The wheel"): the wheel is built once per
session into pytest's tmp folder, about a minute of the run on CI's 2 cores. A wheel
already built is tested instead when $TINYLOOP_WHEEL names it."""

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="manylinux wheels are Linux's"),
]

REPO = Path(__file__).resolve().parents[2]
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "nvcc")
# what could point the installed package back at a checkout or a compiler
DROPPED = {"PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CC", "CXX", "CPP", "LD",
           "CFLAGS", "LDFLAGS", "CUDACXX", "NVCC", "CUDA_HOME", "CUDA_PATH"}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    given = os.environ.get("TINYLOOP_WHEEL")
    if given:
        return Path(given)
    root = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, PYTHON=sys.executable, TINYLOOP_WHEEL_TOOLS=str(root / "tools"))
    proc = subprocess.run([str(REPO / "tools" / "build_wheels"), "-o", str(root / "dist")],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = list((root / "dist").glob("*.whl"))
    assert len(built) == 1, built
    return built[0]


def test_wheel_is_one_manylinux_cpu_wheel_for_every_cpython(wheel):
    assert re.fullmatch(r"tinyloop_runtime-[^-]+-py3-none-manylinux_\d+_\d+_x86_64\.whl",
                        wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "tinyloop/libtinyloop.so" in names
    assert "tinyloop/models/tinyloop-smollm2-looped.tinyloop" in names
    assert not [n for n in names if "tinyloop_cuda" in n], "the CPU wheel carries no CUDA library"


def test_wheel_installs_and_generates_without_a_compiler(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in DROPPED and not k.startswith("TINYLOOP_")}
    env["PATH"] = str(bin_dir)
    assert not [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]

    def run(*cmd, timeout=600):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    # --only-binary: no dependency may fall back to a source build either
    run(str(bin_dir / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:", str(wheel))
    where = run(str(bin_dir / "python"), "-c", "import tinyloop; print(tinyloop.__file__)")
    assert Path(where.strip()).is_relative_to(env_dir), where
    text = run(str(bin_dir / "tinyloop"), "generate", "Once upon a time", "--max-tokens", "12",
               "--temperature", "0", "--threads", "2", timeout=120)
    assert len(text.strip()) > 0, text
