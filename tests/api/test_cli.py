"""`python -m tinyloop ...` end to end on a tiny random model with a tokenizer."""

import os
import subprocess
import sys

import numpy as np
import pytest

import textmodel
import tinyloop
from cli_run import last_json, run
from tinyloop.chat_template import load_chat_template
from tinyloop.config import load_config
from tinyloop.fileformat.tinyloop_file import copy_file, read_file


def test_generate_streams_text_and_reports(model_path):
    proc = run("generate", model_path, "Hello", "--max-tokens", 8, "--temperature", 0,
               "--threads", 1, "--json")
    report = last_json(proc)
    assert report["n_tokens"] == len(report["tokens"]) <= 8
    assert report["prompt_tokens"] == 6
    assert report["stop_reason"] in ("max_tokens", "eos")
    assert report["decode_tokens_per_s"] >= 0
    # the streamed text precedes the JSON line
    assert proc.stdout.startswith(report["text"])
    plain = run("generate", model_path, "Hello", "--max-tokens", 8, "--temperature", 0,
                "--threads", 1)
    assert plain.stdout.rstrip("\n") == report["text"]
    assert "tok/s" in plain.stderr


def test_generate_is_seeded(model_path):
    args = ("generate", model_path, "Once", "--max-tokens", 10, "--temperature", 1.0,
            "--top-k", 0, "--top-p", 1.0, "--min-p", 0, "--seed", 5, "--depth", 3,
            "--repetition-penalty", 1.1, "--threads", 1, "--json")
    first, second = last_json(run(*args)), last_json(run(*args))
    assert first["tokens"] == second["tokens"] and first["depth"] == 3


