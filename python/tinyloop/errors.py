"""Exceptions raised by tinyloop.

Every error is a `TinyLoopError`. Errors that come from the C library carry the
`tl_status` code in `.status` and the library's message (`tl_last_error()`) as the
exception text; errors raised by Python code (file writers, config, plugins) have
`.status` None. Some classes also derive from the matching builtin exception so that
generic handlers (`except ValueError`, `except MemoryError`) keep working.
"""

from __future__ import annotations


class TinyLoopError(Exception):
    """Base class of every tinyloop error."""

    #: the tl_status code this class stands for (None: raised by Python code)
    status_code: int | None = None

    def __init__(self, message: str = "", status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status if status is not None else self.status_code


class InvalidArgumentError(TinyLoopError, ValueError):
    """A bad pointer, size, option value or token id (TL_ERR_INVALID_ARGUMENT)."""

    status_code = 1


class ModelIOError(TinyLoopError):
    """A file could not be opened, read or mapped (TL_ERR_IO)."""

    status_code = 2


class FileFormatError(TinyLoopError):
    """A .tinyloop file (or data about to be written into one) is invalid (TL_ERR_FORMAT)."""

    status_code = 3


#: the name used by the file writer/reader (tinyloop.fileformat)
FormatError = FileFormatError


class OutOfMemoryError(TinyLoopError, MemoryError):
    """An allocation failed (TL_ERR_OUT_OF_MEMORY)."""

    status_code = 4


class UnsupportedError(TinyLoopError):
    """A valid request this build or device cannot serve, e.g. CUDA without a GPU
    (TL_ERR_UNSUPPORTED)."""

    status_code = 5


class ContextFullError(TinyLoopError):
    """The sequence would exceed the context's max_seq_len (TL_ERR_CONTEXT_FULL)."""

    status_code = 6


class BackendError(TinyLoopError):
    """The compute backend failed (TL_ERR_BACKEND)."""

    status_code = 7


class AbortedError(TinyLoopError):
    """A callback asked to stop (TL_ERR_ABORTED)."""

    status_code = 8


class NotImplementedYetError(TinyLoopError, NotImplementedError):
    """The call is part of the ABI but not available in this release (TL_ERR_NOT_IMPLEMENTED)."""

    status_code = 9


class InternalError(TinyLoopError):
    """A bug in the library (TL_ERR_INTERNAL)."""

    status_code = 10


class ConfigError(TinyLoopError, ValueError):
    """A tinyloop.toml file or a mode configuration is invalid.

    `.key` is the dotted key at fault (e.g. "sampling.top_p"), `.source` the file and
    `.line` its line when known; the message already names all three."""

    def __init__(self, message: str = "", *, key: str | None = None, source: str | None = None,
                 line: int | None = None):
        super().__init__(message)
        self.key = key
        self.source = source
        self.line = line


class PluginError(TinyLoopError):
    """A plugin is malformed or registered twice."""


class LibraryNotFoundError(TinyLoopError, ImportError):
    """libtinyloop.so or its header could not be found or does not match this package."""


_BY_STATUS = {cls.status_code: cls for cls in (
    InvalidArgumentError, ModelIOError, FileFormatError, OutOfMemoryError, UnsupportedError,
    ContextFullError, BackendError, AbortedError, NotImplementedYetError, InternalError)}


def error_for_status(status: int, message: str) -> TinyLoopError:
    """The exception for a non-zero tl_status, carrying the C library's message."""
    cls = _BY_STATUS.get(status, TinyLoopError)
    return cls(message or f"tinyloop call failed with status {status}", status)
