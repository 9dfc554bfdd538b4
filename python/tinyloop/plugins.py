"""The registry of runtime modes (plugins).

A plugin is a `Plugin` value: a name, a typed option schema, the modes it conflicts
with or requires, and optional hooks: `configure_load` adjusts the keyword arguments
`Model` is loaded with, `configure_generate` those of each generation, `strategy`
replaces the default generation loop. A model loaded from a config (Model.from_config,
and so every CLI command) applies them itself, so every front end honours a mode.
Modes are switched on in tinyloop.toml (`[modes.<name>]`, its keys are the plugin's
options). Every plugin is registered through the `tinyloop.plugins` entry-point group:
the built-in ones (the `tinyloop_plugins` package) as entry points of the tinyloop
distribution itself, declared in its pyproject.toml. The contract is described in
docs/plugins.md.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError, PluginError, TinyLoopError

ENTRY_POINT_GROUP = "tinyloop.plugins"
#: the distribution whose entry points are the built-in plugins
DISTRIBUTION = "tinyloop-runtime"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_TYPES = (bool, int, float, str)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: default of an Option that the user must set
REQUIRED: Any = _Required()

#: the factory of located config errors: (dotted key, problem) -> ConfigError
ErrorFactory = Callable[[str, str], Exception]


def plain_error(key: str, problem: str) -> ConfigError:
    return ConfigError(f"{key}: {problem}", key=key)


@dataclass(frozen=True)
class Option:
    """One typed key of a configuration table."""

    name: str
    type: type
    default: Any = REQUIRED
    help: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False

    def check(self, value: Any, key: str, error: ErrorFactory = plain_error) -> Any:
        """The value converted to the option's type, or a ConfigError naming `key`."""
        value = self._typed(value, key, error)
        if self.choices is not None and value not in self.choices:
            raise error(key, f"must be one of {', '.join(map(repr, self.choices))}, "
                             f"got {value!r}")
        if self.minimum is not None:
            if self.exclusive_minimum and value <= self.minimum:
                raise error(key, f"must be > {self.minimum}, got {value!r}")
            if value < self.minimum:
                raise error(key, f"must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None:
            if value > self.maximum:
                raise error(key, f"must be <= {self.maximum}, got {value!r}")
            if self.exclusive_maximum and value == self.maximum:
                raise error(key, f"must be < {self.maximum}, got {value!r}")
        return value

    def _typed(self, value: Any, key: str, error: ErrorFactory) -> Any:
        wanted = self.type
        if wanted is bool:
            ok = isinstance(value, bool)
        elif isinstance(value, bool):    # bool is an int subclass, but never a number here
            ok = False
        elif wanted is float:            # TOML ints are fine where floats are expected
            ok = isinstance(value, (int, float))
        else:
            ok = isinstance(value, wanted)
        if not ok:
            raise error(key, f"expected {wanted.__name__}, got {type(value).__name__} {value!r}")
        return float(value) if wanted is float else value


@dataclass(frozen=True)
class Plugin:
    """A runtime mode.

    configure_load(mode_config, load_options): edit `load_options` (the keyword
        arguments of tinyloop.Model: device, threads, max_seq_len, default_depth,
        prefill_chunk, ...) in place.
    configure_generate(mode_config, generate_options): edit the keyword arguments of one
        generation (max_tokens, depth, temperature, draft_depth, ...: those the caller
        gave) in place, for every generation of a model loaded with the mode.
    strategy(model, prompt_ids, generate_options, mode_config): produce the generated
        token ids (an iterable, consumed lazily so that streaming works) instead of the
        library's default loop; `model` is the Model or the Context generating. At most
        one active mode may have a strategy.
    """

    name: str
    description: str = ""
    options: tuple[Option, ...] = ()
    conflicts: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    configure_load: Callable[[Mapping[str, Any], dict[str, Any]], None] | None = None
    strategy: Callable[[Any, Any, dict[str, Any], Mapping[str, Any]], Iterable[int]] | None = None
    configure_generate: Callable[[Mapping[str, Any], dict[str, Any]], None] | None = None

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


@dataclass(frozen=True)
class ActiveMode:
    """A plugin switched on, with its checked configuration (defaults filled in)."""

    plugin: Plugin
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: where the mode was switched on: (key, problem) -> a ConfigError naming the config
    #: file and line (a config's modes have it); the errors of its hooks are raised so
    locate: ErrorFactory | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.plugin.name


def validate_plugin(plugin: Any, origin: str) -> Plugin:
    """Check the shape of a plugin object before it enters a registry."""
    if not isinstance(plugin, Plugin):
        raise PluginError(f"{origin}: expected a tinyloop.plugins.Plugin, "
                          f"got {type(plugin).__name__}")
    if not isinstance(plugin.name, str) or not _NAME.match(plugin.name):
        raise PluginError(f"{origin}: plugin name {plugin.name!r} must match {_NAME.pattern}")
    seen = set()
    for opt in plugin.options:
        if not isinstance(opt, Option):
            raise PluginError(f"{origin}: plugin {plugin.name!r}: options must be Option values")
        if opt.type not in _TYPES:
            raise PluginError(f"{origin}: plugin {plugin.name!r}: option {opt.name!r} has type "
                              f"{opt.type!r}; allowed: bool, int, float, str")
        if opt.name in seen:
            raise PluginError(f"{origin}: plugin {plugin.name!r}: option {opt.name!r} twice")
        seen.add(opt.name)
        if opt.default is not REQUIRED:
            opt.check(opt.default, f"{plugin.name}.{opt.name} (default)",
                      lambda key, problem: PluginError(f"{origin}: {key}: {problem}"))
    for relation in ("conflicts", "requires"):
        names = getattr(plugin, relation)
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise PluginError(f"{origin}: plugin {plugin.name!r}: {relation} must be a set "
                              "of mode names")
        if plugin.name in names:
            raise PluginError(f"{origin}: plugin {plugin.name!r} lists itself in {relation}")
    for hook in ("configure_load", "configure_generate", "strategy"):
        value = getattr(plugin, hook)
        if value is not None and not callable(value):
            raise PluginError(f"{origin}: plugin {plugin.name!r}: {hook} must be callable")
    return plugin


class PluginRegistry:
    def __init__(self) -> None:
        self._plugins: dict[str, Plugin] = {}
        self._origins: dict[str, str] = {}

    def register(self, plugin: Plugin, origin: str = "code") -> None:
        validate_plugin(plugin, origin)
        if plugin.name in self._plugins:
            raise PluginError(f"plugin {plugin.name!r} is registered twice: by "
                              f"{self._origins[plugin.name]} and by {origin}")
        self._plugins[plugin.name] = plugin
        self._origins[plugin.name] = origin

    def get(self, name: str) -> Plugin:
        return self._plugins[name]

    def origin(self, name: str) -> str:
        return self._origins[name]

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def __contains__(self, name: str) -> bool:
        return name in self._plugins

    def __len__(self) -> int:
        return len(self._plugins)

    def load_builtins(self) -> None:
        """Register the built-in plugins: the tinyloop-runtime distribution's own entry points."""
        points = builtin_entry_points()
        if not points:
            raise PluginError(f"the built-in plugins are missing: distribution {DISTRIBUTION!r} "
                              f"declares no {ENTRY_POINT_GROUP!r} entry points; "
                              f"reinstall {DISTRIBUTION}")
        for ep in points:
            self._load_entry_point(ep, f"built-in entry point {ep.name!r} ({ep.value}) of "
                                       f"distribution {DISTRIBUTION!r}",
                                   f"; reinstall {DISTRIBUTION}")

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Register third-party plugins: each entry point names a Plugin, or a callable
        returning one, and its name must be the plugin's name. The tinyloop-runtime
        distribution's own are load_builtins'."""
        for ep in importlib.metadata.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            if dist is not None and dist.name == DISTRIBUTION:
                continue
            self._load_entry_point(ep, f"entry point {ep.name!r} ({ep.value})"
                                   + (f" of distribution {dist.name!r}" if dist is not None else ""))

    def _load_entry_point(self, ep: Any, origin: str, hint: str = "") -> None:
        try:
            obj = ep.load()
            plugin = obj if isinstance(obj, Plugin) or not callable(obj) else obj()
        except Exception as e:
            raise PluginError(f"{origin} failed to load: {type(e).__name__}: {e}{hint}") from e
        validate_plugin(plugin, origin)
        if plugin.name != ep.name:
            raise PluginError(f"{origin} provides plugin {plugin.name!r}; the entry point "
                              "must carry the plugin's name")
        self.register(plugin, origin)

    def resolve(self, modes: Mapping[str, Any],
                error: ErrorFactory = plain_error) -> tuple[ActiveMode, ...]:
        """Check the `modes` table of a config (mode name -> option table) and return
        the active modes in a stable order. Errors name the offending key."""
        active = []
        for name, table in modes.items():
            key = f"modes.{name}"
            if name not in self._plugins:
                known = ", ".join(self.names()) or "none installed"
                raise error(key, f"unknown mode {name!r} (available modes: {known})")
            if not isinstance(table, Mapping):
                raise error(key, f"must be a table, got {type(table).__name__}")
            active.append(ActiveMode(self._plugins[name],
                                     self._check_options(self._plugins[name], table, key, error)))
        self._check_relations(active, error)
        return tuple(sorted(active, key=lambda m: m.name))

    @staticmethod
    def _check_options(plugin: Plugin, table: Mapping[str, Any], key: str,
                       error: ErrorFactory) -> Mapping[str, Any]:
        config = {}
        for opt_name, value in table.items():
            opt = plugin.option(opt_name)
            if opt is None:
                allowed = ", ".join(o.name for o in plugin.options) or "none"
                raise error(f"{key}.{opt_name}",
                            f"unknown option of mode {plugin.name!r} (allowed: {allowed})")
            config[opt_name] = opt.check(value, f"{key}.{opt_name}", error)
        for opt in plugin.options:
            if opt.name not in config:
                if opt.default is REQUIRED:
                    raise error(f"{key}.{opt.name}", f"required by mode {plugin.name!r}")
                config[opt.name] = opt.default
        return MappingProxyType(config)

    def _check_relations(self, active: list[ActiveMode], error: ErrorFactory) -> None:
        names = {m.name for m in active}
        for mode in active:
            for other in sorted(mode.plugin.requires - names):
                hint = "" if other in self._plugins else " (not installed)"
                raise error(f"modes.{mode.name}",
                            f"mode {mode.name!r} requires mode {other!r}{hint}; add [modes.{other}]")
        for mode in active:
            for other in sorted(names - {mode.name}):
                if other in mode.plugin.conflicts or mode.name in self._plugins[other].conflicts:
                    first, second = sorted((mode.name, other))
                    raise error(f"modes.{second}",
                                f"mode {second!r} conflicts with mode {first!r}; "
                                "enable only one of them")
        with_strategy = sorted(m.name for m in active if m.plugin.strategy is not None)
        if len(with_strategy) > 1:
            raise error(f"modes.{with_strategy[1]}",
                        "modes " + " and ".join(repr(n) for n in with_strategy) +
                        " each replace the generation strategy; enable only one of them")


def builtin_entry_points() -> list[Any]:
    """The entry points of the built-in plugins: those of the installed tinyloop-runtime
    distribution (pyproject.toml's [project.entry-points."tinyloop.plugins"]), or, for a
    source tree on sys.path without an install (PYTHONPATH=python:plugins), that table
    read from the tree's pyproject.toml."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return _source_tree_entry_points(Path(__file__).resolve().parents[2] / "pyproject.toml")
    return [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]


def _source_tree_entry_points(pyproject: Path) -> list[Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.10 only
        import tomli as tomllib
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    if project.get("name") != DISTRIBUTION:
        return []
    table = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return [importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)
            for name, value in table.items()]


def _run_hook(mode: ActiveMode, hook: Any, options: dict[str, Any]) -> None:
    """hook(mode.config, options); an error it raises over the values it was given comes
    out as a ConfigError naming the mode's config file and line, when the mode has them."""
    try:
        hook(mode.config, options)
    except (TinyLoopError, ValueError, TypeError) as e:
        if mode.locate is None or getattr(e, "line", None) is not None:
            raise
        key = getattr(e, "key", None) or f"modes.{mode.name}"
        message = str(e)
        problem = message[len(key) + 2:] if message.startswith(f"{key}: ") else message
        raise mode.locate(key, problem) from e


def apply_load_hooks(modes: Iterable[ActiveMode], load_options: dict[str, Any]) -> dict[str, Any]:
    """Let every active mode adjust the Model keyword arguments; returns them."""
    for mode in modes:
        if mode.plugin.configure_load is not None:
            _run_hook(mode, mode.plugin.configure_load, load_options)
    return load_options


def apply_generate_hooks(modes: Iterable[ActiveMode], generate_options: dict[str, Any]) -> dict[str, Any]:
    """Let every active mode adjust one generation's keyword arguments; returns them."""
    for mode in modes:
        if mode.plugin.configure_generate is not None:
            _run_hook(mode, mode.plugin.configure_generate, generate_options)
    return generate_options


def strategy_mode(modes: Iterable[ActiveMode]) -> ActiveMode | None:
    """The one active mode that replaces the generation loop, if any."""
    return next((m for m in modes if m.plugin.strategy is not None), None)


def generation_mode(modes: Iterable[ActiveMode]) -> ActiveMode | None:
    """The active mode that changes how tokens are generated, if any: the one with a
    strategy, else the first with a configure_generate hook."""
    modes = tuple(modes)
    return strategy_mode(modes) or next(
        (m for m in modes if m.plugin.configure_generate is not None), None)


_default: PluginRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> PluginRegistry:
    """The process-wide registry: built-ins plus installed entry points (loaded once)."""
    global _default
    with _default_lock:
        if _default is None:
            registry = PluginRegistry()
            registry.load_builtins()
            registry.load_entry_points()
            _default = registry
        return _default
