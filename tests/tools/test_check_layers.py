"""tools/check_layers: the repository keeps its layers (docs/architecture.md), and the
tool reports each kind of break on small trees made here."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "check_layers"

def run_tool(*args, root=None):
    cmd = [sys.executable, str(TOOL), *args]
    if root is not None:
        cmd += ["--root", str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def test_c_sources_are_layered():
    rc, out = run_tool("--check", "c")
    assert rc == 0, out


def test_python_package_is_layered():
    rc, out = run_tool("--check", "python")
    assert rc == 0, out


def test_library_exports_only_the_header():
    rc, out = run_tool("--check", "exports")
    assert rc == 0, out


def test_report_never_fails_and_prints_the_metrics():
    rc, out = run_tool("--report", "--check", "c,python")
    assert rc == 0, out
    assert out.startswith("C: ") and "levels" in out and "\nPython: " in out


# ---- small trees --------------------------------------------------------------------

def write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


SRC = "libtinyloop/src/"

# A layered library that breaks nothing: lower layers are included and called from above.
CLEAN_C = {
    SRC + "base/error.h": "int tl_fail(int st);\n",
    SRC + "base/error.c": """\
        #include "error.h"
        /* a comment that mentions tl_generate_step() counts for nothing */
        int tl_fail(int st) { const char *s = "tl_generate_step()"; (void)s; return st; }
        """,
    SRC + "decode/generate.h": '#include "tinyloop/tinyloop.h"\nint tl_generate_step(void);\n',
    SRC + "decode/generate.c": """\
        #include "generate.h"
        #include "base/error.h"
        static int helper(void) { return 1; }
        int tl_generate_step(void) { return tl_fail(helper()); }
        """,
    SRC + "cpu/kernels.c": "static int helper(void) { return 2; }\n"
                           "int tl_k(void) { return helper(); }\n",
}

CLEAN_PY = {
    "python/tinyloop/__init__.py": "from .model import Model\n",
    "python/tinyloop/errors.py": "class TinyLoopError(Exception):\n    pass\n",
    "python/tinyloop/model.py": """\
        from typing import TYPE_CHECKING
        from .errors import TinyLoopError
        if TYPE_CHECKING:
            from .server import Server   # never runs: not a dependency
        class Model:
            pass
        """,
    "python/tinyloop/server.py": "from . import model\nfrom tinyloop.errors import TinyLoopError\n",
    "python/tinyloop/cli.py": "def main():\n    from .server import Server\n",
}


def check(tmp_path, files, checks="c,python"):
    write(tmp_path, {**CLEAN_C, **CLEAN_PY, **files})
    return run_tool("--check", checks, root=tmp_path)


def test_clean_tree_passes(tmp_path):
    rc, out = check(tmp_path, {})
    assert rc == 0, out
    assert "C: 3 modules, 2 levels, 0 upward includes, 0 upward references, 0 circles" in out
    assert "Python: 5 modules" in out and "0 imports against the layers, 0 circles" in out


def test_flat_files_take_their_layer_from_the_map(tmp_path):
    write(tmp_path, {
        SRC + "error.h": "int tl_fail(int st);\n",
        SRC + "error.c": '#include "error.h"\n#include "generate.h"\n'
                         "int tl_fail(int st) { return st; }\n",
        SRC + "generate.h": "int tl_generate_step(void);\n",
    })
    rc, out = run_tool("--check", "c", root=tmp_path)
    assert rc == 1
    assert ('libtinyloop/src/error.c:2: includes "generate.h": '
            "base (error) -> decode (generate)") in out


# Each break of the layers in a small tree, and what the tool says about it.
BREAKS = {
    "upward include": ({
        SRC + "base/error.c": '#include "error.h"\n#include "decode/generate.h"\n'
                              "int tl_fail(int st) { return st; }\n",
    }, ['FAIL libtinyloop/src/base/error.c:2: includes "decode/generate.h": '
        "base (base/error) -> decode (decode/generate)", "1 upward includes"]),
    # no include between the two: each declares the other's function itself
    "circle through calls": ({
        SRC + "runtime/context.c": "int tl_forward(int);\n"
                                   "int tl_context_eval(int n) { return n ? tl_forward(n - 1) : 0; }\n",
        SRC + "runtime/forward.c": "int tl_context_eval(int);\n"
                                   "int tl_forward(int n) { return tl_context_eval(n); }\n",
    }, ["FAIL C: circle: runtime/context <-> runtime/forward", "1 circles (of 2 modules)"]),
    "upward call without include": ({
        SRC + "base/error.c": "int tl_generate_step(void);\n"
                              "int tl_fail(int st) { return st + tl_generate_step(); }\n",
    }, ["FAIL libtinyloop/src/base/error.c: references tl_generate_step: "
        "base (base/error) -> decode (decode/generate)", "circle: base/error <-> decode/generate"]),
    "import against the layers": ({
        "python/tinyloop/errors.py": "def fail():\n    from .server import Server\n",
    }, ["FAIL python/tinyloop/errors.py:2: imports tinyloop.server: "
        "binding (tinyloop.errors) -> server (tinyloop.server)"]),
    "import circle": ({
        "python/tinyloop/tokenizer.py": "from . import model\n",
        "python/tinyloop/model.py": "def load():\n    from tinyloop.tokenizer import Tokenizer\n",
    }, ["FAIL Python: circle: tinyloop.model <-> tinyloop.tokenizer"]),
    "unmapped module": ({
        SRC + "mystery.c": "int tl_m(void) { return 0; }\n",
    }, ["FAIL mystery: no layer for this module"]),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_break_is_reported(tmp_path, name):
    files, messages = BREAKS[name]
    rc, out = check(tmp_path, files)
    assert rc == 1, out
    for message in messages:
        assert message in out
    # --report prints the same notes and succeeds
    rc, out = run_tool("--report", "--check", "c,python", root=tmp_path)
    assert rc == 0 and messages[0].replace("FAIL", "NOTE", 1) in out


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("nm")), reason="needs cc and nm")
def test_undeclared_export(tmp_path):
    write(tmp_path, {
        "libtinyloop/include/tinyloop/tinyloop.h": "int tl_declared(void);\n",
        "lib.c": "int tl_declared(void) { return 1; }\nint tl_testing_hook(void) { return 2; }\n"
                 "static int hidden(void) { return 3; }\nint (*tl_hook_ptr)(void) = hidden;\n",
    })
    lib = tmp_path / "libtinyloop.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "lib.c")], check=True)
    rc, out = run_tool("--check", "exports", "--lib", str(lib), root=tmp_path)
    assert rc == 1
    assert "exports tl_testing_hook, which tinyloop/tinyloop.h does not declare" in out
    assert "exports tl_hook_ptr," in out          # data counts too
    assert "tl_declared," not in out and "hidden" not in out
    assert "2 exported but not declared" in out
