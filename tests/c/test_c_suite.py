"""Builds the C test programs under AddressSanitizer + UBSan (and the threaded ones under
ThreadSanitizer) and runs them on model files generated here, so the loader, kernels,
thread pool and ABI are checked at the C level."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import copy_file
from build_tools import find_tool

ROOT = Path(__file__).resolve().parents[2]


def _tool(name):
    return find_tool(name, "build the C tests")


def _build(tmp_path_factory, name, sanitizers):
    build = tmp_path_factory.mktemp(name)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    setup = [_tool("meson"), "setup", str(build), str(ROOT), "-Dbuild_tests=true",
             "-Dcuda=disabled", "-Dbuildtype=debugoptimized",
             f"-Db_sanitize={sanitizers}", "-Db_lundef=false"]
    subprocess.run(setup, check=True, env=env, capture_output=True, text=True)
    done = subprocess.run([_tool("ninja"), "-C", str(build), "-j2"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return build


@pytest.fixture(scope="session")
def c_build(tmp_path_factory):
    return _build(tmp_path_factory, "c-asan", "address,undefined")


@pytest.fixture(scope="session")
def c_build_tsan(tmp_path_factory):
    return _build(tmp_path_factory, "c-tsan", "thread")


@pytest.fixture(scope="session")
def c_models(tmp_path_factory):
    """A float model and a quantized looped model exercising most options, the latter with
    token frequencies, so that its drafts use a draft vocabulary."""
    d = tmp_path_factory.mktemp("c-models")
    dense = d / "dense.tinyloop"
    looped_plain = d / "looped_q4_plain.tinyloop"
    looped = d / "looped_q4.tinyloop"
    make_random_model(dense, seed=1, vocab_size=96, d_model=64, n_head=4, n_kv_head=2,
                      head_dim=16, ffn_dim=128, n_pre=2, n_core=0, n_post=0,
                      default_depth=0, max_depth=0, max_seq_len=64)
    make_random_model(looped_plain, seed=2, vocab_size=96, d_model=64, n_head=4, n_kv_head=2,
                      head_dim=16, ffn_dim=128, n_pre=1, n_core=1, n_post=1,
                      default_depth=3, max_depth=6, max_seq_len=64, dtype="q4",
                      group_size=32, injection="concat", loop_norm=True,
                      norm_placement="sandwich_outer")
    counts = np.random.default_rng(2).integers(0, 4, 96)
    copy_file(looped_plain, looped, metadata={"draft.vocab_size": 24},
              tensors={"vocab.frequency": (counts / counts.sum()).astype(np.float32)})
    return dense, looped


def _run(build, program, *args, timeout=600):
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    env["TSAN_OPTIONS"] = "halt_on_error=1"
    exe = build / "tests" / "c" / program
    done = subprocess.run([str(exe), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{program} failed:\n{out[-6000:]}"
    for report in ("ERROR: AddressSanitizer", "runtime error:", "WARNING: ThreadSanitizer"):
        assert report not in out, out[-6000:]
    return out


def test_format_c(c_build, c_models):
    out = _run(c_build, "test_format", *c_models)
    assert " 0 failed" in out


def test_loader_fuzz_c(c_build, c_models):
    out = _run(c_build, "fuzz_loader", c_models[1], 4000, 7)
    assert " 0 failed" in out


def test_kernels_c(c_build):
    out = _run(c_build, "test_kernels")
    assert " 0 failed" in out
    # a kernel path this CPU or build lacks is skipped: say so where the run is read
    for line in out.splitlines():
        if line.startswith("skip "):
            warnings.warn(f"test_kernels: {line}")


def test_api_c(c_build, c_models):
    out = _run(c_build, "test_api", *c_models)
    assert " 0 failed" in out


def test_c_example_links_only_the_shared_library(c_build, c_models):
    out = _run(c_build, "c_generate", c_models[0], 1, 2, 3)
    ids = [int(t) for t in out.split() if t.lstrip("-").isdigit()]
    assert ids, out


def test_kernels_and_thread_pool_under_thread_sanitizer(c_build_tsan):
    out = _run(c_build_tsan, "test_kernels")
    assert " 0 failed" in out


def test_api_threads_under_thread_sanitizer(c_build_tsan, c_models):
    out = _run(c_build_tsan, "test_api", c_models[1])
    assert " 0 failed" in out
