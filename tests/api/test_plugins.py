"""The plugin registry: registration rules, entry points, mode resolution."""

import http.client
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tinyloop.plugins as plugins_module
from tinyloop.errors import ConfigError, PluginError
from tinyloop.plugins import (REQUIRED, ActiveMode, Option, Plugin, PluginRegistry,
                              apply_load_hooks, strategy_mode)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def fake_strategy(model, prompt, options, config):
    return iter(())


def registry_of(*plugins):
    registry = PluginRegistry()
    for plugin in plugins:
        registry.register(plugin, origin=f"test {plugin.name}")
    return registry


# -- registration ----------------------------------------------------------------------
def test_register_and_look_up():
    plugin = Plugin(name="paged_kv", options=(Option("block", int, 16, minimum=1),))
    registry = registry_of(plugin)
    assert "paged_kv" in registry and len(registry) == 1
    assert registry.get("paged_kv") is plugin
    assert registry.names() == ["paged_kv"]
    assert registry.origin("paged_kv") == "test paged_kv"


def test_same_name_twice_names_both_origins():
    registry = registry_of(Plugin(name="paged_kv"))
    with pytest.raises(PluginError, match="registered twice: by test paged_kv and by other"):
        registry.register(Plugin(name="paged_kv"), origin="other")


@pytest.mark.parametrize("plugin, words", [
    (Plugin(name="Bad-Name"), "must match"),
    (Plugin(name="x", options=(Option("a", list, []),)), "allowed: bool, int, float, str"),
    (Plugin(name="x", options=(Option("a", int, 1), Option("a", int, 2))), "option 'a' twice"),
    (Plugin(name="x", options=(Option("a", int, "one"),)), "x.a (default): expected int"),
    (Plugin(name="x", conflicts=frozenset({"x"})), "lists itself in conflicts"),
    (Plugin(name="x", requires="y"), "requires must be a set"),
    (Plugin(name="x", strategy="fast"), "strategy must be callable"),
    ("not a plugin", "expected a tinyloop.plugins.Plugin"),
])
def test_malformed_plugins_are_refused(plugin, words):
    with pytest.raises(PluginError, match=re.escape(words)):
        PluginRegistry().register(plugin)


def test_builtin_package_is_registered_like_third_parties():
    import tinyloop_plugins
    builtins = tinyloop_plugins.builtin_plugins()
    registry = PluginRegistry()
    registry.load_builtins()
    assert registry.names() == sorted(p.name for p in builtins)


REPO = Path(__file__).resolve().parents[2]


def pyproject_plugins() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["tinyloop.plugins"]


def test_builtins_are_the_distributions_entry_points():
    """Every module of tinyloop_plugins is an entry point of tinyloop's pyproject.toml, and
    those are what the registry loads as built-ins (from the installed metadata, or from
    pyproject.toml when the source tree runs without an install)."""
    table = pyproject_plugins()
    modules = sorted(m.stem for m in (REPO / "plugins" / "tinyloop_plugins").glob("*.py")
                     if m.stem != "__init__")
    assert sorted(table) == modules
    assert all(value == f"tinyloop_plugins.{name}:PLUGIN" for name, value in table.items())
    assert {ep.name: ep.value for ep in plugins_module.builtin_entry_points()} == table
    from_tree = plugins_module._source_tree_entry_points(REPO / "pyproject.toml")
    assert {ep.name: ep.value for ep in from_tree} == table
    registry = PluginRegistry()
    registry.load_builtins()
    assert "of distribution 'tinyloop-runtime'" in registry.origin("speculative")
    # third-party loading leaves tinyloop's own entry points to load_builtins
    others = PluginRegistry()
    others.load_entry_points()
    assert not set(table) & set(others.names())


def test_missing_builtins_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(plugins_module, "builtin_entry_points", lambda: [])
    with pytest.raises(PluginError, match="built-in plugins are missing.*reinstall tinyloop"):
        PluginRegistry().load_builtins()
    gone = importlib.metadata.EntryPoint("speculative", "no_such_plugin_module:PLUGIN",
                                         "tinyloop.plugins")
    monkeypatch.setattr(plugins_module, "builtin_entry_points", lambda: [gone])
    with pytest.raises(PluginError, match=r"built-in entry point 'speculative'.*"
                                          r"No module named 'no_such_plugin_module'; reinstall"):
        PluginRegistry().load_builtins()


