"""The CLI and TOML front ends of every call: stop strings, drafts and trees, prefill
chunks, the logit lens, llama.cpp's short flags, prompts from stdin and files, defaults in
--help, `tinyloop modes`; and the small defects each layer had (min_p = 1, an out-of-range
model.depth, plugin hook errors without their file, depth 0 reported, counts as MiB)."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from cli_run import last_json, run
from tinyloop.cli import _HelpFormatter, build_parser
from tinyloop.config import load_config, parse_config
from tinyloop.errors import ConfigError
from tinyloop.plugins import Option, Plugin, PluginRegistry

GREEDY = ("--temperature", 0, "-t", 1)
PROMPT = "Once upon a time"


def run_with_stdin(*args, stdin: str):
    proc = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def shipped_plain():
    """The shipped model's greedy text after PROMPT (a trained model: words to stop at)."""
    return last_json(run("generate", "-p", PROMPT, "-n", 16, *GREEDY, "--json"))


# -- stop strings ------------------------------------------------------------------------
def test_stop_strings_end_the_text_before_the_first(shipped_plain):
    text = shipped_plain["text"]
    words = text.split()
    early, late = " " + words[3], words[6]
    assert early in text and late in text and text.index(early) < text.index(late)
    proc = run("generate", "-p", PROMPT, "-n", 16, *GREEDY, "--stop", late, "--stop", early, "--json")
    report = last_json(proc)
    assert report["text"] == text[:text.index(early)]
    assert report["stop_reason"] == "stop_sequence"
    assert proc.stdout.startswith(report["text"] + "\n")
    assert report["tokens"] == shipped_plain["tokens"][:len(report["tokens"])]


def test_stop_strings_from_the_config(tmp_path, shipped_plain):
    text = shipped_plain["text"]
    stop = " " + text.split()[4]
    config = tmp_path / "tinyloop.toml"
    config.write_text(f"[sampling]\ntemperature = 0\nstop = [{json.dumps(stop)}]\n")
    assert load_config(config).generate_options()["stop"] == [stop]
    report = last_json(run("generate", "--config", config, "-p", PROMPT, "-n", 16, "-t", 1, "--json"))
    assert report["text"] == text[:text.index(stop)] and report["stop_reason"] == "stop_sequence"
    # --stop replaces the config's
    other = last_json(run("generate", "--config", config, "-p", PROMPT, "-n", 16, "-t", 1,
                          "--stop", "zzz-not-there", "--json"))
    assert other["text"] == text


@pytest.mark.parametrize("value, words", [('"x"', "expected a list of strings"),
                                          ('["a", 1]', "expected a list of strings"),
                                          ('["a", ""]', "stop string 1 is empty")])
def test_a_bad_stop_list_names_the_key_and_line(value, words):
    with pytest.raises(ConfigError, match=rf"t.toml:2: sampling.stop: {words}"):
        parse_config(f"[sampling]\nstop = {value}\n", source="t.toml")


def test_no_stop_key_leaves_the_options_as_they_were():
    assert "stop" not in parse_config("").generate_options()


# -- drafts, trees, prefill chunks, context size ------------------------------------------
def test_drafts_and_trees_from_the_command_line(model_path):
    plain = last_json(run("generate", model_path, "Hello", "-n", 12, *GREEDY, "--json"))
    drafted = last_json(run("generate", model_path, "Hello", "-n", 12, *GREEDY, "--draft-depth", 1,
                            "--n-draft", 3, "--json"))
    assert drafted["tokens"] == plain["tokens"] and drafted["drafted_tokens"] > 0
    tree = last_json(run("generate", model_path, "Hello", "-n", 12, *GREEDY, "--draft-depth", 1,
                         "--tree", "2,1", "--tree-budget", 3, "--draft-p-min", 0.0, "--json"))
    assert tree["tokens"] == plain["tokens"] and tree["drafted_tokens"] > 0


@pytest.mark.parametrize("flag, value", [("--tree", "2,x"), ("--tree", "9"), ("--tree", "1,1,1,1,1,1,1,1,1"),
                                         ("--min-p", "1"), ("--stop", "")])
