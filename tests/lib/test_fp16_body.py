"""The load option body_dtype and the fp16_body mode (docs/api.md, "Body dtype").

The loop body's matrices (the core blocks' q/k/v/o, gate/up/down, and a concat
injection's W_a) are decoded at load and held as f16 (or f32). The float64 oracle is
given the same body: the file's dequantized values rounded to fp16 (f32: the values
themselves), every other tensor as stored. Checked for every parity case with a loop
(every architecture option and weight type, q8/q4/q2 at groups 32/64/128), at depths 1,
default and max; cached decode against full-sequence scoring; the distance to the
as-stored model against a bound from fp16's rounding; the shipped default model's
perplexity on real text; the memory report; errors; the plugin and TOML.

TINYLOOP_TEST_DEVICE picks the device, as in test_parity.
"""

import numpy as np
import pytest

import tinyloop
from reference import ReferenceModel
from reference.config import ModelConfig
from reference.ops import log_softmax, next_token_logprobs
from test_parity import CASES, DEVICE, DEVICE_TOLERANCE, ON_CPU, SAME, TOLERANCES, QUANTIZED_DTYPES, \
    assert_close, case_config, case_depths, case_tokens
from tinyloop.config import parse_config
from tinyloop.errors import ConfigError, InvalidArgumentError
from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import read_file

LOOP_CASES = [name for name in CASES if case_config(name)["n_core"] > 0]
BODY_SUFFIXES = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                 "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")


def is_body(name: str) -> bool:
    return name == "inject.weight" or (name.startswith("core.") and name.endswith(BODY_SUFFIXES))


_ORACLES = {}


def body_oracle(files, name, body_dtype):
    """The oracle of case `name` with its body's matrices as body_dtype holds them."""
    key = (name, body_dtype)
    if key not in _ORACLES:
        with read_file(files.path(name)) as f:
            config = ModelConfig.from_header(f.dims, f.metadata)
            weights = {n: np.array(f.tensor(n), dtype=np.float64) for n in f.tensors}
            quantized = {n for n, e in f.tensors.items() if e.dtype in QUANTIZED_DTYPES}
        for n in weights:
            if is_body(n) and body_dtype == "f16":
                weights[n] = weights[n].astype(np.float16).astype(np.float64)
        _ORACLES[key] = ReferenceModel(config, weights, {n for n in quantized if not is_body(n)})
    return _ORACLES[key]


def tolerance(config):
    """Test_parity's tolerances for what is left after the body: "quantized" when a
    matrix the backend multiplies outside the body (prelude, coda, tied head) is
    q8/q4/q2, else "float"."""
    if not ON_CPU:
        return DEVICE_TOLERANCE
    dtype = config.get("dtype", "f32")
    embed = config.get("embed_dtype") or dtype
    outside = (config["n_pre"] + config["n_post"] > 0 and dtype in QUANTIZED_DTYPES) or \
        (config.get("tied_embeddings", 1) and embed in QUANTIZED_DTYPES)
    return TOLERANCES["quantized" if outside else "float"]


@pytest.mark.parametrize("body_dtype", ["f16", "f32"])
@pytest.mark.parametrize("name", LOOP_CASES)
def test_matches_the_oracle_with_the_same_body(files, name, body_dtype):
    config = case_config(name)
    tokens = case_tokens(config)
    oracle = body_oracle(files, name, body_dtype)
    with tinyloop.Model(files.path(name), device=DEVICE, body_dtype=body_dtype) as model:
        assert model.info.body_dtype == body_dtype
        for depth in case_depths(config):
            logits = oracle.logits(tokens, depth)
            label = f"{name} body {body_dtype} depth {depth}"
            assert_close(model.score(tokens, depth=depth), next_token_logprobs(logits, tokens),
                         tolerance(config), f"{label}: log-probs")
            assert_close(model.score_last_token(tokens, depth=depth), logits[-1], tolerance(config),
                         f"{label}: last logits")


CACHE_CASES = ["base", "init-warm", "injection-concat", "core2-no-coda", "q8-g32", "q4-g64",
               "q2-g32", "q4-g128", "huginn-q4"]