# -- entry points ------------------------------------------------------------------------
def make_distribution(root, entry_points: str, module_source: str):
    """An installed-looking distribution `fake-tinyloop-mode` under `root`."""
    (root / "fake_mode_pkg.py").write_text(textwrap.dedent(module_source))
    info = root / "fake_tinyloop_mode-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-tinyloop-mode\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


FAKE_MODULE = """
    from tinyloop.plugins import Option, Plugin

    def _configure(config, options):
        options["prefill_chunk"] = config["chunk"]

    PLUGIN = Plugin(name="fake_mode", description="a third-party mode",
                    options=(Option("chunk", int, 64, minimum=1),),
                    conflicts=frozenset({"other_mode"}), configure_load=_configure)

    def make_plugin():
        return Plugin(name="fake_factory")

    def broken():
        raise RuntimeError("plugin setup failed")
    """


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    def install(entry_points):
        make_distribution(tmp_path, entry_points, FAKE_MODULE)
        monkeypatch.syspath_prepend(str(tmp_path))
    yield install


def test_third_party_plugin_through_entry_point(fake_distribution):
    fake_distribution("""
        [tinyloop.plugins]
        fake_mode = fake_mode_pkg:PLUGIN
        fake_factory = fake_mode_pkg:make_plugin
        """)
    registry = PluginRegistry()
    registry.load_entry_points()
    assert {"fake_mode", "fake_factory"} <= set(registry.names())
    assert "fake-tinyloop-mode" in registry.origin("fake_mode")
    (mode,) = registry.resolve({"fake_mode": {"chunk": 32}})
    assert apply_load_hooks([mode], {"prefill_chunk": 0}) == {"prefill_chunk": 32}


def test_default_registry_has_builtins_and_entry_points(fake_distribution, monkeypatch):
    fake_distribution("[tinyloop.plugins]\nfake_mode = fake_mode_pkg:PLUGIN\n")
    monkeypatch.setattr(plugins_module, "_default", None)
    registry = plugins_module.default_registry()
    assert "fake_mode" in registry
    assert plugins_module.default_registry() is registry
    monkeypatch.setattr(plugins_module, "_default", None)


def test_entry_point_name_must_match_plugin(fake_distribution):
    fake_distribution("[tinyloop.plugins]\nwrong_name = fake_mode_pkg:PLUGIN\n")
    with pytest.raises(PluginError, match="provides plugin 'fake_mode'; the entry point must"):
        PluginRegistry().load_entry_points()


def test_broken_entry_point_names_its_distribution(fake_distribution):
    fake_distribution("[tinyloop.plugins]\nbroken = fake_mode_pkg:broken\n")
    with pytest.raises(PluginError, match=r"'broken'.*fake-tinyloop-mode.*plugin setup failed"):
        PluginRegistry().load_entry_points()


def test_entry_point_clashing_with_a_registered_name(fake_distribution):
    fake_distribution("[tinyloop.plugins]\nfake_mode = fake_mode_pkg:PLUGIN\n")
    registry = registry_of(Plugin(name="fake_mode"))
    with pytest.raises(PluginError, match="'fake_mode' is registered twice"):
        registry.load_entry_points()


# -- resolving [modes] -----------------------------------------------------------------
def test_resolve_fills_defaults_and_checks_types():
    registry = registry_of(Plugin(name="spec", options=(
        Option("draft_depth", int, 1, minimum=1), Option("greedy", bool, True),
        Option("ratio", float, 0.5, maximum=1.0), Option("kind", str, "a", choices=("a", "b")))))
    (mode,) = registry.resolve({"spec": {"ratio": 1, "kind": "b"}})
    assert isinstance(mode, ActiveMode)
    assert dict(mode.config) == {"draft_depth": 1, "greedy": True, "ratio": 1.0, "kind": "b"}
    with pytest.raises(TypeError):
        mode.config["ratio"] = 0.1  # checked configs are read-only
    for table, words in (({"greedy": 1}, "expected bool, got int"),
                         ({"ratio": 2.0}, "<= 1.0"),
                         ({"kind": "c"}, "must be one of 'a', 'b'"),
                         ({"draft_depth": 0}, ">= 1")):
        with pytest.raises(ConfigError, match=words):
            registry.resolve({"spec": table})


