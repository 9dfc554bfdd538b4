"""The cache window (docs/api.md, "Cache window"; tl_load_options.cache_window): the K/V of
the last W positions per virtual layer in a ring.

On a model whose sliding window is at most W it is exact: cached decoding equals scoring
the whole sequence with the windowed mask (bit for bit on the CPU), contiguous and paged.
Sequences go on past max_seq_len, held to the float64 oracle's ring
(`ReferenceModel.logits(..., cache_window=W, calls=[...])`). On other models it is the named
approximate window, refused unless asked for and reported when it is. Also: the KV bytes
no longer grow with max_seq_len, forks, truncation, batched and speculative decoding, and
the clear errors for bad values and the refused combinations."""

import numpy as np
import pytest

import tinyloop
from test_parity import DEVICE, ON_CPU, SAME, TOLERANCES, arithmetic, case_config, case_tokens
from reference.ops import next_token_logprobs
from tinyloop.errors import InvalidArgumentError, UnsupportedError
from c_options import create_context

CHUNK, PREFILL = 3, 7          # a prefill of 7 tokens in chunks of 3, then one token a step
SLIDING = 4                    # the "sliding_window" case's arch.sliding_window
LONG = 100                     # past the parity models' max_seq_len of 48
PAGES = [0, 4]                 # contiguous, and pages of 4 positions


def tolerance(name):
    return TOLERANCES[arithmetic(case_config(name))] if ON_CPU else SAME


def assert_close(actual, expected, tol, what):
    atol, rtol = tol
    err = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    assert np.all(err <= atol + rtol * np.abs(expected)), f"{what}: max |error| {err.max():.3g}"


def long_tokens(n=LONG, seed=3):
    return np.random.default_rng(seed).integers(0, case_config("base")["vocab_size"], n).astype(np.int32)


def decode_logits(model, tokens, depth, **context_options):
    """Logits after each position from PREFILL on: one append of PREFILL tokens (chunks of
    CHUNK), then one token per append."""
    with model.context(**context_options) as ctx:
        rows = [ctx.append(tokens[:PREFILL], depth=depth)]
        rows += [ctx.append(tokens[i:i + 1]) for i in range(PREFILL, len(tokens))]
    return np.array(rows)


def decode_calls(n):
    return [CHUNK, CHUNK, PREFILL - 2 * CHUNK] + [1] * (n - PREFILL)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("window", [SLIDING, 6])
def test_exact_window_decode_equals_full_scoring(files, window, page):
    """Within max_seq_len: the same logits as the full cache with the model's mask, and
    as the oracle scoring the whole sequence at once."""
    name = "sliding_window"
    config = case_config(name)
    tokens, depth = case_tokens(config), config["default_depth"]
    path = files.path(name)
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_page_size=page) as full, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_page_size=page,
                           cache_window=window) as ring:
        assert ring.info.cache_window == window and ring.info.cache_window_approx == 0
        windowed = decode_logits(ring, tokens, depth)
        expected = decode_logits(full, tokens, depth)
        if ON_CPU:
            assert np.array_equal(windowed, expected)
            assert np.array_equal(ring.score(tokens, depth=depth), full.score(tokens, depth=depth))
        else:
            assert_close(windowed, expected, SAME, "window vs full cache")
    scored = files.reference(name).logits(tokens, depth)
    assert_close(windowed, scored[PREFILL - 1:], tolerance(name), "window vs the oracle's one call")


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("name, options", [("sliding_window", dict(cache_window=6)),
                                           ("base", dict(cache_window=6, cache_window_approx=True)),
                                           ("huginn-q4", dict(cache_window=5, cache_window_approx=True))])
