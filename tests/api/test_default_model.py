"""The default model: how it is found, the CLI forms that use it, and that the package
build installs the models folder. A tiny random model stands in for the trained one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import textmodel
import tinyloop
from tinyloop import cli, default_model
from tinyloop.default_model import DEFAULT_MODEL_NAME, OVERRIDE_VARIABLE, DefaultModelMissingError
from build_tools import find_tool

ROOT = Path(__file__).resolve().parents[2]
CARD = "# Tiny test model\n\nA random model with a byte-level tokenizer.\n"
MAX_MODEL_BYTES = 32 * 2**20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A model with its card next to it, as the package ships them."""
    folder = tmp_path_factory.mktemp("default-model")
    path = folder / "tiny.tinyloop"
    textmodel.make_text_model(path)
    (folder / "tiny.md").write_text(CARD, encoding="utf-8")
    return path


@pytest.fixture
def packaged(tmp_path, model_path, monkeypatch):
    """A models folder holding the tiny model under the default model's name."""
    shutil.copy(model_path, tmp_path / f"{DEFAULT_MODEL_NAME}.tinyloop")
    (tmp_path / f"{DEFAULT_MODEL_NAME}.md").write_text(CARD, encoding="utf-8")
    monkeypatch.setattr(default_model, "MODELS_DIR", tmp_path)
    monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)
    return tmp_path / f"{DEFAULT_MODEL_NAME}.tinyloop"


@pytest.fixture
def no_packaged_model(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "MODELS_DIR", tmp_path / "models")
    monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)