def test_required_option():
    registry = registry_of(Plugin(name="draft", options=(Option("path", str, REQUIRED),)))
    with pytest.raises(ConfigError, match="modes.draft.path: required by mode 'draft'"):
        registry.resolve({"draft": {}})
    (mode,) = registry.resolve({"draft": {"path": "d.tinyloop"}})
    assert mode.config["path"] == "d.tinyloop"


def test_unknown_mode_lists_the_available_ones():
    registry = registry_of(Plugin(name="paged_kv"), Plugin(name="fp16_body"))
    with pytest.raises(ConfigError, match=r"unknown mode 'paged' \(available modes: "
                                          r"fp16_body, paged_kv\)") as info:
        registry.resolve({"paged": {}})
    assert info.value.key == "modes.paged"


@pytest.mark.parametrize("declared_by", ["first", "second"])
def test_conflicts_are_symmetric(declared_by):
    a = Plugin(name="paged_kv", conflicts=frozenset({"ring_kv"}) if declared_by == "first"
               else frozenset())
    b = Plugin(name="ring_kv", conflicts=frozenset({"paged_kv"}) if declared_by == "second"
               else frozenset())
    registry = registry_of(a, b)
    with pytest.raises(ConfigError, match="mode 'ring_kv' conflicts with mode 'paged_kv'"):
        registry.resolve({"paged_kv": {}, "ring_kv": {}})
    assert [m.name for m in registry.resolve({"ring_kv": {}})] == ["ring_kv"]


def test_requires():
    registry = registry_of(Plugin(name="tree", requires=frozenset({"spec", "ghost"})),
                           Plugin(name="spec"))
    with pytest.raises(ConfigError, match=r"mode 'tree' requires mode 'ghost' \(not installed\)"):
        registry.resolve({"tree": {}, "spec": {}})
    registry = registry_of(Plugin(name="tree", requires=frozenset({"spec"})), Plugin(name="spec"))
    with pytest.raises(ConfigError, match=r"requires mode 'spec'; add \[modes.spec\]"):
        registry.resolve({"tree": {}})
    assert [m.name for m in registry.resolve({"tree": {}, "spec": {}})] == ["spec", "tree"]


def test_two_generation_strategies_conflict():
    registry = registry_of(Plugin(name="spec", strategy=fake_strategy),
                           Plugin(name="tree", strategy=fake_strategy), Plugin(name="paged_kv"))
    with pytest.raises(ConfigError, match="'spec' and 'tree' each replace the generation"):
        registry.resolve({"spec": {}, "tree": {}})
    modes = registry.resolve({"spec": {}, "paged_kv": {}})
    assert strategy_mode(modes).name == "spec"
    assert strategy_mode(registry.resolve({"paged_kv": {}})) is None


def test_mode_table_must_be_a_table():
    registry = registry_of(Plugin(name="spec"))
    with pytest.raises(ConfigError, match="modes.spec: must be a table"):
        registry.resolve({"spec": 3})


# -- every front end honours a mode --------------------------------------------------------
MODES_MODULE = """
    from tinyloop.plugins import Option, Plugin

    def _cap(config, options):
        options["max_tokens"] = config["max_tokens"]

    def _fixed(model, prompt_ids, options, config):
        yield from (int(t) for t in config["tokens"].split(","))

    CAP = Plugin(name="cap_tokens", options=(Option("max_tokens", int, 3, minimum=1),),
                 configure_generate=_cap)
    FIXED = Plugin(name="fixed_tokens", options=(Option("tokens", str, "72,105"),),
                   strategy=_fixed)
    """
