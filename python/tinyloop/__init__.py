"""TinyLoop: fast inference for weight-shared looped transformers.

    import tinyloop
    with tinyloop.Model("model.tinyloop") as model:
        print(model.generate("Once upon a time", max_tokens=32).text)

The shared library is opened on first use, so configuration, plugins and the CLI's
argument parsing work without it. See docs/python.md.
"""

from .aio import AsyncModel, AsyncStream
from .config import Config, load_config
from .errors import (AbortedError, BackendError, ConfigError, ContextFullError, FileFormatError,
                     FormatError, InternalError, InvalidArgumentError, LibraryNotFoundError,
                     ModelIOError, NotImplementedYetError, OutOfMemoryError, PluginError,
                     TinyLoopError, UnsupportedError)
from .exit_rule import ExitRule, ExitRuleError
from .grammar import Grammar, SchemaError, json_schema_to_gbnf
from .model import Context, GenerateResult, Model, ModelInfo, TokenLogprob, TokenStream, TopLogprob
from .prefix import PrefixCache, PrefixPool, ResumeHandle
from .tokenizer import IncrementalDecoder, Tokenizer

__version__ = "0.1.0"


def library_version() -> str:
    """The version string of the loaded libtinyloop."""
    from . import _native
    return _native.get().version()


__all__ = [
    "AsyncModel", "AsyncStream", "Grammar", "SchemaError", "json_schema_to_gbnf",
    "AbortedError", "BackendError", "Config", "ConfigError", "Context", "ContextFullError",
    "ExitRule", "ExitRuleError",
    "FileFormatError", "FormatError", "GenerateResult", "IncrementalDecoder", "InternalError",
    "InvalidArgumentError", "LibraryNotFoundError", "Model", "ModelIOError", "ModelInfo",
    "NotImplementedYetError", "OutOfMemoryError", "PluginError", "PrefixCache", "PrefixPool", "ResumeHandle",
    "TinyLoopError",
    "TokenLogprob", "TokenStream", "Tokenizer", "TopLogprob", "UnsupportedError", "library_version", "load_config",
]