def test_bad_flag_values_are_usage_errors(model_path, flag, value):
    proc = run("generate", model_path, "Hi", flag, value, check=False)
    assert proc.returncode == 2 and flag in proc.stderr


def test_prefill_chunk_and_context_size(tmp_path, model_path):
    plain = last_json(run("generate", model_path, "Hello there", "-n", 6, *GREEDY, "--json"))
    chunked = last_json(run("generate", model_path, "Hello there", "-n", 6, *GREEDY, "--prefill-chunk", 2,
                            "--json"))
    assert chunked["tokens"] == plain["tokens"]
    config = tmp_path / "tinyloop.toml"
    config.write_text("[model]\nprefill_chunk = 3\nmax_seq_len = 40\n")
    assert load_config(config).load_options()["prefill_chunk"] == 3
    assert "prefill_chunk" not in parse_config("").load_options()
    from_config = last_json(run("generate", "--config", config, model_path, "Hello there", "-n", 6, *GREEDY,
                                "--json"))
    assert from_config["tokens"] == plain["tokens"]
    assert last_json(run("info", model_path, "-c", 48, "-t", 1, "--json"))["dims"]["max_seq_len"] == 48
    assert last_json(run("info", model_path, "--config", config, "--json"))["dims"]["max_seq_len"] == 40


# -- the logit lens ------------------------------------------------------------------------
def test_score_logit_lens_is_the_models(tmp_path, model_path, text_model):
    text = tmp_path / "t.txt"
    text.write_text("Hello there", encoding="utf-8")
    report = last_json(run("score", model_path, text, "--logit-lens", "--depth", 3, "--top", 2, "-t", 1,
                           "--json"))
    ids = text_model.tokenizer.encode("Hello there")
    logits = text_model.score_logit_lens(ids, max_depth=3)
    assert report["tokens"] == len(ids) and report["max_depth"] == 3
    assert [row["depth"] for row in report["logit_lens"]] == [1, 2, 3]
    for row, depth_logits in zip(report["logit_lens"], logits):
        assert row["top_logprobs"][0]["token"] == int(np.argmax(depth_logits))
        assert len(row["top_logprobs"]) == 2 and row["entropy"] > 0
    printed = run("score", model_path, text, "--logit-lens", "-t", 1).stdout.splitlines()
    assert len(printed) == text_model.info.max_depth and printed[0].startswith("depth  1: entropy")


# -- short flags, prompts from stdin and files ---------------------------------------------
def test_short_flags_are_the_long_ones(model_path):
    long = last_json(run("generate", "--model", model_path, "--prompt", "Hello", "--max-tokens", 5,
                         "--threads", 1, "--ctx-size", 64, "--temperature", 0, "--json"))
    short = last_json(run("generate", "-m", model_path, "-p", "Hello", "-n", 5, "-t", 1, "-c", 64,
                          "--temperature", 0, "--json"))
    positional = last_json(run("generate", model_path, "Hello", "-n", 5, *GREEDY, "--json"))
    assert long["tokens"] == short["tokens"] == positional["tokens"] and long["n_tokens"] == 5
    # -p with one positional argument: that one is the model
    assert last_json(run("generate", model_path, "-p", "Hello", "-n", 5, *GREEDY, "--json"))["tokens"] == \
        short["tokens"]
    bench = last_json(run("bench", model_path, "-p", 8, "-n", 4, "--repeat", 1, "-t", 1, "--json"))
    assert bench["prompt_tokens"] == 8 and bench["new_tokens"] == 4


