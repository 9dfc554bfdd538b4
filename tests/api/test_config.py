"""tinyloop.toml parsing: defaults, values, and errors that name key, file and line."""

import textwrap

import pytest

import textmodel
import tinyloop
from tinyloop.config import Config, load_config, parse_config
from tinyloop.errors import ConfigError, UnsupportedError
from tinyloop.plugins import Option, Plugin, PluginRegistry


def write(tmp_path, text, name="tinyloop.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def empty_registry():
    return PluginRegistry()


def test_empty_file_gives_defaults(tmp_path):
    config = load_config(write(tmp_path, ""), registry=empty_registry())
    assert config.model.device == "cpu"
    assert config.model.path is None
    assert config.sampling.temperature == 0.8
    assert config.sampling.max_tokens == 128
    assert config.modes == ()


def test_full_file(tmp_path):
    (tmp_path / "m.tinyloop").write_bytes(b"")
    path = write(tmp_path, """
        [model]
        path = "m.tinyloop"
        device = "cuda:1"
        threads = 2
        max_seq_len = 512
        depth = 3

        [sampling]
        temperature = 0          # an int where a float is expected is fine
        top_k = 10
        top_p = 0.5
        min_p = 0.0
        repetition_penalty = 1.1
        seed = 18446744073709551615
        max_tokens = 7
        """)
    config = load_config(path, registry=empty_registry())
    assert config.model_path() == str(tmp_path / "m.tinyloop")
    assert config.sampling.temperature == 0.0 and isinstance(config.sampling.temperature, float)
    assert config.sampling.seed == 2**64 - 1
    assert config.load_options() == {"path": str(tmp_path / "m.tinyloop"), "device": "cuda:1",
                                     "threads": 2, "max_seq_len": 512, "default_depth": 3}
    assert config.generate_options() == {"temperature": 0.0, "top_k": 10, "top_p": 0.5,
                                         "min_p": 0.0, "repetition_penalty": 1.1,
                                         "seed": 2**64 - 1, "max_tokens": 7}


def test_model_path_that_is_not_a_file_is_kept_as_a_name(tmp_path):
    config = load_config(write(tmp_path, '[model]\npath = "smollm2-135m"\n'),
                         registry=empty_registry())
    assert config.model_path() == "smollm2-135m"


@pytest.mark.parametrize("text, key, line, words", [
    ("[model]\nthreads = 2\nthread = 4\n", "model.thread", 3, "unknown key"),
    ("[sampling]\n\ntop_p = 1.5\n", "sampling.top_p", 3, "<= 1.0"),
    ("[sampling]\ntop_p = 0\n", "sampling.top_p", 2, "> 0.0"),
    ("[sampling]\ntemperature = -1\n", "sampling.temperature", 2, ">= 0.0"),
    ("[sampling]\ntop_k = 4.5\n", "sampling.top_k", 2, "expected int, got float"),
    ("[sampling]\nseed = true\n", "sampling.seed", 2, "expected int, got bool"),
    ("[sampling]\nmax_tokens = 0\n", "sampling.max_tokens", 2, ">= 1"),
    ("[model]\nthreads = -1\n", "model.threads", 2, ">= 0"),
    ("[model]\ndevice = \"gpu\"\n", "model.device", 2, "cpu, cuda"),
    ("[model]\npath = 3\n", "model.path", 2, "expected str"),
    ("[server]\nport = 1\n", "server", 1, "unknown section"),
    ("model = 3\n", "model", 1, "must be a table"),
    ("[modes]\nturbo = {}\n", "modes.turbo", 2, "unknown mode 'turbo'"),
    ("[modes.turbo]\n", "modes.turbo", 1, "unknown mode"),
])
def test_bad_values_name_key_file_and_line(tmp_path, text, key, line, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, registry=empty_registry())
    err = info.value
    assert err.key == key
    assert err.line == line
    assert err.source == str(path)
    message = str(err)
    assert f"{path}:{line}: {key}:" in message
    assert words in message


def test_config_error_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        parse_config("[model]\nbogus = 1\n", registry=empty_registry())


def test_toml_syntax_error_names_file_and_position(tmp_path):
    path = write(tmp_path, "[model]\nthreads = = 2\n")
    with pytest.raises(ConfigError, match=r"tinyloop.toml: invalid TOML: .*line 2"):
        load_config(path, registry=empty_registry())


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


DEFAULT_WINDOW = 256


def speculative_registry():
    registry = PluginRegistry()

    def configure_load(config, options):
        options["max_seq_len"] = config["window"]

    registry.register(Plugin(
        name="speculative", description="draft at a shallow depth",
        options=(Option("draft_depth", int, 1, minimum=1),
                 Option("window", int, DEFAULT_WINDOW)),
        configure_load=configure_load))
    return registry


def test_modes_are_resolved_through_the_registry(tmp_path):
    path = write(tmp_path, """
        [model]
        max_seq_len = 100
        [modes.speculative]
        draft_depth = 2
        """)
    config = load_config(path, registry=speculative_registry())
    (mode,) = config.modes
    assert mode.name == "speculative"
    assert dict(mode.config) == {"draft_depth": 2, "window": DEFAULT_WINDOW}
    # the mode's load hook runs after the [model] values
    assert config.load_options()["max_seq_len"] == DEFAULT_WINDOW


def test_mode_option_errors_carry_the_line(tmp_path):
    path = write(tmp_path, "[modes.speculative]\ndraft_depth = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, registry=speculative_registry())
    assert info.value.key == "modes.speculative.draft_depth"
    assert info.value.line == 2
    path = write(tmp_path, "[modes.speculative]\ndraft_dpth = 2\n")
    with pytest.raises(ConfigError, match=r":2: modes.speculative.draft_dpth: unknown option"):
        load_config(path, registry=speculative_registry())


def test_default_config_object():
    config = Config()
    assert config.model_path() is None
    assert config.load_options()["default_depth"] == 0


# -- modes applied by the model itself (Model.from_config) -------------------------------
def cap_tokens(config, options):
    options["max_tokens"] = config["max_tokens"]


def fixed_tokens(model, prompt_ids, options, config):
    yield from (int(t) for t in config["tokens"].split(","))


def half_of_the_tokens(model, prompt_ids, options, config):
    """A strategy over the model's own stream: it runs without the modes applied again."""
    return model.stream(prompt_ids, **dict(options, max_tokens=max(1, options["max_tokens"] // 2)))


def generation_registry():
    registry = PluginRegistry()
    registry.register(Plugin(name="cap_tokens", options=(Option("max_tokens", int, 2, minimum=1),),
                             configure_generate=cap_tokens))
    registry.register(Plugin(name="fixed_tokens", options=(Option("tokens", str, "5,6,7"),),
                             strategy=fixed_tokens))
    registry.register(Plugin(name="half", strategy=half_of_the_tokens))
    return registry


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("modes") / "text.tinyloop"
    textmodel.make_text_model(path)
    return path


def model_with(tmp_path, model_path, modes: str):
    config = write(tmp_path, f'[model]\npath = "{model_path}"\nthreads = 1\n{modes}')
    return tinyloop.Model.from_config(load_config(config, registry=generation_registry()))


def test_from_config_applies_generation_hooks(tmp_path, text_model):
    """A mode's configure_generate reaches every generation of the model: generate, stream,
    stream_text, generate_batch, and a context's."""
    greedy = dict(max_tokens=8, temperature=0)
    with tinyloop.Model(text_model, threads=1) as plain:
        expected = plain.generate("Hi", **greedy).tokens[:2]
        assert plain.modes == ()
    with model_with(tmp_path, text_model, "[modes.cap_tokens]\n") as model:
        assert [m.name for m in model.modes] == ["cap_tokens"]
        assert model.generate("Hi", **greedy).tokens == expected
        with model.stream("Hi", **greedy) as stream:
            assert list(stream) == expected
        assert "".join(model.stream_text("Hi", **greedy)) == model.tokenizer.decode(expected)
        assert [r.tokens for r in model.generate_batch(["Hi", "Hi"], **greedy)] == [expected] * 2
        with model.context() as ctx:
            assert ctx.generate("Hi", **greedy).tokens == expected


def test_from_config_applies_a_strategy(tmp_path, text_model):
    """A mode's strategy replaces the loop of every generation of the model, on the model
    and on its contexts, streamed (also through next_batch) or not."""
    with model_with(tmp_path, text_model, "[modes.fixed_tokens]\ntokens = \"5,6,7\"\n") as model:
        result = model.generate("Hi", max_tokens=8)
        assert result.tokens == [5, 6, 7] and result.stop_reason == "none"
        assert result.text == model.tokenizer.decode_continuation(model.tokenizer.encode("Hi"),
                                                                  [5, 6, 7])
        assert [r.tokens for r in model.generate_batch([[1, 2], [3]])] == [[5, 6, 7]] * 2
        with model.context() as ctx, ctx.stream([1, 2, 3]) as stream:
            assert stream.result is None
            assert [model.next_batch([stream])[0] for _ in range(4)] == [5, 6, 7, None]
            assert stream.tokens == [5, 6, 7]
        with pytest.raises(UnsupportedError, match="pool="):
            model.generate("Hi", pool=object())


def test_a_strategy_over_the_library_stream(tmp_path, text_model):
    """A strategy that returns the model's own stream gets the library's loop (no mode
    applied to it again) and its result."""
    with tinyloop.Model(text_model, threads=1) as plain:
        expected = plain.generate("Hi", max_tokens=3, temperature=0).tokens
    with model_with(tmp_path, text_model, "[modes.half]\n") as model:
        result = model.generate("Hi", max_tokens=6, temperature=0)
        assert result.tokens == expected and result.stop_reason == "max_tokens"
        assert isinstance(model.stream("Hi", max_tokens=6), tinyloop.TokenStream)


def test_from_config_speculative_mode(tmp_path, text_model):
    """The built-in speculative mode drafts in every generation of the model that can
    draft, with plain greedy decoding's tokens; one that asks for logprobs, or its own
    drafts, runs as asked."""
    greedy = dict(max_tokens=12, temperature=0)
    with tinyloop.Model(text_model, threads=1) as plain:
        expected = plain.generate("Hello", **greedy).tokens
    config = write(tmp_path, f'[model]\npath = "{text_model}"\nthreads = 1\n'
                             "[modes.speculative]\ndraft_depth = 1\nn_draft = 3\n")
    with tinyloop.Model.from_config(config) as model:
        result = model.generate("Hello", **greedy)
        assert result.tokens == expected and result.drafted_tokens > 0
        with model.context() as ctx, ctx.stream("Hello", **greedy) as stream:
            assert list(stream) == expected and stream.result.drafted_tokens > 0
        scored = model.generate("Hello", logprobs=True, **greedy)
        assert scored.tokens == expected and scored.drafted_tokens == 0
        assert len(scored.logprobs) == len(expected)
        own = model.generate("Hello", draft_depth=1, n_draft=1, **greedy)
        assert own.tokens == expected and own.drafted_tokens > 0
