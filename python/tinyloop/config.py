"""tinyloop.toml: model, sampling defaults and runtime modes.

    [model]
    path = "models/smollm2-135m.tinyloop"   # relative to this file, or a pulled name
    device = "cpu"
    threads = 0                             # 0 = all cores
    max_seq_len = 0                         # 0 = the model's
    depth = 0                               # loop depth; 0 = the model's default
    verify_checksums = false                # check every tensor's CRC-32 when loading
    kv_dtype = "default"                    # KV cache elements: f32 | f16 | default
    prefill_chunk = 0                       # prompt tokens per forward pass; 0 = the library's
    cache_window = 0                        # keep only the last N positions' K/V; 0 = off
    cache_window_approx = false             # allow a window narrower than the model's attention
    state_init = "file"                     # loop start: file (the file's) | warm

    [sampling]
    temperature = 0.8
    top_k = 40
    top_p = 0.95
    min_p = 0.05
    repetition_penalty = 1.0
    seed = 0
    max_tokens = 128
    stop = ["###"]                          # the text ends before the first of these

    [exit]                                  # adaptive depth (docs/python.md, "Adaptive depth")
    rule = "kl"                             # fixed, kl, entropy_delta, latent_delta,
    threshold = 1e-3                        #   argmax_stable (patience) or gate
    min_depth = 1
    patience = 2

    [modes.<name>]                          # switches a plugin on; keys = its options

Every key is checked: an unknown key, a wrong type or a bad value raises ConfigError
naming the key, the file and (when it can be found) the line. docs/config.md is the
user documentation.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigError
from .exit_rule import EXIT_KINDS, ExitRule, ExitRuleError
from .plugins import (ActiveMode, ErrorFactory, Option, PluginRegistry, apply_load_hooks, default_registry,
                      plain_error)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_INT32_MAX = 2**31 - 1

MODEL_OPTIONS = (
    Option("path", str, None, "model file, or a name cached by `tinyloop pull`"),
    Option("device", str, "cpu", "cpu, cuda, cuda:N or auto"),
    Option("threads", int, 0, "CPU threads; 0 = all cores", minimum=0, maximum=_INT32_MAX),
    Option("max_seq_len", int, 0, "context length; 0 = the model's", minimum=0,
           maximum=_INT32_MAX),
    Option("depth", int, 0, "loop depth; 0 = the model's default", minimum=0,
           maximum=_INT32_MAX),
    Option("verify_checksums", bool, False, "check every tensor's CRC-32 when loading"),
    Option("kv_dtype", str, "default", "KV cache elements: f32, f16, or default (f16 on CUDA, f32 on the CPU)",
           choices=("default", "f32", "f16")),
    Option("prefill_chunk", int, 0, "prompt tokens per forward pass; 0 = the library's choice",
           minimum=0, maximum=_INT32_MAX),
    Option("cache_window", int, 0, "keep only the last N positions' K/V per layer, in a ring (sequences go on "
           "past max_seq_len); 0 = off", minimum=0, maximum=_INT32_MAX),
    Option("cache_window_approx", bool, False, "allow cache_window on a model whose attention sees more "
           "positions (approximate)"),
    Option("state_init", str, "file", "where each position's loop starts: file (the file's "
           "loop.state_init) or warm (the previous position's final loop state)",
           choices=("file", "warm")),
)


class _StopOption(Option):
    """sampling.stop: a list of non-empty strings (OpenAI's stop), checked into a tuple."""

    def check(self, value: Any, key: str, error: ErrorFactory = plain_error) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise error(key, f"expected a list of strings, got {type(value).__name__} {value!r}")
        for i, text in enumerate(value):
            if not text:
                raise error(key, f"stop string {i} is empty")
        return tuple(value)


SAMPLING_OPTIONS = (
    Option("temperature", float, 0.8, "0 = greedy", minimum=0.0),
    Option("top_k", int, 40, "0 = off", minimum=0, maximum=_INT32_MAX),
    Option("top_p", float, 0.95, "1 = off", minimum=0.0, maximum=1.0, exclusive_minimum=True),
    Option("min_p", float, 0.05, "0 = off; below 1", minimum=0.0, maximum=1.0,
           exclusive_maximum=True),
    Option("repetition_penalty", float, 1.0, "1 = off", minimum=0.0, exclusive_minimum=True),
    Option("seed", int, 0, "sampling seed", minimum=0, maximum=2**64 - 1),
    Option("max_tokens", int, 128, "new tokens at most", minimum=1, maximum=_INT32_MAX),
    _StopOption("stop", list, (), "strings the text ends before (the first found)"),
)

# the exit rule's own checks (ExitRule.parse) follow the types: which keys a rule takes,
# the gate's range
EXIT_OPTIONS = (
    Option("rule", str, "fixed", "the exit rule", choices=tuple(EXIT_KINDS)),
    Option("threshold", float, None, "kl, entropy_delta, latent_delta, gate: the rule's threshold",
           minimum=0.0),
    Option("min_depth", int, 1, "no exit before this iteration", minimum=1, maximum=_INT32_MAX),
    Option("patience", int, 2, "argmax_stable: iterations the top token stays", minimum=1,
           maximum=_INT32_MAX),
)

_SECTIONS = {"model": MODEL_OPTIONS, "sampling": SAMPLING_OPTIONS, "exit": EXIT_OPTIONS}
_TOP_LEVEL = ("model", "sampling", "exit", "modes")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    device: str = "cpu"
    threads: int = 0
    max_seq_len: int = 0
    depth: int = 0
    verify_checksums: bool = False
    kv_dtype: str = "default"
    prefill_chunk: int = 0
    cache_window: int = 0
    cache_window_approx: bool = False
    state_init: str = "file"


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    modes: tuple[ActiveMode, ...] = ()
    source: str | None = None
    #: [exit]: the default exit rule of generations and scoring; None without the table
    exit: ExitRule | None = None
    #: (key, problem) -> a ConfigError naming this config's file and the key's line
    locate: Any = field(default=None, compare=False, repr=False)

    def error(self, key: str, problem: str) -> ConfigError:
        """A ConfigError over `key`, with the file and line when the config has them."""
        return (self.locate or _error_factory(self.source, None))(key, problem)

    def model_path(self) -> str | None:
        """[model] path, relative paths taken from the config file's folder when the
        file exists there (otherwise the value as written, e.g. a pulled name)."""
        path = self.model.path
        if path is None or self.source is None or os.path.isabs(path):
            return path
        beside = Path(self.source).resolve().parent / path
        return str(beside) if beside.exists() else path

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments of tinyloop.Model (plus "path"), after the mode hooks."""
        options = {"path": self.model_path(), "device": self.model.device,
                   "threads": self.model.threads, "max_seq_len": self.model.max_seq_len,
                   "default_depth": self.model.depth}
        if self.model.verify_checksums:   # only when asked: load hooks see the option then
            options["verify_checksums"] = True
        if self.model.kv_dtype != "default":   # else the backend's (Model's default)
            options["kv_dtype"] = self.model.kv_dtype
        if self.model.prefill_chunk:   # else the library's (Model's default)
            options["prefill_chunk"] = self.model.prefill_chunk
        if self.model.cache_window:   # only when asked, as above
            options["cache_window"] = self.model.cache_window
        if self.model.cache_window_approx:
            options["cache_window_approx"] = True
        if self.model.state_init != "file":
            options["state_init"] = self.model.state_init
        return apply_load_hooks(self.modes, options)

    def generate_options(self) -> dict[str, Any]:
        """Keyword arguments of Model.generate / Model.stream ([exit] as `exit`, when set)."""
        options = asdict(self.sampling)
        if options["stop"]:
            options["stop"] = list(options["stop"])
        else:   # no stop strings: the options as without the key
            del options["stop"]
        if self.exit is not None:
            options["exit"] = self.exit
        return options


class _Locator:
    """Finds the line of a key in TOML text, for error messages (best effort: tables
    by header, keys by `key =` inside them)."""

    _HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
    _KEY = re.compile(r"^\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_\-.]+)\s*=")

    def __init__(self, text: str | None):
        self._lines = text.splitlines() if text else []

    @staticmethod
    def _parts(dotted: str) -> tuple[str, ...]:
        return tuple(p.strip().strip("\"'") for p in dotted.split("."))

    def line(self, key: str) -> int | None:
        parts = self._parts(key)
        table: tuple[str, ...] = ()
        for number, text in enumerate(self._lines, 1):
            header = self._HEADER.match(text)
            if header:
                table = self._parts(header.group(1))
                if table == parts:
                    return number
                continue
            match = self._KEY.match(text)
            if match:
                full = table + self._parts(match.group(1))
                # the key itself, or a dotted prefix of it holding an inline table
                if full == parts[:len(full)]:
                    return number
        return None


def _error_factory(source: str | None, text: str | None) -> Callable[..., ConfigError]:
    locator = _Locator(text)

    def error(key: str, problem: str, near: str | None = None) -> ConfigError:
        """`near`: where to point when the key itself is not in the text (a missing key)."""
        line = locator.line(key)
        if line is None and near is not None:
            line = locator.line(near)
        where = source or "<config>"
        if line is not None:
            where = f"{where}:{line}"
        return ConfigError(f"{where}: {key}: {problem}", key=key, source=source, line=line)
    return error


def _check_section(name: str, table: Any, error: Callable[..., ConfigError]) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise error(name, f"must be a table ([{name}]), got {type(table).__name__}")
    options = {o.name: o for o in _SECTIONS[name]}
    values = {}
    for key, value in table.items():
        if key not in options:
            raise error(f"{name}.{key}", f"unknown key (allowed in [{name}]: "
                                         f"{', '.join(options)})")
        values[key] = options[key].check(value, f"{name}.{key}", error)
    if name == "model" and "device" in values and not _DEVICE.match(values["device"]):
        raise error("model.device", f"must be cpu, cuda, cuda:N or auto, got {values['device']!r}")
    return values


def config_from_dict(data: Mapping[str, Any], *, source: str | None = None, text: str | None = None,
                     registry: PluginRegistry | None = None) -> Config:
    """A checked Config from parsed TOML. `text` (the TOML source) lets errors give lines."""
    error = _error_factory(source, text)
    for key in data:
        if key not in _TOP_LEVEL:
            raise error(key, f"unknown section (allowed: {', '.join(_TOP_LEVEL)})")
    model = ModelConfig(**_check_section("model", data.get("model", {}), error))
    sampling = SamplingConfig(**_check_section("sampling", data.get("sampling", {}), error))
    exit_rule = _exit_rule(data["exit"], error) if "exit" in data else None
    modes_table = data.get("modes", {})
    if not isinstance(modes_table, Mapping):
        raise error("modes", f"must be a table of [modes.<name>] tables, "
                             f"got {type(modes_table).__name__}")
    modes: tuple[ActiveMode, ...] = ()
    if modes_table:
        modes = tuple(replace(mode, locate=_near(error, f"modes.{mode.name}"))
                      for mode in (registry or default_registry()).resolve(modes_table, error))
    return Config(model=model, sampling=sampling, modes=modes, source=source, exit=exit_rule,
                  locate=error)


def _near(error: Callable[..., ConfigError], table: str) -> Callable[[str, str], ConfigError]:
    """The error factory of a mode's hooks: a key not written in the file (an option left
    at its default) is pointed at by the mode's table."""
    return lambda key, problem: error(key, problem, near=table)


def _exit_rule(table: Any, error: Callable[..., ConfigError]) -> ExitRule:
    values = _check_section("exit", table, error)
    try:
        return ExitRule.parse(values, field="exit")
    except ExitRuleError as e:   # a missing key is pointed at by its table's line
        raise error(e.key, e.problem, near="exit") from None


def parse_config(text: str, source: str | None = None,
                 registry: PluginRegistry | None = None) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source or '<config>'}: invalid TOML: {e}", source=source) from None
    return config_from_dict(data, source=source, text=text, registry=registry)


def load_config(path: str | os.PathLike[str], registry: PluginRegistry | None = None) -> Config:
    """Read and check a tinyloop.toml file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}", source=path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: config is not UTF-8 ({e.reason} at byte {e.start})",
                          source=path) from None
    return parse_config(text, source=path, registry=registry)
