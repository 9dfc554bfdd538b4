"""The cffi binding and the Model API on a tiny random model with a byte-level tokenizer."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from tinyloop import _args, _native
from tinyloop.errors import (ContextFullError, FileFormatError, InvalidArgumentError,
                             ModelIOError, TinyLoopError, UnsupportedError, error_for_status)

import textmodel


@pytest.fixture(scope="module")
def model(text_model):
    """The text model of model_path (conftest.py), opened once for the module."""
    return text_model


PROMPT = [textmodel.BOS] + list(b"The loop runs")
GREEDY = dict(temperature=0.0, max_tokens=12, eos=False)


# -- the binding itself -------------------------------------------------------------------
def test_cdef_comes_from_the_header():
    native = _native.get()
    text = native.header_path.read_text()
    cdef = _native.extract_cdef(text)
    assert "TL_API" not in cdef and "tl_stream_next" in cdef
    assert native.lib.tl_abi_version() == native.lib.TL_ABI_VERSION
    with pytest.raises(tinyloop.LibraryNotFoundError, match="TL_CDEF_BEGIN"):
        _native.extract_cdef("int tl_abi_version(void);")
    assert tinyloop.library_version()


@pytest.mark.parametrize("status, cls", [
    (1, InvalidArgumentError), (2, ModelIOError), (3, FileFormatError),
    (4, tinyloop.OutOfMemoryError), (5, UnsupportedError), (6, ContextFullError),
    (7, tinyloop.BackendError), (8, tinyloop.AbortedError), (9, tinyloop.NotImplementedYetError),
    (10, tinyloop.InternalError), (99, TinyLoopError)])
def test_status_mapping(status, cls):
    err = error_for_status(status, "what went wrong")
    assert type(err) is cls and err.status == status and str(err) == "what went wrong"


def test_error_messages_come_from_c(tmp_path, model_path):
    with pytest.raises(ModelIOError, match="nonexistent.tinyloop") as info:
        tinyloop.Model(tmp_path / "nonexistent.tinyloop")
    assert info.value.status == 2
    corrupt = tmp_path / "corrupt.tinyloop"
    corrupt.write_bytes(b"NOTALOOP" + bytes(400))
    with pytest.raises(FileFormatError, match="magic"):
        tinyloop.Model(corrupt)
    truncated = tmp_path / "truncated.tinyloop"
    truncated.write_bytes(model_path.read_bytes()[:1000])
    with pytest.raises(FileFormatError):
        tinyloop.Model(truncated)
    with pytest.raises(InvalidArgumentError, match="bogus"):
        tinyloop.Model(model_path, device="bogus")


def test_cuda_request_without_cuda_is_clear(model_path):
    try:
        with tinyloop.Model(model_path, device="cuda") as m:
            assert m.info.device_index >= 0  # a machine with a usable GPU
    except UnsupportedError as e:
        assert "cuda" in str(e).lower()


# -- argument checks ----------------------------------------------------------------------
def test_int32_arrays_pass_without_copy():
    ids = np.array([1, 2, 3], dtype=np.int32)
    assert _args.token_array(ids, 10) is ids
    converted = _args.token_array(np.array([1, 2, 3], dtype=np.uint8), 10)
    assert converted.dtype == np.int32 and converted.tolist() == [1, 2, 3]
    strided = np.arange(6, dtype=np.int32)[::2]
    assert _args.token_array(strided, 10).flags.c_contiguous


@pytest.mark.parametrize("tokens, error, words", [
    (np.array([1.0, 2.0]), TypeError, "dtype float64"),
    (np.array([1, 2], dtype=np.float32), TypeError, "dtype float32"),
    (np.array([True, False]), TypeError, "dtype bool"),
    ([1, 2.5], TypeError, "type float"),
    ("hello", TypeError, "encode text"),
    (np.zeros((2, 2), dtype=np.int32), ValueError, "1-D"),
    ([1, -3], ValueError, "token id -3 is negative"),
    ([1, 258], ValueError, "token id 258 is out of range for vocab size 258"),
    ([5], ValueError, "at least 2"),
])
def test_bad_tokens_for_score(model, tokens, error, words):
    with pytest.raises(error, match=words):
        model.score(tokens)


@pytest.mark.parametrize("options, error, words", [
    (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
    (dict(top_p=0.0), ValueError, "top_p must be > 0"),
    (dict(min_p=1.5), ValueError, "min_p must be <= 1"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(depth=textmodel.MAX_DEPTH + 1), ValueError, "exceeds the model's max_depth"),
    (dict(depth=True), TypeError, "depth must be an int, got bool"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(stop="x"), TypeError, "stop must be a list"),
    (dict(eos=999), ValueError, "eos must be <="),
])
def test_bad_generate_options(model, options, error, words):
    with pytest.raises(error, match=words):
        model.generate(PROMPT, **options)


def test_unknown_generate_option(model):
    with pytest.raises(TypeError, match="temprature"):
        model.generate(PROMPT, temprature=0.5)


# -- results --------------------------------------------------------------------------------
def test_info(model):
    info = model.info
    assert (info.vocab_size, info.d_model, info.max_depth) == (textmodel.VOCAB, 32,
                                                                textmodel.MAX_DEPTH)
    assert info.bos_token == textmodel.BOS and info.eos_token == textmodel.EOS
    assert info.n_threads == 1 and info.device_name.startswith("cpu")
    assert info.metadata["tokenizer.add_bos"] == 1
    assert "tokenizer.json" not in info.metadata
    assert info.as_dict()["name"] == info.name


def test_score_and_logits(model):
    logprobs = model.score(PROMPT)
    assert logprobs.dtype == np.float32 and logprobs.shape == (len(PROMPT) - 1,)
    assert np.all(logprobs < 0)
    logits = model.score_last_token(PROMPT[:-1])
    assert logits.shape == (textmodel.VOCAB,)
    log_softmax = logits - np.log(np.sum(np.exp(logits.astype(np.float64))))
    assert log_softmax[PROMPT[-1]] == pytest.approx(logprobs[-1], abs=1e-3)


def test_depth_changes_the_function(model):
    assert not np.allclose(model.score(PROMPT, depth=1), model.score(PROMPT, depth=4))


def test_perplexity_windows(model):
    ids = [textmodel.BOS] + list(b"windowed scoring of a longer text, twice over. " * 2)
    whole = model.score_windows(ids[:60])
    assert np.array_equal(whole, model.score(ids[:60]))
    windows = model.score_windows(ids, ctx=16)
    assert windows.shape == (len(ids) - 1,)
    # the first window is the same computation as scoring its 16 tokens alone
    assert np.allclose(windows[:15], model.score(ids[:16]))
    assert model.perplexity(ids, ctx=16) == pytest.approx(float(np.exp(-windows.mean())),
                                                          rel=1e-5)
    with pytest.raises(ValueError, match="ctx must be 0"):
        model.score_windows(ids, ctx=1)


def test_generate_text_and_tokens(model):
    result = model.generate("Hello", **GREEDY)
    assert isinstance(result, tinyloop.GenerateResult)
    assert len(result.tokens) == 12 and result.stop_reason == "max_tokens"
    assert result.prompt_tokens == 6  # BOS + 5 bytes (tokenizer.add_bos = 1)
    assert result.text == model.tokenizer.decode(result.tokens)
    assert model.generate(model.tokenizer.encode("Hello"), **GREEDY).tokens == result.tokens
    assert model.generate(PROMPT, **GREEDY).text is None
    assert result.prefill_seconds > 0 and result.decode_tokens_per_s > 0


def test_sampling_is_seeded(model):
    a = model.generate(PROMPT, max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       seed=3, eos=False)
    b = model.generate(PROMPT, max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       seed=3, eos=False)
    assert a.tokens == b.tokens


def test_stop_sequences(model):
    tokens = model.generate(PROMPT, **GREEDY).tokens
    stop = tokens[1:3]
    # generation ends where the stop sequence first appears as a suffix (kept in the output)
    end = next(j for j in range(2, len(tokens) + 1) if tokens[j - 2:j] == stop)
    stopped = model.generate(PROMPT, stop=[[textmodel.EOS, 1], stop], **GREEDY)
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.tokens == tokens[:end]
    text = model.tokenizer.decode(tokens[1:3])
    if model.tokenizer.encode(text, add_bos=False) == tokens[1:3]:
        assert model.generate(PROMPT, stop=[text], **GREEDY).stop_reason == "stop_sequence"


def test_eos(model):
    tokens = model.generate(PROMPT, **GREEDY).tokens
    result = model.generate(PROMPT, **dict(GREEDY, eos=tokens[4]))
    assert result.stop_reason == "eos" and result.tokens == tokens[:tokens.index(tokens[4])]


def test_too_long_prompts(model):
    too_long = [textmodel.BOS] + [65] * textmodel.MAX_SEQ_LEN
    with pytest.raises(ContextFullError, match="max_seq_len"):
        model.score(too_long)
    with pytest.raises(ContextFullError):
        model.generate(too_long, max_tokens=2)
    near_end = [textmodel.BOS] + [65] * (textmodel.MAX_SEQ_LEN - 5)
    result = model.generate(near_end, **dict(GREEDY, max_tokens=50))
    assert result.stop_reason == "context_full" and len(result.tokens) <= 5


# -- streaming --------------------------------------------------------------------------------
def test_stream_equals_generate(model):
    expected = model.generate(PROMPT, **GREEDY)
    stream = model.stream(PROMPT, **GREEDY)
    assert list(stream) == expected.tokens
    assert stream.result.stop_reason == "max_tokens"
    assert stream.result.tokens == expected.tokens
    assert list(stream) == []  # an ended stream stays ended


def test_stream_can_stop_early(model):
    with model.stream(PROMPT, **GREEDY) as stream:
        first = [next(stream) for _ in range(3)]
    assert first == model.generate(PROMPT, **GREEDY).tokens[:3]
    assert stream.result is None
    with pytest.raises(StopIteration):
        next(stream)


def test_stream_text(model):
    expected = model.generate("Hi", **GREEDY)
    pieces = list(model.stream_text("Hi", **GREEDY))
    assert "".join(pieces) == expected.text


def test_incremental_decoder_holds_split_characters(model):
    text = "héllo wörld 😀 ok"
    ids = model.tokenizer.encode(text, add_bos=False)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    decoder = model.tokenizer.incremental_decoder()
    pieces = [decoder.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == text
    # the four bytes of the emoji produce text only when the last one arrives
    start = len("héllo wörld ".encode("utf-8"))
    assert pieces[start:start + 3] == ["", "", ""] and pieces[start + 3] == "😀"


def test_incremental_decoder_releases_invalid_bytes(model):
    decoder = model.tokenizer.incremental_decoder()
    pieces = [decoder.push(0x80) for _ in range(8)]  # continuation bytes never complete
    assert "".join(pieces) + decoder.flush() == "\ufffd" * 8
    assert "".join(pieces)  # released before the end of the stream


# -- contexts, threads, lifetime ------------------------------------------------------------
def test_context_primitives(model):
    with model.context() as ctx:
        logits = ctx.append(PROMPT[:5])
        assert len(ctx) == 5
        ctx.append(PROMPT[5:])
        assert len(ctx) == len(PROMPT)
        assert np.allclose(ctx.append([65]), model.score_last_token(PROMPT + [65]), atol=1e-4)
        ctx.truncate(5)
        assert len(ctx) == 5
        ctx.reset()
        assert len(ctx) == 0
        assert np.allclose(ctx.append(PROMPT[:5]), logits, atol=1e-5)
        ctx.reset()
        assert ctx.generate(PROMPT, **GREEDY).tokens == model.generate(PROMPT, **GREEDY).tokens
        ctx.reset()
        assert list(ctx.stream(PROMPT, **GREEDY)) == model.generate(PROMPT, **GREEDY).tokens
        with pytest.raises(ContextFullError):
            ctx.append([65] * textmodel.MAX_SEQ_LEN)


def test_context_is_refused_while_a_stream_over_it_is_open(model):
    """A stream may run a step ahead in its context (chained decoding), so the context
    accepts nothing else until the stream ends; then it holds the prompt and every
    generated token but the last, as after generate()."""
    with model.context() as ctx:
        stream = ctx.stream(PROMPT, **GREEDY)
        first = [next(stream), next(stream), next(stream)]
        for use in (lambda: ctx.append([65]), lambda: ctx.truncate(1), ctx.reset,
                    lambda: ctx.score(PROMPT), lambda: ctx.score_last_token(PROMPT),
                    lambda: ctx.generate(PROMPT, **GREEDY), lambda: list(ctx.stream(PROMPT, **GREEDY))):
            with pytest.raises(InvalidArgumentError, match="generation stream that is still open"):
                use()
        stream.close()
        assert len(ctx) == len(PROMPT) + len(first) - 1
        assert first == model.generate(PROMPT, **GREEDY).tokens[:3]
        assert np.allclose(ctx.append([first[-1]]), model.score_last_token(PROMPT + first), atol=1e-4)


def test_freeing_a_context_ends_its_open_stream(model):
    ctx = model.context()
    stream = ctx.stream(PROMPT, **GREEDY)
    next(stream)
    ctx.close()
    assert list(stream) == []
    assert stream.result.stop_reason == "aborted"
    stream.close()


def test_memory_report(model):
    before = model.memory_report()
    assert set(before) == {"weights_bytes", "repacked_bytes", "buffers_bytes", "kv_cache_bytes",
                           "total_bytes", "device_bytes", "prefix_cache_bytes", "kv_page_size",
                           "kv_pages_in_use", "kv_pool_bytes", "kv_pool_cap_bytes", "body_bytes"}
    assert before["kv_page_size"] == before["kv_pages_in_use"] == before["kv_pool_bytes"] == 0   # contiguous
    assert before["weights_bytes"] > 0 and before["device_bytes"] == 0
    parts = ("weights_bytes", "repacked_bytes", "buffers_bytes", "kv_cache_bytes", "prefix_cache_bytes")
    assert before["total_bytes"] == sum(before[k] for k in parts)
    assert 0 < before["body_bytes"] < before["weights_bytes"]   # part of the weights
    with model.context():
        during = model.memory_report()
        assert during["kv_cache_bytes"] > before["kv_cache_bytes"]
    assert model.memory_report()["kv_cache_bytes"] == before["kv_cache_bytes"]
    assert model.vram_usage_bytes() >= 0


def test_threads_with_separate_contexts(model):
    prompts = [[textmodel.BOS] + list(f"thread {i} says".encode()) for i in range(4)]
    expected = [model.generate(p, **GREEDY).tokens for p in prompts]
    expected_scores = [model.score(p) for p in prompts]
    results, errors = {}, []

    def work(i):
        try:
            with model.context() as ctx:
                for _ in range(3):
                    ctx.reset()
                    results[i] = ctx.generate(prompts[i], **GREEDY).tokens
                ctx.reset()
                results[i, "score"] = ctx.score(prompts[i])
        except Exception as e:  # reported below: pytest does not see thread exceptions
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        assert results[i] == expected[i]
        assert np.allclose(results[i, "score"], expected_scores[i], atol=1e-5)


def test_model_level_calls_from_threads(model):
    expected = model.score(PROMPT)
    outputs = [None] * 4

    def work(i):
        outputs[i] = model.score(PROMPT)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(o, expected) for o in outputs)


def test_closed_model(model_path):
    m = tinyloop.Model(model_path, threads=1)
    ctx = m.context()
    stream = m.stream(PROMPT, **GREEDY)
    m.close()
    m.close()  # idempotent
    assert m.closed and ctx.closed
    with pytest.raises(TinyLoopError, match="closed"):
        m.score(PROMPT)
    with pytest.raises(TinyLoopError, match="closed"):
        ctx.append(PROMPT)
    with pytest.raises(TinyLoopError, match="closed"):
        m.memory_report()
    assert list(stream) == []  # its stream was freed with the model
    assert "closed" in repr(m)


def test_context_manager_closes(model_path):
    with tinyloop.Model(model_path, threads=1) as m:
        with m.context() as ctx:
            ctx.append(PROMPT)
        assert ctx.closed and not m.closed
    assert m.closed


def test_model_from_config(tmp_path, model_path):
    config = tmp_path / "tinyloop.toml"
    config.write_text(f'[model]\npath = "{model_path}"\nthreads = 1\ndepth = 3\n'
                      "max_seq_len = 64\n")
    with tinyloop.Model.from_config(config) as m:
        assert m.info.max_seq_len == 64 and m.info.n_threads == 1
        # depth 0 now means the configured default, 3
        assert np.array_equal(m.score(PROMPT), m.score(PROMPT, depth=3))


def test_model_without_tokenizer(tmp_path):
    from tinyloop.fileformat.random_model import make_random_model
    path = tmp_path / "plain.tinyloop"
    make_random_model(path, seed=1, **textmodel.DIMS)
    with tinyloop.Model(path, threads=1) as m:
        with pytest.raises(TinyLoopError, match="no tokenizer"):
            m.generate("text")
        assert len(m.generate(PROMPT, max_tokens=3).tokens) <= 3


# -- metadata, log messages, environment switches, the backend handshake --------------------
ROOT = Path(__file__).resolve().parents[2]


def _typed(metadata: dict) -> dict:
    """key -> (type, value): 1 and 1.0 must not pass for each other."""
    return {k: (type(v), v) for k, v in metadata.items()}


def _shipped_models():
    return sorted((Path(tinyloop.__file__).resolve().parent / "models").glob("*.tinyloop"))


def test_metadata_enumeration_matches_the_python_reader(tmp_path, model_path):
    from tinyloop.fileformat.tinyloop_file import copy_file, read_file
    from tinyloop.fileformat.random_model import make_random_model
    plain = tmp_path / "plain.tinyloop"
    make_random_model(plain, seed=4, rope_theta=123456.5, norm_eps=1e-6, qkv_bias=True,
                      sliding_window=8, injection="concat", **textmodel.DIMS)
    extra = tmp_path / "extra.tinyloop"
    copy_file(plain, extra, metadata={"zz.unknown": -(2**63), "aa.tiny": 5e-324, "m.empty": "",
                                      "m.unicode": "é loop ∞ \U0001F600", "m.big": 2**63 - 1})
    assert _shipped_models(), "the package ships a default model"
    for path in [model_path, plain, extra, *_shipped_models()]:
        with read_file(path) as f:
            expected = dict(f.metadata)
        with tinyloop.Model(path, threads=1) as m:
            got = m.metadata()
            info = m.info.metadata
        assert _typed(got) == _typed(expected), path
        assert list(got) == sorted(expected), "key order"
        assert info == {k: v for k, v in expected.items() if k != "tokenizer.json"}


def test_metadata_calls_check_their_arguments(model):
    native, ffi, lib = model._native, model._native.ffi, model._native.lib
    handle = model._require_open()
    count = ffi.new("size_t *")
    native.check(lib.tl_model_metadata_count(handle, count))
    key = ffi.new("const char **")
    assert lib.tl_model_metadata_key(handle, count[0], key, ffi.NULL) == 1
    assert "out of range" in native.last_error()
    value = ffi.new("int64_t *")
    assert lib.tl_model_get_metadata_int(handle, b"general.name", value) == 1
    assert "is a string, not an int" in native.last_error()
    assert model.metadata_string("no.such.key") is None


def _child(script, env_extra):
    env = dict(os.environ)
    env.pop("TINYLOOP_CPU", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)


# a model load whose log messages are collected by a logging handler and printed as JSON
_COLLECT_LOG = """
import json, logging, sys
import tinyloop
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])
logging.getLogger("tinyloop").addHandler(Keep())
logging.getLogger("tinyloop").setLevel(logging.DEBUG)
try:
    with tinyloop.Model(sys.argv[1] if len(sys.argv) > 1 else MODEL, threads=1, device=DEVICE) as m:
        result = m.info.device_name
