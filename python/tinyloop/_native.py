"""cffi (ABI mode) binding of libtinyloop.

The declarations come from the real public header, between the TL_CDEF_BEGIN and
TL_CDEF_END markers, so the binding can never drift from the C ABI. The library is
opened lazily on first use, which keeps `import tinyloop` (config, plugins, CLI
parsing) working where the shared library is absent.

Where things are looked up, first match wins:
  library: $TINYLOOP_LIBRARY, then libtinyloop.so inside the installed package;
  header:  $TINYLOOP_HEADER, the package's include/tinyloop/tinyloop.h, the
           include/ folder next to the library, then the source checkout.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

from . import _log
from .errors import LibraryNotFoundError, error_for_status

_CDEF_BEGIN = "/* TL_CDEF_BEGIN */"
_CDEF_END = "/* TL_CDEF_END */"
_HEADER_RELPATH = Path("include") / "tinyloop" / "tinyloop.h"

if sys.platform == "darwin":
    _LIBRARY_NAME = "libtinyloop.dylib"
elif sys.platform == "win32":
    _LIBRARY_NAME = "tinyloop.dll"
else:
    _LIBRARY_NAME = "libtinyloop.so"


def extract_cdef(header_text: str) -> str:
    """The cffi cdef of the header: its TL_CDEF region without the TL_API markers."""
    start = header_text.find(_CDEF_BEGIN)
    end = header_text.find(_CDEF_END)
    if start < 0 or end < 0 or end < start:
        raise LibraryNotFoundError("tinyloop.h has no TL_CDEF_BEGIN ... TL_CDEF_END region")
    region = header_text[start + len(_CDEF_BEGIN):end]
    return re.sub(r"\bTL_API\b", "", region)


def _package_file(relpath: Path) -> Path | None:
    """A file installed inside the tinyloop package. Under meson-python's editable
    loader the package's resources map to real paths in the build directory."""
    try:
        ref = importlib.resources.files("tinyloop").joinpath(*relpath.parts)
    except (ModuleNotFoundError, TypeError):
        ref = None
    if isinstance(ref, Path) and ref.is_file():
        return ref
    # a shared library cannot be loaded from a zip, so only real files count
    local = Path(__file__).resolve().parent / relpath
    return local if local.is_file() else None


def _env_file(variable: str) -> "Path | None":
    """The file an environment variable points at (None when unset); a clear error when
    it names no file."""
    value = os.environ.get(variable)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise LibraryNotFoundError(f"{variable}={value}: no such file")
    return path


def find_library() -> Path:
    override = _env_file("TINYLOOP_LIBRARY")
    if override:
        return override
    path = _package_file(Path(_LIBRARY_NAME))
    if path is None:
        raise LibraryNotFoundError(
            f"{_LIBRARY_NAME} not found in the tinyloop package; reinstall tinyloop-runtime "
            "or point TINYLOOP_LIBRARY at the built library")
    return path


def find_header(library: Path) -> Path:
    override = _env_file("TINYLOOP_HEADER")
    if override:
        return override
    source_checkout = Path(__file__).resolve().parents[2] / "libtinyloop" / _HEADER_RELPATH
    candidates = [_package_file(_HEADER_RELPATH), library.parent / _HEADER_RELPATH,
                  source_checkout]
    for path in candidates:
        if path is not None and path.is_file():
            return path
    raise LibraryNotFoundError("tinyloop/tinyloop.h not found in the tinyloop package; "
                               "set TINYLOOP_HEADER to the header of the library")


class Native:
    """The opened library: `ffi` (cffi.FFI) and `lib` (its functions)."""

    def __init__(self, library: Path, header: Path):
        import cffi  # type: ignore[import-untyped]  # imported here so that tools without cffi can still import tinyloop

        self.library_path = library
        self.header_path = header
        self.ffi: Any = cffi.FFI()
        self.ffi.cdef(extract_cdef(header.read_text(encoding="utf-8")))
        try:
            self.lib: Any = self.ffi.dlopen(str(library))
        except OSError as e:
            raise LibraryNotFoundError(f"cannot load {library}: {e}") from None
        got = int(self.lib.tl_abi_version())
        want = int(self.lib.TL_ABI_VERSION)
        if got != want:
            raise LibraryNotFoundError(
                f"{library} has ABI version {got}, but the header {header} declares "
                f"{want}; the library and the Python package do not match")
        self.log_forwarder = _log.install(self.ffi, self.lib)

    def last_error(self) -> str:
        return str(self.ffi.string(self.lib.tl_last_error()).decode("utf-8", "replace"))

    def check(self, status: int) -> None:
        """Raise the TinyLoopError subclass of a failed call with the C message.

        Must run on the thread that made the call: the message is thread-local."""
        if status != 0:
            raise error_for_status(int(status), self.last_error())

    def version(self) -> str:
        return str(self.ffi.string(self.lib.tl_version_string()).decode("utf-8", "replace"))


_native: Native | None = None
_lock = threading.Lock()


def get() -> Native:
    """The process-wide binding, opened on first call."""
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                library = find_library()
                _native = Native(library, find_header(library))
    return _native