@pytest.mark.parametrize("name", CACHE_CASES)
def test_cached_decode_equals_full_sequence(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE, body_dtype="f16") as model:
        full = model.score(tokens, depth=depth)
        last = model.score_last_token(tokens, depth=depth)
        with model.context() as ctx:
            rows = [ctx.append(tokens[:5], depth=depth)]
            rows += [ctx.append([int(t)], depth=depth) for t in tokens[5:]]
    for i, row in enumerate(rows[:-1]):
        pos = 4 + i
        cached = log_softmax(np.asarray(row, dtype=np.float64))[tokens[pos + 1]]
        assert_close([cached], [full[pos]], SAME, f"{name} cached log-prob at {pos}")
    assert_close(rows[-1], last.astype(np.float64), SAME, f"{name} cached last logits")


# |as stored - f16 body| on log-probs of these random models: rounding a weight to fp16
# moves it by at most 2^-11 of itself, every body matmul output by at most 2^-11 of
# sum |w x|. Measured worst log-prob change at max depth 5 (CPU, AVX2): 1.0e-3
# (huginn-q4), 0.8e-3 to 0.9e-3 for base / q8 / q4 / q2; the bound is 4x that. For a
# quantized body it must also be non-zero (the mode really changes the weights); bf16
# values are fp16 values already (8 mantissa bits of f16's 10), so only kernel order
# differs there.
AS_STORED_BOUND = 4e-3


