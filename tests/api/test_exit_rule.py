"""Exit rules of adaptive depth in the Python API, TOML and the CLI: ExitRule's parsing and
its errors, the C option structs it fills, the depths results report (their values are the
library's, tested with it; here their shapes and bounds, and the fixed rule's), the [exit]
table and `--exit`."""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import textmodel
import tinyloop
from cli_run import last_json, run
from tinyloop.chat_template import load_chat_template
from tinyloop.config import parse_config
from tinyloop.exit_rule import EXIT_KINDS, ExitRule, ExitRuleError, exit_rule
from tinyloop.model import _GenerateOptions
from tinyloop.plugins import PluginRegistry

DEPTH = 2   # textmodel's default depth


@pytest.mark.parametrize("text, rule", [
    ("kl:1e-3", ExitRule("kl", 1e-3)),
    ("entropy_delta:0.01", ExitRule("entropy_delta", 0.01)),
    ("latent_delta:0.05", ExitRule("latent_delta", 0.05)),
    ("argmax_stable:3", ExitRule("argmax_stable", patience=3)),
    ("argmax_stable", ExitRule("argmax_stable", patience=2)),
    ("gate:0.9", ExitRule("gate", 0.9)),
    ("fixed", ExitRule()),
    (" kl : 0.5 , min_depth = 2 ", ExitRule("kl", 0.5, min_depth=2)),
    ("argmax_stable,patience=4,min_depth=3", ExitRule("argmax_stable", min_depth=3, patience=4)),
    ({"rule": "kl", "threshold": 1e-3, "min_depth": 2}, ExitRule("kl", 1e-3, min_depth=2)),
    ({"rule": "argmax_stable", "patience": 5}, ExitRule("argmax_stable", patience=5)),
    ({"rule": "gate", "threshold": 1}, ExitRule("gate", 1.0)),
])
def test_parse(text, rule):
    parsed = ExitRule.parse(text)
    assert parsed == rule
    assert isinstance(parsed.threshold, float)
    # the string and dict forms read back to the same rule
    assert ExitRule.parse(str(parsed)) == parsed == ExitRule.parse(parsed.as_dict())
    assert ExitRule.parse(parsed) is parsed
    assert parsed.active == (parsed.kind != "fixed")
    assert parsed.probes == (parsed.kind in ("kl", "entropy_delta", "argmax_stable"))


def test_no_rule_is_none():
    assert exit_rule(None) is None
    assert exit_rule("kl:1") == ExitRule("kl", 1.0)


@pytest.mark.parametrize("value, key, words", [
    ("kl", "exit.threshold", "needs a threshold"),
    ("kl:", "exit", "nothing after"),
    ("kl:abc", "exit.threshold", "not a number"),
    ("kl:-1", "exit.threshold", ">= 0"),
    ("kl:nan", "exit.threshold", "finite"),
    ("kl:inf", "exit.threshold", "finite"),
    ("gate:0", "exit.threshold", "(0, 1]"),
    ("gate:1.5", "exit.threshold", "(0, 1]"),
    ("fixed:1", "exit.threshold", "takes no threshold"),
    ("argmax_stable:0", "exit.patience", "[1,"),
    ("argmax_stable:1.5", "exit.patience", "not an integer"),
    ("kl:1,min_depth=0", "exit.min_depth", "[1,"),
    ("kl:1,min_depth=x", "exit.min_depth", "not an integer"),
    ("kl:1,patience=2", "exit.patience", "takes no patience"),
    ("kl:1,depth=2", "exit", "min_depth=N"),
    ("kl:1,min_depth=2,min_depth=3", "exit.min_depth", "twice"),
    ("huginn:1", "exit.rule", "must be one of"),
    ("", "exit.rule", "must be one of"),
    ({"threshold": 1}, "exit.rule", "missing"),
    ({"rule": 3}, "exit.rule", "must be one of"),
    ({"rule": ["kl"]}, "exit.rule", "must be one of"),
    ({"rule": "kl", "threshold": "1e-3"}, "exit.threshold", "a number"),
    ({"rule": "kl", "threshold": True}, "exit.threshold", "a number"),
    ({"rule": "kl", "threshold": 1, "min_depth": 1.5}, "exit.min_depth", "an integer"),
    ({"rule": "argmax_stable", "threshold": 3}, "exit.threshold", "argmax_stable:N"),
    ({"rule": "kl", "threshold": 1, "window": 2}, "exit.window", "unknown key"),
    (0.5, "exit", "a string"),
])
def test_errors_name_the_field(value, key, words):
    with pytest.raises(ExitRuleError) as info:
        ExitRule.parse(value)
    assert info.value.key == key
    assert str(info.value).startswith(key + ":") and words in str(info.value)
    assert isinstance(info.value, tinyloop.InvalidArgumentError) and isinstance(info.value, ValueError)


