"""The library's test-only entry points (libtinyloop/src/testing/testing.h).

The released libtinyloop.so exports only what tinyloop.h declares, so the hooks live in
libtinyloop_testing.so: the same core plus testing.c. It is built here from this source
tree with meson (once: the build folder stays under build/ and later runs only rebuild
what changed) and loaded beside the release library. A hook works on the models and
contexts of its own library, so a test module that uses hooks imports the autouse
fixture `through_testing_library`: every model the module creates then loads through
the testing library. The tests declare the hooks in a cffi cdef of their own."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cffi
import pytest

from build_tools import find_tool
from tinyloop import _native

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "testing-library"
TARGET = "libtinyloop/libtinyloop_testing.so"
CUDA_LIBRARY = "libtinyloop_cuda.so"

_CDEF = """
tl_status tl_testing_sample_rows(tl_context *ctx, const float *logits, int32_t n_rows,
                                 int32_t vocab, const tl_generate_options *opts,
                                 const int32_t *history, size_t n_history,
                                 uint32_t first_step, int32_t use_op, int32_t *tokens);
int32_t tl_testing_cpu_level(int32_t which);
tl_status tl_testing_draft_logits(tl_context *ctx, int32_t token, int32_t draft_depth,
                                  float *logits, int32_t *argmax);
tl_status tl_testing_tree_logits(tl_context *ctx, const int32_t *tokens, const int32_t *parents,
                                 int32_t n_nodes, int32_t n_first, int32_t depth, float *logits);
tl_status tl_testing_grammar_masks(const tl_grammar *grammar, const int32_t *tokens, size_t n_tokens,
                                   int32_t eos, uint8_t *allowed, uint8_t *complete);
"""
_testing = None
_hooks = None


def _run(command, env):
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"


def _configured() -> bool:
    """Whether BUILD is a meson build folder of this source tree."""
    info = BUILD / "meson-info" / "meson-info.json"
    try:
        source = json.loads(info.read_text())["directories"]["source"]
    except (OSError, ValueError, KeyError):
        return False
    return Path(source).resolve() == ROOT


def _link_cuda_library(built: Path) -> None:
    """The release library's CUDA backend beside the testing library, where the core's
    loader looks for it (the testing build has no CUDA of its own)."""
    release = _native.find_library().parent
    found = [p for p in (release / CUDA_LIBRARY, release / "cuda" / CUDA_LIBRARY) if p.is_file()]
    link = built.parent / CUDA_LIBRARY
    if link.is_symlink() and (not found or link.resolve() != found[0].resolve()):
        link.unlink()
    if found and not link.is_symlink():
        link.symlink_to(found[0].resolve())


def _build() -> Path:
    meson, ninja = (find_tool(name, "build libtinyloop_testing.so") for name in ("meson", "ninja"))
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD.parent / "testing-library.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build at a time per source tree
        if not _configured():   # new, half made, or of another checkout
            shutil.rmtree(BUILD, ignore_errors=True)
            _run([meson, "setup", str(BUILD), str(ROOT), "-Dcuda=disabled", "-Dbuild_tests=false"], env)
        _run([ninja, "-C", str(BUILD), TARGET], env)
    built = BUILD / TARGET
    _link_cuda_library(built)
    return built


def testing_library():
    """The testing library's binding (tinyloop._native.Native), built on first use."""
    global _testing
    if _testing is None:
        _testing = _native.Native(_build(), ROOT / "libtinyloop" / "include" / "tinyloop" / "tinyloop.h")
    return _testing


def hooks_of(native):
    """(ffi, lib) of the test-only entry points, for objects of `native`: the testing
    library (a model created under through_testing_library)."""
    global _hooks
    if native is not testing_library():
        raise AssertionError(f"the hooks take objects of the testing library, not of {native.library_path}: "
                             "import the fixture through_testing_library into the test module")
    if _hooks is None:
        ffi = cffi.FFI()
        ffi.include(native.ffi)
        ffi.cdef(_CDEF)
        _hooks = (ffi, ffi.dlopen(str(native.library_path)))
    return _hooks


@pytest.fixture(scope="module", autouse=True)
def through_testing_library():
    """Every model the importing module creates loads through the testing library."""
    testing = testing_library()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_native, "get", lambda: testing)
        yield testing