def run(*args, default=None, check=True):
    """`python -m tinyloop ARGS` with $TINYLOOP_DEFAULT_MODEL set to `default`."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env.pop(OVERRIDE_VARIABLE, None)
    if default is not None:
        env[OVERRIDE_VARIABLE] = str(default)
    proc = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def last_json(text: str) -> dict:
    lines = text.strip().splitlines()
    assert lines
    return json.loads(lines[-1])


GREEDY = ("--max-tokens", 6, "--temperature", 0, "--threads", 1, "--json")


# -- resolution ------------------------------------------------------------------------
def test_packaged_model_is_the_default(packaged):
    found = default_model.resolve_default_model()
    assert found.path == packaged and found.source == "package"
    assert found.card() == CARD


def test_override_variable_wins(packaged, model_path, monkeypatch):
    monkeypatch.setenv(OVERRIDE_VARIABLE, str(model_path))
    found = default_model.resolve_default_model()
    assert found.path == model_path and found.source == OVERRIDE_VARIABLE
    assert found.card_path == model_path.with_suffix(".md")


def test_override_without_card(tmp_path, model_path, monkeypatch):
    bare = tmp_path / "bare.tinyloop"
    shutil.copy(model_path, bare)
    monkeypatch.setenv(OVERRIDE_VARIABLE, str(bare))
    assert default_model.default_model_card() is None


def test_missing_packaged_file_is_a_clear_error(no_packaged_model):
    with pytest.raises(DefaultModelMissingError) as error:
        default_model.default_model_path()
    message = str(error.value)
    assert DEFAULT_MODEL_NAME in message and OVERRIDE_VARIABLE in message
    assert "tinyloop pull smollm2-135m" in message
    assert isinstance(error.value, tinyloop.ModelIOError)


def test_missing_packaged_file_in_the_cli(no_packaged_model, capsys):
    assert cli.main(["generate", "Hello", "--json"]) == 1
    report = last_json(capsys.readouterr().out)
    assert report["error_type"] == "DefaultModelMissingError"
    assert DEFAULT_MODEL_NAME in report["error"]


def test_bad_override_names_the_variable():
    proc = run("info", "--json", default="no-such-model", check=False)
    assert proc.returncode == 1
    assert f"{OVERRIDE_VARIABLE}=no-such-model" in last_json(proc.stdout)["error"]


# -- the CLI without a model -------------------------------------------------------------
def test_generate_without_model_uses_the_default(model_path):
    named = last_json(run("generate", model_path, "Hello", *GREEDY).stdout)
    default = last_json(run("generate", "Hello", *GREEDY, default=model_path).stdout)
    option = last_json(run("generate", "-m", model_path, "Hello", *GREEDY).stdout)
    assert default["model"] == option["model"] == named["model"] == str(model_path)
    assert default["tokens"] == named["tokens"] == option["tokens"]


def test_packaged_model_in_process(packaged, capsys):
    """No variable, no model named: the file in the package's models folder is used,
    and it also resolves by its name."""
    assert cli.main(["generate", "Hello", *map(str, GREEDY)]) == 0
    assert last_json(capsys.readouterr().out)["model"] == str(packaged)
    assert cli.main(["info", "-m", DEFAULT_MODEL_NAME, "--threads", "1", "--json"]) == 0
    report = last_json(capsys.readouterr().out)
    assert report["path"] == str(packaged) and "card" not in report


def test_model_given_twice_is_a_usage_error(model_path):
    proc = run("generate", "-m", model_path, model_path, "Hello", check=False)
    assert proc.returncode == 2 and "given twice" in proc.stderr


def test_info_without_model_shows_the_card(model_path):
    report = last_json(run("info", "--threads", 1, "--json", default=model_path).stdout)
    assert report["path"] == str(model_path)
    assert report["card"] == CARD and report["card_path"] == str(model_path.with_suffix(".md"))
    assert report["default_model"] == OVERRIDE_VARIABLE
    assert report["dims"]["vocab_size"] == textmodel.VOCAB
    plain = run("info", "--threads", 1, default=model_path).stdout
    assert "dims:" in plain and f"card:         {model_path.with_suffix('.md')}" in plain
    assert plain.rstrip().endswith(CARD.rstrip())


def test_info_with_model_is_unchanged(model_path):
    report = last_json(run("info", model_path, "--threads", 1, "--json").stdout)
    assert not {"card", "card_path", "default_model"} & report.keys()
    assert "card:" not in run("info", model_path, "--threads", 1).stdout


def test_score_and_bench_without_model(tmp_path, model_path):
    text = tmp_path / "text.txt"
    text.write_text("A short text to score. " * 4, encoding="utf-8")
    named = last_json(run("score", model_path, text, "--threads", 1, "--json").stdout)
    default = last_json(run("score", text, "--threads", 1, "--json", default=model_path).stdout)
    option = last_json(run("score", "-m", model_path, text, "--threads", 1, "--json").stdout)
    assert default["perplexity"] == named["perplexity"] == option["perplexity"]
    assert default["model"] == str(model_path)
    bench = last_json(run("bench", "--prompt-tokens", 8, "--new-tokens", 4, "--repeat", 1,
                          "--threads", 1, "--json", default=model_path).stdout)
    assert bench["model"] == str(model_path) and bench["decode_tokens_per_s"] > 0


def test_config_model_comes_before_the_default(tmp_path, model_path, no_packaged_model, capsys):
    config = tmp_path / "tinyloop.toml"
    config.write_text(f'[model]\npath = "{model_path}"\nthreads = 1\n')
    assert cli.main(["generate", "--config", str(config), "Hi", "--max-tokens", "2",
                     "--json"]) == 0
    assert last_json(capsys.readouterr().out)["model"] == str(model_path)


# -- Python API ----------------------------------------------------------------------------
def test_model_default(packaged, model_path, monkeypatch):
    with tinyloop.Model.default(threads=1) as model:
        assert model.path == str(packaged)
    monkeypatch.setenv(OVERRIDE_VARIABLE, str(model_path))
    with tinyloop.Model.default(threads=1) as model:
        assert model.path == str(model_path)


def test_from_config_without_path_loads_the_default(tmp_path, packaged):
    config = tmp_path / "tinyloop.toml"
    config.write_text("[model]\nthreads = 1\n")
    with tinyloop.Model.from_config(config) as model:
        assert model.path == str(packaged) and model.info.n_threads == 1


# -- what the package ships ------------------------------------------------------------------
def _tool(name):
    return find_tool(name, "check the install rules")


def test_build_installs_the_models_folder(tmp_path):
    """meson-python builds wheels (and editable installs) from meson's install plan: the
    models folder must be in it, inside the tinyloop package."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run([_tool("meson"), "setup", str(tmp_path / "build"), str(ROOT),
                    "-Dcuda=disabled"], check=True, env=env, capture_output=True, text=True)
    plan = json.loads(subprocess.run(
        [_tool("meson"), "introspect", "--install-plan", str(tmp_path / "build")],
        check=True, env=env, capture_output=True, text=True).stdout)
    sources = {Path(src).resolve(): entry["destination"] for section in plan.values()
               for src, entry in section.items()}
    package_dir = sources[ROOT / "python" / "tinyloop" / "cli.py"].rsplit("/", 1)[0]
    assert sources[ROOT / "python" / "tinyloop" / "models"] == f"{package_dir}/models"
    assert sources[ROOT / "python" / "tinyloop" / "default_model.py"] == (
        f"{package_dir}/default_model.py")


def test_package_carries_the_default_models_card():
    card = default_model.MODELS_DIR / f"{DEFAULT_MODEL_NAME}.md"
    assert card.read_text(encoding="utf-8").startswith(f"# {DEFAULT_MODEL_NAME}\n")


@pytest.mark.skipif(not (default_model.MODELS_DIR / f"{DEFAULT_MODEL_NAME}.tinyloop").exists(),
                    reason="the trained default model is not in this installation")
def test_shipped_default_model_is_usable():
    from tinyloop.fileformat.tinyloop_file import read_file
    path = default_model.packaged_model_path()
    assert path.stat().st_size <= MAX_MODEL_BYTES
    with read_file(path) as f:
        assert "tokenizer.json" in f.metadata and f.dims["n_core"] > 0
    with tinyloop.Model(path, threads=1) as model:
        result = model.generate("Once upon a time", max_tokens=4, temperature=0)
        assert len(result.tokens) <= 4
    assert default_model.card_path_for(path) is not None