def test_prompt_from_stdin_and_file(tmp_path, model_path):
    expected = last_json(run("generate", model_path, "Hello", "-n", 5, *GREEDY, "--json"))["tokens"]
    piped = run_with_stdin("generate", "-m", model_path, "-n", 5, *GREEDY, "--json", stdin="Hello\n")
    assert last_json(piped)["tokens"] == expected
    dash = run_with_stdin("generate", model_path, "-", "-n", 5, *GREEDY, "--json", stdin="Hello")
    assert last_json(dash)["tokens"] == expected
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello\n", encoding="utf-8")
    assert last_json(run("generate", model_path, "-f", prompt, "-n", 5, *GREEDY, "--json"))["tokens"] == expected
    missing = run("generate", model_path, "-f", tmp_path / "none.txt", "--json", check=False)
    assert missing.returncode == 1 and "cannot read the prompt" in last_json(missing)["error"]


def test_the_prompt_twice_or_none_is_a_usage_error(model_path):
    twice = run("generate", model_path, "Hello", "-p", "Hi", check=False)
    assert twice.returncode == 2 and "given twice" in twice.stderr
    both = run("generate", model_path, "-p", "Hi", "-f", "x.txt", check=False)
    assert both.returncode == 2 and "not allowed with" in both.stderr


# -- --help and modes --------------------------------------------------------------------
def test_help_shows_every_options_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = {name: p for name, p in sub.choices.items() if p.formatter_class is _HelpFormatter}
    assert {"generate", "chat", "score", "bench", "info", "serve", "modes"} <= set(commands)
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert "default" in formatter._get_help_string(action), (name, action.option_strings)
    text = run("serve", "--help").stdout
    assert re.search(r"--port PORT\s+port \(0 = any free\) \(default: 8080\)", text)


def test_modes_lists_the_installed_plugins_with_their_options():
    report = last_json(run("modes", "--json"))
    modes = {m["name"]: m for m in report["modes"]}
    assert {"speculative", "tree_speculative", "paged_kv", "kv_share", "fp16_body"} <= set(modes)
    options = {o["name"]: o for o in modes["paged_kv"]["options"]}
    assert options["page_size"]["type"] == "int" and options["page_size"]["default"] == 16
    assert modes["speculative"]["conflicts"] == ["tree_speculative"]
    assert modes["kv_share"]["options"][0]["choices"] == ["share_last", "ring", "store_h"]
    plain = run("modes").stdout
    assert "[modes.tree_speculative]" in plain and "page_size (int, default 16)" in plain


# -- defects -----------------------------------------------------------------------------
def test_generate_json_reports_the_depth_that_ran(model_path, text_model):
    default = text_model.info.default_depth
    report = last_json(run("generate", model_path, "Hi", "-n", 3, *GREEDY, "--json"))
    assert report["depth"] == default and set(report["depths"]) == {default}
    assert last_json(run("generate", model_path, "Hi", "-n", 3, "--depth", 3, *GREEDY, "--json"))["depth"] == 3
    text = Path(model_path).with_name("score.txt")
    text.write_text("Hello there", encoding="utf-8")
    assert last_json(run("score", model_path, text, "-t", 1, "--json"))["depth"] == default


def test_min_p_one_is_refused_by_every_layer_naming_the_key(text_model):
    with pytest.raises(ConfigError, match=r"t.toml:3: sampling.min_p: must be < 1.0, got 1.0"):
        parse_config("[sampling]\ntemperature = 1\nmin_p = 1.0\n", source="t.toml")
    assert parse_config("[sampling]\nmin_p = 0.99\n").sampling.min_p == 0.99
    with pytest.raises(ValueError, match=r"min_p must be < 1.0, got 1.0"):
        text_model.generate([1, 2], max_tokens=1, min_p=1.0)
    text_model.generate([1, 2], max_tokens=1, min_p=0.99)