def test_errors_name_the_given_field():
    with pytest.raises(ExitRuleError, match=r"^request\.exit\.threshold:"):
        ExitRule.parse("kl:-2", field="request.exit")
    with pytest.raises(ExitRuleError, match=r"^exit\.threshold:"):
        ExitRule("kl", -1.0)


@pytest.fixture(scope="module")
def lib(text_model):
    return text_model._native.lib


def test_kinds_are_the_headers(lib):
    for name, value in EXIT_KINDS.items():
        assert getattr(lib, f"TL_EXIT_{name.upper()}") == value


def test_generate_options_carry_the_rule(text_model, lib):
    opts = _GenerateOptions(text_model, exit="argmax_stable:3,min_depth=2").c
    assert (opts.exit.kind, opts.exit.min_depth, opts.exit.patience) == (lib.TL_EXIT_ARGMAX_STABLE, 2, 3)
    opts = _GenerateOptions(text_model, exit={"rule": "kl", "threshold": 1e-3}).c
    assert opts.exit.kind == lib.TL_EXIT_KL and opts.exit.threshold == pytest.approx(1e-3)
    assert opts.exit.min_depth == 1
    default = _GenerateOptions(text_model).c
    assert default.exit.kind == lib.TL_EXIT_FIXED and default.token_depths == text_model._native.ffi.NULL
    options = _GenerateOptions(text_model, max_tokens=5)
    depths = options.token_depths(text_model._native.ffi)
    assert options.c.token_depths != text_model._native.ffi.NULL and len(depths) == 5


def test_score_options_carry_the_rule(text_model, lib):
    opts = text_model._score_options(3, "gate:0.5")
    assert (opts.depth, opts.exit.kind, opts.exit.threshold) == (3, lib.TL_EXIT_GATE, 0.5)
    assert text_model._score_options(0).exit.kind == lib.TL_EXIT_FIXED


def test_generation_reports_depths(text_model):
    fixed = text_model.generate("Hello", max_tokens=6, temperature=0, eos=False)
    assert fixed.depths == [DEPTH] * 6 and fixed.mean_depth == DEPTH
    deep = text_model.generate("Hello", max_tokens=4, temperature=0, eos=False, depth=4, exit="fixed")
    assert deep.depths == [4] * 4 and deep.mean_depth == 4
    r = text_model.generate("Hello", max_tokens=6, temperature=0, eos=False, exit="kl:1e-3")
    assert len(r.depths) == 6 and all(1 <= d <= DEPTH for d in r.depths)
    assert r.mean_depth == pytest.approx(np.mean(r.depths))
    with text_model.stream("Hello", max_tokens=6, temperature=0, eos=False, exit="kl:1e-3") as stream:
        tokens = list(stream)
    assert tokens == r.tokens and stream.depths == r.depths == stream.result.depths
    logged = text_model.generate("Hello", max_tokens=6, temperature=0, eos=False, exit="kl:1e-3",
                                 logprobs=True)
    assert logged.depths == r.depths and logged.mean_depth == pytest.approx(r.mean_depth)
    with text_model.context() as ctx:
        assert ctx.generate("Hello", max_tokens=6, temperature=0, eos=False, exit="kl:1e-3").depths == r.depths
    batch = text_model.generate_batch(["Hello", "Hi"], max_tokens=3, temperature=0, eos=False,
                                      exit="argmax_stable")
    assert [b.depths for b in batch] == [None, None]   # one token_depths array cannot serve them all
    assert all(1 <= b.mean_depth <= DEPTH for b in batch)


def test_exit_with_drafts_is_refused(text_model):
    with pytest.raises(tinyloop.InvalidArgumentError, match="^exit: .*draft_depth"):
        text_model.generate("Hello", max_tokens=4, draft_depth=1, exit="kl:1e-3")
    with pytest.raises(ExitRuleError, match="^exit.rule"):
        text_model.generate("Hello", max_tokens=4, exit="soon:1")