@pytest.mark.parametrize("name", ["base", "q8-g32", "q4-g32", "q2-g64", "huginn-q4", "bf16"])
def test_close_to_the_as_stored_model(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as stored, \
            tinyloop.Model(files.path(name), device=DEVICE, body_dtype="f16") as half, \
            tinyloop.Model(files.path(name), device=DEVICE, body_dtype="f32") as full:
        a, b = stored.score(tokens, depth=depth), half.score(tokens, depth=depth)
        c = full.score(tokens, depth=depth)
    diff = np.abs(a.astype(np.float64) - b).max()
    assert diff <= AS_STORED_BOUND, f"{name}: as stored vs f16 body: {diff:.3g}"
    if config.get("dtype", "f32") in QUANTIZED_DTYPES + ("f32",):
        assert diff > 0, f"{name}: the f16 body changed nothing"
    # f32 holds the decoded values exactly: only the backend's activation handling differs
    assert np.abs(a.astype(np.float64) - c).max() <= tolerance(config)[0] * 2


def test_memory_report_grows_by_the_body(files):
    for name in ("q4-g32", "injection-concat", "core2-no-coda", "f16"):
        path = files.path(name)
        with read_file(path) as f:
            entries = {n: e for n, e in f.tensors.items() if is_body(n)}
            elements = sum(int(np.prod(e.shape)) for e in entries.values())
        with tinyloop.Model(path, device=DEVICE) as stored, \
                tinyloop.Model(path, device=DEVICE, body_dtype="f16") as half, \
                tinyloop.Model(path, device=DEVICE, body_dtype="f32") as full:
            r0, r1, r2 = stored.memory_report(), half.memory_report(), full.memory_report()
        stored_bytes = sum(e.size for e in entries.values())
        assert r0["body_bytes"] == stored_bytes, name
        assert r1["body_bytes"] == 2 * elements and r2["body_bytes"] == 4 * elements, name
        assert r1["weights_bytes"] - r0["weights_bytes"] == 2 * elements - stored_bytes, name
        assert r2["weights_bytes"] - r0["weights_bytes"] == 4 * elements - stored_bytes, name
        assert r1["total_bytes"] - r0["total_bytes"] == 2 * elements - stored_bytes, name


def test_errors(files, tmp_path):
    path = files.path("q4-g32")
    with pytest.raises(ValueError, match="body_dtype must be one of"):
        tinyloop.Model(path, device=DEVICE, body_dtype="q4")
    with pytest.raises(TypeError, match="body_dtype must be a str"):
        tinyloop.Model(path, device=DEVICE, body_dtype=1)
    with pytest.raises(InvalidArgumentError, match=r"has no loop body \(n_core = 0\)"):
        tinyloop.Model(files.path("plain-llama"), device=DEVICE, body_dtype="f16")
    with tinyloop.Model(files.path("plain-llama"), device=DEVICE) as model:
        assert model.info.body_dtype == "as_stored" and model.memory_report()["body_bytes"] == 0

    # a value beyond fp16's range names the tensor and the way out
    big = tmp_path / "big.tinyloop"
    make_random_model(big, **{**case_config("base"), "dtype": "f32"})
    with read_file(big) as f:
        entry = f.tensors["core.0.mlp.up.weight"]
        offset = f.data_offset + entry.offset
    data = bytearray(big.read_bytes())
    data[offset:offset + 4] = np.float32(1e6).tobytes()
    big.write_bytes(bytes(data))
    with pytest.raises(InvalidArgumentError, match=r"core\.0\.mlp\.up\.weight holds 1e\+06.*beyond fp16's range"):
        tinyloop.Model(big, device=DEVICE, body_dtype="f16")
    with tinyloop.Model(big, device=DEVICE, body_dtype="f32") as model:
        assert model.info.body_dtype == "f32"

    # the library's own check, and a caller's struct from before body_dtype
    with tinyloop.Model(path, device=DEVICE) as model:
        native, ffi, lib = model._native, model._native.ffi, model._native.lib
    load = ffi.new("tl_load_options *")
    lib.tl_load_options_default(load)
    device = ffi.new("char[]", DEVICE.encode())
    load.device = device
    load.body_dtype = 3
    handle = ffi.new("tl_model **")
    status = lib.tl_load_model(str(path).encode(), load, handle)
    assert ffi.string(lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
    assert "body_dtype 3 is not a tl_body_dtype" in native.last_error()
    load.body_dtype = 1
    load.struct_size = ffi.offsetof("tl_load_options", "body_dtype")   # past its end: not read
    native.check(lib.tl_load_model(str(path).encode(), load, handle))
    try:
        info = ffi.new("tl_model_info *")
        lib.tl_model_info_default(info)
        native.check(lib.tl_model_get_info(handle[0], info))
        assert info.body_dtype == 0
    finally:
        lib.tl_free_model(handle[0])


def test_mode_and_toml(files):
    path = files.path("q4-g32")
    assert parse_config("[modes.fp16_body]\n").load_options()["body_dtype"] == "f16"
    assert parse_config('[modes.fp16_body]\ndtype = "f32"\n').load_options()["body_dtype"] == "f32"
    with pytest.raises(ConfigError, match="modes.fp16_body.dtype"):
        parse_config('[modes.fp16_body]\ndtype = "q4"\n')
    with pytest.raises(ConfigError, match="modes.fp16_body.precision"):
        parse_config('[modes.fp16_body]\nprecision = "f16"\n')
    # it changes weights, not the schedule: it combines with the other modes
    both = parse_config("[modes.fp16_body]\n[modes.kv_share]\n").load_options()
    assert both["body_dtype"] == "f16" and both["kv_policy"] == "share_last"
    text = f'[model]\npath = "{path}"\ndevice = "{DEVICE}"\n[modes.fp16_body]\n'
    with tinyloop.Model.from_config(parse_config(text)) as model:
        assert model.info.body_dtype == "f16"
        with tinyloop.Model(path, device=DEVICE, body_dtype="f16") as direct:
            tokens = case_tokens(case_config("q4-g32"))
            assert np.array_equal(model.score(tokens), direct.score(tokens))


def test_info_shows_the_body(files, tmp_path, capsys):
    from tinyloop import cli
    config = tmp_path / "tinyloop.toml"
    config.write_text(f'[model]\npath = "{files.path("q4-g32")}"\ndevice = "{DEVICE}"\n[modes.fp16_body]\n')
    cli.main(["info", "--config", str(config)])
    out = capsys.readouterr().out
    assert "loop body:    f16 (0.1 MiB)" in out, out


# The shipped default model (q4, group 64) on real text at its default depth: the f16
# body's perplexity is the as-stored one within 0.1 % (measured 38.544 vs 38.546 at
# depth 5 over 320 tokens, a relative change of 5e-5).
DEFAULT_MODEL_PPL_RTOL = 1e-3


def test_default_model_perplexity_unchanged():
    from pathlib import Path
    from tinyloop.default_model import default_model_path
    path = default_model_path()
    text = (Path(__file__).resolve().parents[1] / "data" / "gettysburg.txt").read_text()
    ppl = {}
    for body in ("as_stored", "f16"):
        with tinyloop.Model(path, device=DEVICE, body_dtype=body) as model:
            tokens = np.asarray(model.tokenizer.encode(text), dtype=np.int32)
            ppl[body] = float(np.exp(-model.score(tokens).astype(np.float64).mean()))
    assert abs(ppl["f16"] - ppl["as_stored"]) <= DEFAULT_MODEL_PPL_RTOL * ppl["as_stored"], ppl
    assert ppl["f16"] != ppl["as_stored"], ppl