def test_decode_past_max_seq_len_matches_the_oracles_ring(files, name, options, page):
    config = case_config(name)
    tokens, depth = long_tokens(), config["default_depth"]
    assert len(tokens) > config["max_seq_len"]
    with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=CHUNK, kv_page_size=page,
                        **options) as model:
        decoded = decode_logits(model, tokens, depth)
        scored = model.score(tokens, depth=depth)
    reference = files.reference(name)
    window = options["cache_window"]
    stepped = reference.logits(tokens, depth, cache_window=window, calls=decode_calls(len(tokens)))
    assert_close(decoded, stepped[PREFILL - 1:], tolerance(name), f"{name}: prefill then decode")
    calls = [CHUNK] * (len(tokens) // CHUNK) + [len(tokens) % CHUNK]
    chunked = reference.logits(tokens, depth, cache_window=window, calls=[c for c in calls if c])
    assert_close(scored, next_token_logprobs(chunked, tokens), tolerance(name), f"{name}: score")


def test_the_oracles_ring_is_the_windowed_mask(files):
    """Guards the tests above: the oracle's ring equals its plain windowed attention in the
    exact case and for any calls; the approximate window differs from full attention."""
    reference = files.reference("sliding_window")
    tokens, depth = case_tokens(case_config("sliding_window")), 3
    plain = reference.logits(tokens, depth)
    for calls in (None, decode_calls(len(tokens)), [5, 7]):
        ringed = reference.logits(tokens, depth, cache_window=SLIDING, calls=calls)
        np.testing.assert_allclose(ringed, plain, rtol=0, atol=1e-12)
    base = files.reference("base")
    assert np.abs(base.logits(tokens, depth, cache_window=4) - base.logits(tokens, depth)).max() > 1e-2


def test_generation_goes_on_past_max_seq_len(files):
    path = files.path("sliding_window")
    prompt = [5, 17, 3, 88, 41, 9]
    with tinyloop.Model(path, device=DEVICE) as full, \
            tinyloop.Model(path, device=DEVICE, cache_window=SLIDING) as ring:
        bounded = full.generate(prompt, max_tokens=LONG, temperature=0, eos=False)
        assert bounded.stop_reason == "context_full"
        endless = ring.generate(prompt, max_tokens=LONG, temperature=0, eos=False)
        assert endless.stop_reason == "max_tokens" and len(endless.tokens) == LONG
        # the same tokens as long as the full cache could go
        assert endless.tokens[:len(bounded.tokens)] == bounded.tokens
        spec = ring.generate(prompt, max_tokens=LONG, temperature=0, eos=False, draft_depth=1, n_draft=3)
        assert spec.tokens == endless.tokens and spec.drafted_tokens > 0


def kv_bytes_of_a_context(model, **options):
    before = model.memory_report()["kv_cache_bytes"]
    with model.context(**options) as ctx:
        ctx.append([1, 2, 3])
        return model.memory_report()["kv_cache_bytes"] - before


def test_kv_memory_is_the_rings_not_max_seq_lens(files):
    config = case_config("base")
    slots = config["n_pre"] + config["max_depth"] * config["n_core"] + config["n_post"]
    row = 2 * config["n_kv_head"] * config["head_dim"] * 4   # keys and values, f32
    path = files.path("base")
    window = 8
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_dtype="f32") as full, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_dtype="f32", cache_window=window,
                           cache_window_approx=True) as ring:
        assert kv_bytes_of_a_context(full) == slots * config["max_seq_len"] * row
        assert kv_bytes_of_a_context(ring) == slots * (window + CHUNK - 1) * row
        # a context's own window, and -1 for none, on either model
        assert kv_bytes_of_a_context(full, cache_window=window, cache_window_approx=True) == \
            slots * (window + CHUNK - 1) * row
        assert kv_bytes_of_a_context(ring, cache_window=0) == slots * config["max_seq_len"] * row


@pytest.mark.parametrize("page", PAGES)
def test_fork_truncate_and_batched_steps(files, page):
    tokens = long_tokens(60)
    window = 6
    with tinyloop.Model(files.path("sliding_window"), device=DEVICE, prefill_chunk=CHUNK, kv_page_size=page,
                        cache_window=window) as model:
        with model.context() as a, model.context() as b:
            a.append(tokens[:55], depth=3)
            with a.fork() as c:
                assert np.array_equal(a.append(tokens[55:57]), c.append(tokens[55:57]))
            a.truncate(len(a) - 2)   # the ring still holds what position 55 sees
            b.append(tokens[:55], depth=3)
            steps = model.append_batch([a, b], [tokens[55], tokens[55]])
            assert np.array_equal(steps[0], steps[1])
            with pytest.raises(InvalidArgumentError, match="cache_window 6"):
                a.truncate(30)   # overwritten long ago
            a.reset()
            a.append(tokens[:3], depth=3)
            with model.context(cache_window=0) as full:
                with pytest.raises(InvalidArgumentError, match="cache_window"):
                    model.append_batch([a, full], [1, 1])