def test_scoring_with_depths(text_model):
    ids = text_model.tokenizer.encode("Hello there, general")
    logprobs, depths = text_model.score_with_depths(ids)
    np.testing.assert_array_equal(logprobs, text_model.score(ids))
    assert depths.dtype == np.int32 and depths.tolist() == [DEPTH] * len(ids)
    logprobs, depths = text_model.score_with_depths(ids, exit="latent_delta:0.05")
    assert logprobs.shape == (len(ids) - 1,) and depths.shape == (len(ids),)
    assert 1 <= depths.min() and depths.max() <= DEPTH
    replay, given = text_model.score_with_depths(ids, given_depths=depths)
    assert replay.shape == logprobs.shape and given.shape == depths.shape
    with text_model.context() as ctx:
        assert ctx.score_with_depths(ids, depth=3)[1].tolist() == [3] * len(ids)
    scored, predicted = text_model.score_windows(ids, ctx=6, exit="kl:1e-3", with_depths=True)
    assert scored.shape == predicted.shape == (len(ids) - 1,)
    lp, ent, predicted = text_model.score_windows(ids, ctx=6, uncertainty=True, with_depths=True)
    assert lp.shape == ent.shape == predicted.shape and predicted.tolist() == [DEPTH] * (len(ids) - 1)
    assert np.isfinite(text_model.perplexity(ids, exit="kl:1e-3"))


@pytest.mark.parametrize("given, error, words", [
    ([1, 1], tinyloop.InvalidArgumentError, "one per token"),
    ("depths", TypeError, "ints"),
    ([1.0] * 4, TypeError, "ints"),
    ([0, 1, 1, 1], tinyloop.InvalidArgumentError, "1..2"),
    ([1, 1, 1, 3], tinyloop.InvalidArgumentError, "1..2"),
])
def test_given_depths_are_checked(text_model, given, error, words):
    with pytest.raises(error, match=re.escape(words)):
        text_model.score_with_depths([1, 2, 3, 4], given_depths=given)


def test_given_depths_exclude_an_exit_rule(text_model):
    with pytest.raises(tinyloop.InvalidArgumentError, match="^given_depths: not with an exit rule"):
        text_model.score_with_depths([1, 2, 3], exit="kl:1", given_depths=[1, 1, 1])
    # the fixed rule is no exit rule
    assert text_model.score_with_depths([1, 2, 3], exit="fixed", given_depths=[2, 2, 2])[1].shape == (3,)


def test_model_without_gate_refuses_the_gate_rule(text_model):
    if not hasattr(text_model._native.lib, "tl_stream_token_depth"):
        pytest.skip("the library predates adaptive depth")
    assert "loop.exit_gate" not in text_model.info.metadata
    with pytest.raises((tinyloop.UnsupportedError, tinyloop.InvalidArgumentError)):
        text_model.generate("Hello", max_tokens=2, exit="gate:0.9")
    with pytest.raises((tinyloop.UnsupportedError, tinyloop.InvalidArgumentError)):
        text_model.score_with_depths([1, 2, 3], exit="gate:0.9")



# -- TOML [exit] -------------------------------------------------------------------------------
def _config(text):
    return parse_config(textwrap.dedent(text), source="t.toml", registry=PluginRegistry())


def test_config_exit_table():
    config = _config("""
        [exit]
        rule = "kl"
        threshold = 1e-3
        min_depth = 2
        """)
    assert config.exit == ExitRule("kl", 1e-3, min_depth=2)
    assert config.generate_options()["exit"] == config.exit
    assert _config('[exit]\nrule = "argmax_stable"\npatience = 3\n').exit == ExitRule("argmax_stable", patience=3)
    assert _config('[exit]\nrule = "gate"\nthreshold = 1\n').exit.threshold == 1.0
    assert _config("").exit is None and "exit" not in _config("").generate_options()


@pytest.mark.parametrize("text, key, line, words", [
    ('[exit]\nrule = "kl"\n', "exit.threshold", 1, "needs a threshold"),   # the table's line
    ('[exit]\nrule = "soon"\nthreshold = 1\n', "exit.rule", 2, "must be one of"),
    ('[exit]\nthreshold = 0.1\n', "exit.rule", 1, "missing"),
    ('[exit]\nrule = "kl"\nthreshold = -1\n', "exit.threshold", 3, ">= 0"),
    ('[exit]\nrule = "kl"\nthreshold = "1e-3"\n', "exit.threshold", 3, "expected float"),
    ('[exit]\nrule = "gate"\n\nthreshold = 1.5\n', "exit.threshold", 4, "(0, 1]"),
    ('[exit]\nrule = "kl"\nthreshold = 1\nmin_depth = 0\n', "exit.min_depth", 4, ">= 1"),
    ('[exit]\nrule = "kl"\nthreshold = 1\npatience = 2\n', "exit.patience", 4, "takes no patience"),
    ('[exit]\nrule = "argmax_stable"\nthreshold = 3\n', "exit.threshold", 3, "argmax_stable:N"),
    ('[exit]\nrule = "kl"\nthreshold = 1\nwindow = 2\n', "exit.window", 4, "unknown key"),
    ('exit = "kl:1e-3"\n', "exit", 1, "must be a table"),
])
def test_config_exit_errors_name_the_key(text, key, line, words):
    with pytest.raises(tinyloop.ConfigError) as info:
        _config(text)
    error = info.value
    assert (error.key, error.line) == (key, line)
    assert f"t.toml:{line}: {key}: " in str(error) and words in str(error)


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_generate_reports_depths(model_path):
    report = last_json(run("generate", model_path, "Hello", "--max-tokens", 5, "--temperature", 0,
                           "--exit", "kl:1e-3", "--json"))
    assert report["exit"] == "kl:0.001" and len(report["depths"]) == report["n_tokens"] == 5
    assert report["mean_depth"] == pytest.approx(np.mean(report["depths"]))
    plain = last_json(run("generate", model_path, "Hello", "--max-tokens", 5, "--temperature", 0, "--json"))
    assert plain["exit"] is None and plain["depths"] == [DEPTH] * 5 and plain["mean_depth"] == DEPTH


