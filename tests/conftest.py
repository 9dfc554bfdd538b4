"""What the test layers share: the helper modules beside this file (textmodel, serving,
device, build_tools), importable from every folder below, and the model fixtures more than
one test module uses. A fixture keeps the scope it had in its module: a module-scoped one
is still made once per test module.

On CUDA the KV cache defaults to fp16 (docs/api.md, "KV dtype"). The suites that hold a
device to the float64 oracle at the float tolerance run on the f32 cache, which is exact
to fp32 rounding: here a Model that is not given kv_dtype gets "f32" (the CPU's default
anyway). lib/test_cuda_backend.py loads f16 (and "default") explicitly and holds f16 to
the f32 path within KV_F16_TOLERANCE."""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import textmodel  # noqa: E402
import tinyloop  # noqa: E402
from serving import Running  # noqa: E402

_model_init = tinyloop.Model.__init__


@functools.wraps(_model_init)
def _f32_kv_unless_asked(self, *args, kv_dtype="f32", **kwargs):
    _model_init(self, *args, kv_dtype=kv_dtype, **kwargs)


tinyloop.Model.__init__ = _f32_kv_unless_asked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder for the random model files a test module writes."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny random model with a byte-level tokenizer (textmodel.py)."""
    path = tmp_path_factory.mktemp("text") / "text.tinyloop"
    textmodel.make_text_model(path)
    return path


@pytest.fixture(scope="module")
def text_model(model_path):
    """That model opened: token b is byte b, 256/257 BOS/EOS."""
    with tinyloop.Model(model_path, device="cpu", threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def shipped():
    """The shipped default model (python/tinyloop/models)."""
    from tinyloop.default_model import default_model_path
    with tinyloop.Model(default_model_path(), threads=2) as m:
        yield m


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two text models: a plain one and one with a chat template (textmodel.CHATML)."""
    folder = tmp_path_factory.mktemp("server")
    plain, chat = folder / "plain.tinyloop", folder / "chat.tinyloop"
    textmodel.make_text_model(plain)
    textmodel.make_text_model(chat, chat_template=textmodel.CHATML)
    return plain, chat


@pytest.fixture(scope="module")
def server(paths):
    """A server of the plain text model with two slots."""
    running = Running(paths[0], parallel=2)
    yield running
    running.close()


@pytest.fixture(scope="module")
def chat_server(paths):
    """A server of the chat text model."""
    running = Running(paths[1])
    yield running
    running.close()