def test_approximate_window_must_be_asked_for_and_is_reported(files):
    with pytest.raises(InvalidArgumentError, match="cache_window_approx"):
        tinyloop.Model(files.path("base"), device=DEVICE, cache_window=6)
    with pytest.raises(InvalidArgumentError, match=r"cache_window 3 is shorter than the model's sliding window 4"):
        tinyloop.Model(files.path("sliding_window"), device=DEVICE, cache_window=3)
    with tinyloop.Model(files.path("sliding_window"), device=DEVICE, cache_window=3,
                        cache_window_approx=True) as model:
        assert model.info.cache_window_approx == 1
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with pytest.raises(InvalidArgumentError, match="cache_window_approx"):
            model.context(cache_window=6)
        with model.context(cache_window=6, cache_window_approx=True) as ctx:
            ctx.append([1, 2, 3])


def test_bad_values_name_the_option(files):
    path = files.path("sliding_window")
    with pytest.raises(ValueError, match="cache_window"):
        tinyloop.Model(path, device=DEVICE, cache_window=-1)
    with pytest.raises(InvalidArgumentError, match="cache_window 49 exceeds max_seq_len 48"):
        tinyloop.Model(path, device=DEVICE, cache_window=49)
    with pytest.raises(InvalidArgumentError, match="cache_window 20 exceeds max_seq_len 16"):
        tinyloop.Model(path, device=DEVICE, cache_window=20, max_seq_len=16)
    with pytest.raises(InvalidArgumentError, match="cache_window_approx is 1 without a cache_window"):
        tinyloop.Model(path, device=DEVICE, cache_window_approx=True)
    with tinyloop.Model(path, device=DEVICE) as model:
        with pytest.raises(UnsupportedError, match="keep_loop_states with cache_window"):
            model.context(cache_window=6, keep_loop_states=True)
        with pytest.raises(InvalidArgumentError, match="tl_context_options.cache_window 60 exceeds"):
            model.context(cache_window=60)


def test_refused_combinations_name_the_window(files):
    prompt = [5, 17, 3, 88, 41, 9]
    with tinyloop.Model(files.path("sliding_window"), device=DEVICE, cache_window=SLIDING) as model:
        with pytest.raises(UnsupportedError, match="prefix caches: the context has cache_window 4"):
            model.prefix_cache(prompt)
        with pytest.raises(UnsupportedError, match="tree speculation: the context has cache_window"):
            model.generate(prompt, max_tokens=4, temperature=0, draft_depth=1, tree=(2, 1))
    with pytest.raises(UnsupportedError, match="warm state init"):
        tinyloop.Model(files.path("warm-window-q8"), device=DEVICE, cache_window=5)


def test_toml_key_and_cli_flag(files, tmp_path):
    from cli_run import last_json, run
    from tinyloop.config import parse_config
    from tinyloop.errors import ConfigError
    path = files.path("sliding_window")
    config = parse_config(f'[model]\npath = "{path}"\ncache_window = 6\n')
    assert config.load_options()["cache_window"] == 6 and "cache_window_approx" not in config.load_options()
    with tinyloop.Model.from_config(config, device=DEVICE) as model:
        assert model.info.cache_window == 6
    approx = parse_config(f'[model]\npath = "{path}"\ncache_window = 2\ncache_window_approx = true\n')
    assert approx.load_options()["cache_window_approx"] is True
    with pytest.raises(ConfigError, match="cache_window"):
        parse_config("[model]\ncache_window = -3\n")
    with pytest.raises(ConfigError, match="cache_window_approx"):
        parse_config("[model]\ncache_window_approx = 1\n")
    # tinyloop info shows the window and what a context's KV costs with and without it
    report = last_json(run("info", path, "--cache-window", 6, "--json"))
    window = report["cache_window"]
    assert window["positions"] == 6 and window["approximate"] is False
    assert 0 < window["context_kv_bytes"] < window["full_kv_bytes"]
    proc = run("info", files.path("base"), "--cache-window", 6, check=False)
    assert proc.returncode != 0 and "cache_window_approx" in proc.stderr
    assert last_json(run("info", files.path("base"), "--cache-window", 6, "--cache-window-approx",
                         "--json"))["cache_window"]["approximate"] is True