def test_cli_score_prints_the_mean_depth(tmp_path, model_path):
    text = tmp_path / "t.txt"
    text.write_text("The loop runs until the token has converged. " * 3, encoding="utf-8")
    proc = run("score", model_path, text, "--exit", "latent_delta:0.05")
    assert "perplexity: " in proc.stdout and "mean_depth: " in proc.stdout
    report = last_json(run("score", model_path, text, "--exit", "kl:1e-3", "--json"))
    assert report["exit"] == "kl:0.001" and 1 <= report["mean_depth"] <= DEPTH
    plain = run("score", model_path, text)
    assert "mean_depth" not in plain.stdout


def test_cli_exit_from_config_and_flag(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text('[exit]\nrule = "argmax_stable"\npatience = 2\n', encoding="utf-8")
    report = last_json(run("generate", model_path, "Hi", "--max-tokens", 3, "--config", config, "--json"))
    assert report["exit"] == "argmax_stable:2"
    report = last_json(run("generate", model_path, "Hi", "--max-tokens", 3, "--config", config,
                           "--exit", "fixed", "--json"))
    assert report["exit"] == "fixed" and report["depths"] == [DEPTH] * 3
    bench = last_json(run("bench", model_path, "--prompt-tokens", 4, "--new-tokens", 4, "--repeat", 1,
                          "--config", config, "--json"))
    assert bench["exit"] == "argmax_stable:2" and 1 <= bench["mean_depth"] <= DEPTH


@pytest.mark.parametrize("command", ["generate", "chat", "score", "bench", "serve"])
def test_cli_bad_exit_is_a_usage_error(model_path, command):
    args = {"generate": [model_path, "Hi"], "score": [model_path, "f.txt"]}.get(command, [model_path])
    proc = run(command, *args, "--exit", "kl:-1", check=False)
    assert proc.returncode == 2
    assert "argument --exit: threshold: must be a finite number >= 0" in proc.stderr


def test_speculative_modes_leave_a_generation_with_an_exit_rule_alone():
    from tinyloop_plugins import add_drafts
    for rule in ("kl:1e-3", ExitRule("argmax_stable")):
        options = {"max_tokens": 4, "exit": rule}
        add_drafts(options, draft_depth=1, n_draft=3)
        assert "draft_depth" not in options
    for rule in (None, "fixed"):   # no rule, or one that never exits early: drafts as before
        options = {"max_tokens": 4, "exit": rule}
        add_drafts(options, draft_depth=1, n_draft=3)
        assert options["draft_depth"] == 1


def test_cli_chat_under_an_exit_rule_continues_its_sequence(tmp_path):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    path = tmp_path / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=textmodel.CHATML)
    proc = subprocess.run([sys.executable, "-m", "tinyloop", "chat", str(path), "--max-tokens", "5",
                           "--temperature", "0", "--threads", "1", "--exit", "latent_delta:0.05", "--json"],
                          input="Hi\nHow are you?\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = last_json(proc)
    assert report["turns"] == 2 and report["cached_tokens"][1] > 0
    # the second turn is what a fresh pass under the same rule gives
    with tinyloop.Model(path, threads=1) as model:
        ids = model.tokenizer.encode(load_chat_template(model)(report["messages"][:3]), add_bos=False)
        fresh = model.generate(ids, max_tokens=5, temperature=0, exit="latent_delta:0.05")
        assert model.tokenizer.decode(fresh.tokens) == report["messages"][3]["content"]
