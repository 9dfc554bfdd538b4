"""The load option kv_dtype (docs/api.md, "KV dtype") on the CPU: its default is f32, f16
is refused with a clear error (the CPU keeps its KV cache in f32), the model's info names
it, and tinyloop.toml's model.kv_dtype reaches the load. fp16 KV
itself runs on CUDA: lib/test_cuda_backend.py holds it to the f32 path."""

import textwrap

import pytest

import tinyloop
from tinyloop.config import load_config
from tinyloop.errors import ConfigError, UnsupportedError
from tinyloop.plugins import PluginRegistry


@pytest.mark.parametrize("kv_dtype", ["default", "f32"])
def test_the_cpu_keeps_f32(model_path, kv_dtype):
    with tinyloop.Model(model_path, kv_dtype=kv_dtype) as model, model.context() as ctx:
        assert model.info.kv_dtype == "f32"
        ctx.append([1, 2, 3])
        assert model.memory_report()["kv_cache_bytes"] > 0


def test_f16_on_the_cpu_is_refused_with_the_reason(model_path):
    with pytest.raises(UnsupportedError, match="kv_dtype f16: the cpu .* keeps its KV cache in f32"):
        tinyloop.Model(model_path, kv_dtype="f16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        tinyloop.Model(model_path, kv_dtype="bf16")
    with pytest.raises(TypeError, match="kv_dtype must be a str"):
        tinyloop.Model(model_path, kv_dtype=2)


def test_the_config_key_reaches_the_load(tmp_path, model_path):
    def config(text):
        path = tmp_path / "tinyloop.toml"
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return load_config(path, registry=PluginRegistry())

    assert "kv_dtype" not in config("[model]\n").load_options()   # the backend's default
    loaded = config(f'[model]\npath = "{model_path}"\nkv_dtype = "f32"\n')
    assert loaded.load_options()["kv_dtype"] == "f32"
    with tinyloop.Model.from_config(loaded) as model:
        assert model.info.kv_dtype == "f32"
    with pytest.raises(UnsupportedError, match="kv_dtype f16"):
        tinyloop.Model.from_config(config(f'[model]\npath = "{model_path}"\nkv_dtype = "f16"\n'))
    with pytest.raises(ConfigError, match="model.kv_dtype"):
        config('[model]\nkv_dtype = "f8"\n')