def test_the_servers_prompt_cache_with_a_window(files):
    """Kept sequences under a window: a next turn continues one; a prompt that parts from it
    long before its end (the ring no longer holds that start) runs from scratch; both
    generate what a fresh context does."""
    from tinyloop.prompt_cache import PromptCache
    tokens = long_tokens(40).tolist()
    greedy = dict(max_tokens=5, temperature=0, eos=False)
    with tinyloop.Model(files.path("sliding_window"), device=DEVICE, cache_window=SLIDING) as model:
        cache = PromptCache(model, 1)

        def run(prompt):
            lease = cache.acquire(prompt, 3)
            with lease.context.stream(lease.rest, depth=3, **greedy) as stream:
                out = list(stream)
            cache.release(lease, list(prompt) + out)
            return out, lease.cached

        first, _ = run(tokens[:30])
        turn = tokens[:30] + first + [7, 8]
        again, cached = run(turn)
        assert cached == 34 and again == model.generate(turn, depth=3, **greedy).tokens
        parted = tokens[:10] + [1, 2, 3]
        out, cached = run(parted)
        assert cached == 0 and out == model.generate(parted, depth=3, **greedy).tokens


def test_c_level_checks_and_structs_from_before_the_fields(files):
    """The library's own checks (the Python layer bypassed), and callers built before the
    window fields: their structs end before them, which then read as 0 (no window)."""
    import tinyloop._native as _native
    native = _native.get()
    ffi, lib = native.ffi, native.lib
    path = str(files.path("sliding_window")).encode()

    def load(**fields):
        opts = ffi.new("tl_load_options *")
        lib.tl_load_options_default(opts)
        for key, value in fields.items():
            setattr(opts, key, value)
        out = ffi.new("tl_model **")
        status = lib.tl_load_model(path, opts, out)
        if status == 0:
            lib.tl_free_model(out[0])
        return ffi.string(lib.tl_status_name(status)).decode(), native.last_error()

    assert load(cache_window=-2) == ("TL_ERR_INVALID_ARGUMENT",
                                     "tl_load_options.cache_window is -2: a window keeps W >= 1 positions "
                                     "(0 = off)")
    assert "tl_load_options.cache_window_approx is 2, not 0 or 1" in load(cache_window=4, cache_window_approx=2)[1]
    assert load(cache_window=4)[0] == "TL_OK"
    before = ffi.offsetof("tl_load_options", "cache_window")
    assert load(struct_size=before, cache_window=-2)[0] == "TL_OK"   # past its end: not read
    with tinyloop.Model(files.path("sliding_window"), device=DEVICE, cache_window=SLIDING) as model:
        def create(**fields):
            return create_context(model, **fields)

        assert "tl_context_options.cache_window is -2" in create(cache_window=-2)[1]
        assert "cache_window_approx is 1 with cache_window 0" in create(cache_window_approx=1)[1]
        assert create(cache_window=-1, keep_loop_states=1)[0] == "TL_OK"   # no window: deepening works
        assert create(keep_loop_states=1)[0] == "TL_ERR_UNSUPPORTED"      # the model's window
        # a struct from before the fields takes the model's window
        assert create(struct_size=ffi.offsetof("tl_context_options", "cache_window"), cache_window=-1,
                      keep_loop_states=1)[0] == "TL_ERR_UNSUPPORTED"