def test_an_out_of_range_model_depth_names_the_key(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text(f'[model]\npath = "{model_path}"\ndepth = 99\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(config))}:3: model.depth: 99 exceeds the "
                                          r"model's max_depth 4") as caught:
        tinyloop.Model.from_config(config)
    assert caught.value.key == "model.depth" and caught.value.line == 3
    proc = run("generate", "--config", config, "Hi", "--json", check=False)
    assert proc.returncode == 1 and "model.depth" in last_json(proc)["error"]
    assert "default_depth" not in last_json(proc)["error"]


def _hook_registry():
    def refuse_load(config, options):
        if config["level"] > 2:
            raise ValueError(f"level {config['level']} is too high for this model")

    def refuse_generate(config, options):
        raise ConfigError("modes.fussy.level: not for generations", key="modes.fussy.level")

    registry = PluginRegistry()
    registry.register(Plugin("picky", options=(Option("level", int, 1),), configure_load=refuse_load))
    registry.register(Plugin("fussy", options=(Option("level", int, 1),), configure_generate=refuse_generate))
    return registry


def test_plugin_hook_errors_name_the_file_and_line(tmp_path, model_path):
    registry = _hook_registry()
    text = "[sampling]\ntemperature = 0\n\n[modes.picky]\nlevel = 3\n"
    config = parse_config(text, source="t.toml", registry=registry)
    with pytest.raises(ConfigError, match=r"^t.toml:4: modes.picky: level 3 is too high") as caught:
        config.load_options()
    assert caught.value.line == 4 and isinstance(caught.value.__cause__, ValueError)
    # a hook's ConfigError over a key left at its default points at the mode's table
    config = parse_config("[modes.fussy]\n", source="u.toml", registry=registry)
    with tinyloop.Model.from_config(config, path=model_path, threads=1) as model:
        with pytest.raises(ConfigError, match=r"^u.toml:1: modes.fussy.level: not for generations"):
            model.generate([1, 2], max_tokens=1)
    # the built-in kv_share's own check, through a file
    path = tmp_path / "kv.toml"
    path.write_text('[model]\nthreads = 1\n[modes.kv_share]\npolicy = "ring"\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}:3: modes.kv_share.ring_slots: policy "):
        load_config(path).load_options()


def test_info_shows_page_counts_as_counts(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text("[modes.paged_kv]\npage_size = 16\n")
    out = run("info", model_path, "--config", config, "-t", 1).stdout
    memory = next(line for line in out.splitlines() if line.startswith("memory:"))
    assert "kv_pag" not in memory and "kv_pages_" not in memory
    assert re.search(r"kv pages \d+ in use of 16 tokens each", memory)
    assert "kv_cache " in memory and "_bytes" not in memory
    plain = run("info", model_path, "-t", 1).stdout
    assert "kv pages" not in plain


def test_the_batch_header_comment_describes_batching():
    from tinyloop import _native
    header = _native.find_header(_native.find_library())   # the one the binding reads
    text = header.read_text(encoding="utf-8")
    comment = text[:text.index("TL_API tl_status tl_generate_batch(")].rsplit("/*", 1)[1]
    assert "comes later" not in comment and "batched forward pass" in comment


def test_chat_stops_at_stop_strings(tmp_path):
    pytest.importorskip("jinja2")
    import textmodel
    path = tmp_path / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=textmodel.CHATML)

    def reply(*flags):
        proc = run_with_stdin("chat", path, "-n", 8, *GREEDY, *flags, "--json", stdin="Hi\n/exit\n")
        return last_json(proc)["messages"][-1]["content"]

    whole = reply()
    assert len(whole) >= 3
    stop = whole[-2:]
    assert reply("--stop", stop) == whole[:whole.index(stop)]


def test_no_prompt_and_empty_stdin_is_a_usage_error(model_path):
    proc = subprocess.run([sys.executable, "-m", "tinyloop", "generate", "-m", str(model_path)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no prompt" in proc.stderr and "stdin was empty" in proc.stderr


@pytest.mark.parametrize("flag, key", [(("--state-init", "warm"), "model.state_init"),
                                       (("--cache-window", "16"), "model.cache_window"),
                                       (("--cache-window-approx",), "model.cache_window_approx")])
def test_serve_ray_refuses_flags_its_replicas_would_not_see(flag, key):
    # the replicas load the model from --config; a flag would reach this process only
    proc = run("serve", "--ray", *flag, check=False)
    assert proc.returncode != 0 and f"set {key} in the --config file" in proc.stderr, proc.stderr