def test_generate_uses_config(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text(f'[model]\npath = "{model_path}"\nthreads = 1\n'
                      "[sampling]\ntemperature = 0\nmax_tokens = 4\n")
    report = last_json(run("generate", "--config", config, "Hi", "--json"))
    assert report["n_tokens"] <= 4
    overridden = last_json(run("generate", "--config", config, "Hi", "--max-tokens", 6,
                               "--json"))
    assert overridden["n_tokens"] <= 6 and overridden["tokens"][:4] == report["tokens"]


def test_speculative_mode_from_config(tmp_path, model_path):
    """[modes.speculative] gives plain greedy decoding's tokens and reports its drafts;
    with sampling left on it samples (speculative sampling), seeded."""
    plain = last_json(run("generate", model_path, "Hello", "--max-tokens", 12, "--temperature",
                          0, "--threads", 1, "--json"))
    config = tmp_path / "tinyloop.toml"
    config.write_text("[sampling]\ntemperature = 0\n"
                      "[modes.speculative]\ndraft_depth = 1\nn_draft = 3\n")
    spec = last_json(run("generate", model_path, "Hello", "--max-tokens", 12, "--threads", 1,
                         "--config", config, "--json"))
    assert spec["mode"] == "speculative" and spec["tokens"] == plain["tokens"]
    assert spec["stop_reason"] == plain["stop_reason"]
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] and spec["drafted_tokens"] > 0
    config.write_text("[modes.speculative]\ndraft_depth = 1\n")
    sampled = [last_json(run("generate", model_path, "Hello", "--max-tokens", 12, "--threads", 1,
                             "--config", config, "--seed", 3, "--json")) for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"] and sampled[0]["drafted_tokens"] > 0


def test_speculative_mode_sets_the_draft_vocabulary(tmp_path, model_path):
    """[modes.speculative] draft_vocab reaches the load options: the drafts of a file with
    token frequencies score that many tokens (same greedy tokens); a file without them is
    a clear error for N > 0 and the whole vocabulary for the default -1."""
    with read_file(model_path) as f:
        vocab = f.dims["vocab_size"]
    counted = tmp_path / "counted.tinyloop"
    copy_file(model_path, counted, tensors={"vocab.frequency": np.linspace(1, 0, vocab, dtype=np.float32)})
    config = tmp_path / "tinyloop.toml"
    config.write_text("[sampling]\ntemperature = 0\n[modes.speculative]\ndraft_vocab = 8\n")
    assert load_config(config).load_options()["draft_vocab"] == 8
    plain = last_json(run("generate", counted, "Hello", "--max-tokens", 12, "--temperature", 0,
                          "--threads", 1, "--json"))
    spec = last_json(run("generate", counted, "Hello", "--max-tokens", 12, "--threads", 1,
                         "--config", config, "--json"))
    assert spec["tokens"] == plain["tokens"] and spec["drafted_tokens"] > 0
    proc = run("generate", model_path, "Hello", "--threads", 1, "--config", config, "--json",
               check=False)
    assert proc.returncode == 1 and "vocab.frequency" in proc.stderr


def test_bad_config_is_a_clear_error(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text("[sampling]\ntop_q = 0.5\n")
    proc = run("generate", model_path, "Hi", "--config", config, "--json", check=False)
    assert proc.returncode == 1
    assert "sampling.top_q" in proc.stderr and f"{config}:2" in proc.stderr
    assert last_json(proc)["error_type"] == "ConfigError"


def test_score(tmp_path, model_path):
    text = tmp_path / "text.txt"
    text.write_text("A short public-domain text, scored in windows. " * 6, encoding="utf-8")
    report = last_json(run("score", model_path, text, "--ctx", 32, "--threads", 1, "--json"))
    assert report["tokens"] == 1 + len(text.read_bytes())  # BOS + one token per byte
    assert report["scored_tokens"] == report["tokens"] - 1
    import tinyloop
    with tinyloop.Model(model_path, threads=1) as model:
        ids = model.tokenizer.encode(text.read_text(encoding="utf-8"))
        assert report["perplexity"] == pytest.approx(model.perplexity(ids, ctx=32), rel=1e-6)
    assert report["tokens_per_s"] > 0
    plain = run("score", model_path, text, "--ctx", 32, "--threads", 1)
    assert "perplexity:" in plain.stdout and "tokens_per_s:" in plain.stdout
    unsure = last_json(run("score", model_path, text, "--ctx", 32, "--threads", 1, "--uncertainty",
                           "--json"))
    with tinyloop.Model(model_path, threads=1) as model:
        logprobs, entropies = model.score_windows(ids, ctx=32, uncertainty=True)
        assert np.array_equal(logprobs, model.score_windows(ids, ctx=32))
        first_window = model.score_with_uncertainty(ids[:32])
    assert unsure["perplexity"] == report["perplexity"]
    assert unsure["mean_entropy"] == pytest.approx(float(np.mean(entropies, dtype=np.float64)), rel=1e-6)
    assert len(entropies) == len(ids) - 1 and np.all(entropies >= 0)
    assert np.array_equal(entropies[:31], first_window[1])


def test_score_window_longer_than_model_fails_cleanly(tmp_path, model_path):
    text = tmp_path / "long.txt"
    text.write_text("x" * 200)
    proc = run("score", model_path, text, "--ctx", 500, "--threads", 1, "--json", check=False)
    assert proc.returncode == 1
    assert last_json(proc)["error_type"] == "ContextFullError"


def test_bench(model_path):
    report = last_json(run("bench", model_path, "--prompt-tokens", 16, "--new-tokens", 8,
                           "--repeat", 2, "--threads", 1, "--json"))
    assert report["prefill_tokens_per_s"] > 0 and report["decode_tokens_per_s"] > 0
    assert report["peak_rss_mb"] > 1
    assert len(report["runs"]["decode_tokens_per_s"]) == 2
    proc = run("bench", model_path, "--prompt-tokens", 90, "--new-tokens", 90, "--json",
               check=False)
    assert proc.returncode == 1 and "max_seq_len" in last_json(proc)["error"]


def test_info(model_path):
    report = last_json(run("info", model_path, "--threads", 1, "--json"))
    assert report["dims"]["vocab_size"] == textmodel.VOCAB
    assert report["dims"]["max_depth"] == textmodel.MAX_DEPTH
    assert report["dtypes"]["f32"]["tensors"] > 0
    assert report["tokenizer"] is True and report["bos_token"] == textmodel.BOS
    assert report["memory"]["weights_bytes"] > 0
    plain = run("info", model_path, "--threads", 1)
    assert "dtype f32" in plain.stdout and "memory:" in plain.stdout
    assert report["draft_vocab"] == 0 and "drafts:       score every token" in plain.stdout


def test_info_shows_the_draft_vocabulary(tmp_path, model_path):
    """Token frequencies are no parameters; the drafts' vocabulary is reported."""
    with read_file(model_path) as f:
        vocab = f.dims["vocab_size"]
    counted = tmp_path / "counted.tinyloop"
    copy_file(model_path, counted, metadata={"draft.vocab_size": 5},
              tensors={"vocab.frequency": np.linspace(1, 0, vocab, dtype=np.float32)})
    before = last_json(run("info", model_path, "--threads", 1, "--json"))
    after = last_json(run("info", counted, "--threads", 1, "--json"))
    assert after["parameters"] == before["parameters"] and after["draft_vocab"] == 5
    assert "score the 5 most frequent tokens" in run("info", counted, "--threads", 1).stdout


def test_missing_model_names_the_pull_command(tmp_path):
    env = dict(os.environ, TINYLOOP_CACHE=str(tmp_path))
    for name, words in (("smollm2-135m", "tinyloop pull smollm2-135m"),
                        ("no-such-model", "no-such-model")):
        proc = subprocess.run([sys.executable, "-m", "tinyloop", "info", name, "--json"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 1
        assert words in last_json(proc)["error"]


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


def test_chat_keeps_the_conversation(tmp_path):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    path = tmp_path / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=CHAT_TEMPLATE)
    proc = subprocess.run([sys.executable, "-m", "tinyloop", "chat", str(path), "--system", "Be kind.",
                           "--max-tokens", "5", "--temperature", "0", "--threads", "1", "--json"],
                          input="Hi\n\nHow are you?\n/exit\nnever read\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = last_json(proc)
    assert report["turns"] == 2
    roles = [m["role"] for m in report["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in report["messages"] if m["role"] == "user"] == ["Hi", "How are you?"]
    # each reply is printed on its own line before the JSON line
    replies = [m["content"] for m in report["messages"] if m["role"] == "assistant"]
    assert all(replies) and proc.stdout.startswith(replies[0] + "\n" + replies[1] + "\n")
    # the second turn continued the first one's sequence, with the answer of a fresh pass
    assert report["cached_tokens"][0] == 0 and report["cached_tokens"][1] > report["prompt_tokens"][0]
    with tinyloop.Model(path, threads=1) as model:
        render = load_chat_template(model)
        ids = model.tokenizer.encode(render(report["messages"][:4]), add_bos=False)
        assert len(ids) == report["prompt_tokens"][1]
        fresh = model.generate(ids, max_tokens=5, temperature=0)
        assert model.tokenizer.decode(fresh.tokens) == replies[1]


def test_chat_drops_old_turns_to_fit_the_context(tmp_path):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    path = tmp_path / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=CHAT_TEMPLATE)
    lines = "".join(f"message {i} " + "x" * 20 + "\n" for i in range(4)) + "y" * 200 + "\n"
    proc = subprocess.run([sys.executable, "-m", "tinyloop", "chat", str(path), "--max-tokens", "3",
                           "--temperature", "0", "--threads", "1", "--json"], input=lines,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "oldest messages to fit the context" in proc.stderr
    assert "does not fit the context" in proc.stderr      # the 200-character message
    report = last_json(proc)
    assert report["turns"] == 4
    assert report["messages"][-2]["content"].startswith("message 3")


def test_chat_without_template_is_a_clear_error(model_path):
    proc = run("chat", model_path, "--json", check=False)
    assert proc.returncode == 1
    assert "no chat template" in last_json(proc)["error"]


def test_usage_errors_exit_2(model_path):
    assert run("generate", model_path, "x", "--max-tokens", 0, check=False).returncode == 2
    assert run("frobnicate", check=False).returncode == 2


def test_tool_commands_are_delegated():
    proc = run("convert", "--help")
    assert "--output" in proc.stdout
    proc = run("pull", "--help")
    assert "smollm2-135m" in proc.stdout