except tinyloop.TinyLoopError as e:
    result = f"{type(e).__name__}: {e}"
print(json.dumps({"records": records, "result": result}))
"""


def _collect_log(model_path, env_extra, device="cpu"):
    script = f"MODEL = {str(model_path)!r}\nDEVICE = {device!r}\n" + _COLLECT_LOG
    done = _child(script, env_extra)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_bad_cpu_value_logs_a_warning_not_stderr(model_path):
    """The library prints nothing: a TINYLOOP_CPU value it ignores arrives as a WARNING of
    the "tinyloop" logger, and without any logging configuration logging's last resort
    still shows it on stderr (once)."""
    out, stderr = _collect_log(model_path, {"TINYLOOP_CPU": "bogus"})
    message = "TINYLOOP_CPU=bogus is not one of generic, avx2, avx512vnni: ignored"
    assert ["tinyloop", "WARNING", message] in out["records"], out
    assert stderr == "", stderr
    assert out["result"].startswith("cpu ("), out
    script = f"import tinyloop\ntinyloop.Model({str(model_path)!r}, threads=1).close()\n"
    done = _child(script, {"TINYLOOP_CPU": "bogus"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == message, done.stderr


def test_environment_switches_are_read_in_one_place():
    """debug_flags.c reads every environment variable of the library (no other file of
    libtinyloop calls getenv), and docs/api.md's table lists exactly its switches."""
    sources = [p for p in (ROOT / "libtinyloop").rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh")]
    readers = sorted(p.name for p in sources if re.search(r"\bgetenv\s*\(", p.read_text()))
    assert readers == ["debug_flags.c"], readers
    table = next(p for p in sources if p.name == "debug_flags.c").read_text()
    in_code = set(re.findall(r'\{"(TINYLOOP_\w+)"', table))
    docs = (ROOT / "docs" / "api.md").read_text()
    section = docs[docs.index("## Environment switches"):]
    section = section[:section.index("\n#", 1)]
    in_docs = set(re.findall(r"^\| `(TINYLOOP_\w+)`", section, flags=re.M))
    assert in_code == in_docs and len(in_code) == 7, (in_code, in_docs)   # TL_FLAG_COUNT


_OLD_CUDA_LIBRARY = """
int tl_cuda_backend_create(int device, void **out, char *msg, unsigned long n) { *out = 0; return 1; }
const char *tl_cuda_last_error(void) { return ""; }
"""
_OTHER_BUILD_CUDA_LIBRARY = """
static const unsigned ops[2] = { 999, 8 };   /* version, struct_size: no real table */
const void *tl_cuda_backend_ops(void) { return ops; }
int tl_cuda_backend_open(const void *host, int device, void **out, char *msg, unsigned long n) { return 1; }
const char *tl_cuda_last_error(void) { return ""; }
"""


@pytest.mark.parametrize("source, message", [
    (_OLD_CUDA_LIBRARY, "was built by an older TinyLoop"),
    (_OTHER_BUILD_CUDA_LIBRARY, "has backend interface version 999")])
def test_cuda_library_of_another_build_is_refused(tmp_path, model_path, source, message):
    """A libtinyloop_cuda.so next to libtinyloop.so that is not of its build (an old one,
    or one of another interface version) is refused before any of its code runs: "cuda"
    fails saying so, "auto" runs on the CPU and says so in a warning."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in CUDA library")
    native = _native.get()
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    shutil.copy(native.library_path, lib_dir / "libtinyloop.so")
    (tmp_path / "fake.c").write_text(source)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib_dir / "libtinyloop_cuda.so"),
                    str(tmp_path / "fake.c")], check=True, capture_output=True)
    env = {"TINYLOOP_LIBRARY": str(lib_dir / "libtinyloop.so"),
           "TINYLOOP_HEADER": str(native.header_path)}
    out, stderr = _collect_log(model_path, env, device="cuda")
    assert out["result"].startswith("UnsupportedError") and message in out["result"], out
    assert "rebuild" in out["result"], out
    out, stderr = _collect_log(model_path, env, device="auto")
    assert out["result"].startswith("cpu ("), out
    warnings = [r for r in out["records"] if r[1] == "WARNING"]
    assert len(warnings) == 1 and message in warnings[0][2] and "running on the CPU" in warnings[0][2], out
    assert stderr == "", stderr