# the text model's tokens are bytes: 72, 105 is "Hi"
FIXED_TEXT = "Hi"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.fixture(scope="module")
def front_end(tmp_path_factory):
    """A chat model, the configs switching each test mode on, and the environment of a
    `tinyloop` process that has the modes' distribution installed."""
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    import textmodel
    root = tmp_path_factory.mktemp("front_end")
    make_distribution(root, "[tinyloop.plugins]\ncap_tokens = fake_mode_pkg:CAP\n"
                            "fixed_tokens = fake_mode_pkg:FIXED\n", MODES_MODULE)
    model = root / "chat.tinyloop"
    textmodel.make_text_model(model, chat_template=CHAT_TEMPLATE)
    configs = {}
    for mode in ("cap_tokens", "fixed_tokens"):
        configs[mode] = root / f"{mode}.toml"
        configs[mode].write_text(f"[modes.{mode}]\n")
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(root)] + [p for p in sys.path if p]))
    return model, configs, env


def tinyloop_cli(env, *args, stdin=""):
    proc = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, args), "--threads", "1",
                           "--json"], input=stdin, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generate_honours_modes(front_end):
    model, configs, env = front_end
    capped = tinyloop_cli(env, "generate", model, "Hello", "--max-tokens", 8, "--temperature", 0,
                          "--config", configs["cap_tokens"])
    assert capped["mode"] == "cap_tokens" and capped["n_tokens"] == 3
    prompt = tinyloop_cli(env, "generate", model, "Hello", "--max-tokens", 1)["prompt_tokens"]
    fixed = tinyloop_cli(env, "generate", model, "Hello", "--config", configs["fixed_tokens"])
    assert fixed["mode"] == "fixed_tokens" and fixed["tokens"] == [72, 105]
    assert fixed["text"] == FIXED_TEXT and fixed["prompt_tokens"] == prompt


def test_chat_honours_modes(front_end):
    """Both turns of a chat (the second continues the first's kept sequence) use the mode."""
    model, configs, env = front_end
    fixed = tinyloop_cli(env, "chat", model, "--config", configs["fixed_tokens"], stdin="Hi\nYo\n")
    assert [m["content"] for m in fixed["messages"] if m["role"] == "assistant"] == [FIXED_TEXT] * 2
    capped = tinyloop_cli(env, "chat", model, "--max-tokens", 8, "--temperature", 0,
                          "--config", configs["cap_tokens"], stdin="Hi\nYo\n")
    import tinyloop
    from tinyloop.chat_template import load_chat_template
    with tinyloop.Model(model, threads=1) as m:
        render = load_chat_template(m)
        for turn in (1, 3):
            ids = m.tokenizer.encode(render(capped["messages"][:turn]), add_bos=False)
            reply = m.generate(ids, max_tokens=8, temperature=0).tokens[:3]
            assert capped["messages"][turn]["content"] == m.tokenizer.decode(reply)


@pytest.mark.parametrize("mode", ["cap_tokens", "fixed_tokens"])
def test_serve_honours_modes(front_end, mode):
    """Through batched decode steps (--parallel 2), and for a request of two choices."""
    model, configs, env = front_end
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", str(model), "--port", "0",
                             "--threads", "1", "--name", "tiny", "--parallel", "2",
                             "--config", str(configs[mode])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "tinyloop serve: tiny at http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        answers = []
        for path, body in (("/v1/completions", {"prompt": "Hello"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/completions", {"prompt": "Hello", "n": 2})):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", path, body=json.dumps(dict(body, max_tokens=8, temperature=0)),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            answers.append(json.loads(response.read()))
            conn.close()
            assert response.status == 200, answers[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    completion, chat, choices = answers
    if mode == "cap_tokens":
        assert completion["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 3
        assert choices["usage"]["completion_tokens"] == 6
    else:
        assert completion["choices"][0]["text"] == FIXED_TEXT
        assert chat["choices"][0]["message"]["content"] == FIXED_TEXT
        assert [c["text"] for c in choices["choices"]] == [FIXED_TEXT] * 2
