"""Approximate KV policies (docs/model.md, "Approximate KV policies"; tl_kv_policy).

share_last and ring N let loop iterations share K/V slots. Their result depends on where
forward calls split the sequence, so the float64 oracle takes the calls as input
(`ReferenceModel.logits(tokens, depth, kv_ring=N, calls=[...])`) and the backend is checked
against it for every parity case with a loop (every architecture option and weight type):
a prefill over several chunks, then token-by-token decoding. Also: ring N >= the depth is
exact bit for bit, the exact default is unchanged, the KV bytes shrink by the expected
amount, each interaction is defined (batched decode, logit lens, escalation, a context's
own policy, old struct sizes) or refused with a clear error (deepening, speculative
decoding, bad values), generation through the load option and the kv_share mode."""

import numpy as np
import pytest

import tinyloop
from test_parity import CASES, DEVICE, DEVICE_TOLERANCE, INT16_ACTIVATION_TOLERANCE, ON_CPU, SAME, \
    TOLERANCES, arithmetic, case_config, case_tokens
from reference.ops import next_token_logprobs
from tinyloop.config import parse_config
from tinyloop.errors import ConfigError, InvalidArgumentError, UnsupportedError
from c_options import create_context

LOOP_CASES = [name for name in CASES if case_config(name)["n_core"] > 0]
# (Model keyword arguments, the oracle's kv_ring)
POLICIES = {"share_last": (dict(kv_policy="share_last"), 1),
            "ring2": (dict(kv_policy="ring", kv_ring_slots=2), 2),
            "ring3": (dict(kv_policy="ring", kv_ring_slots=3), 3)}
CHUNK, PREFILL = 3, 7   # a prefill of 7 tokens in chunks of 3: calls of 3, 3 and 1


def oracle_checks(files, name):
    """(oracle, tolerance, label) pairs a case's backend results are held to (as test_parity)."""
    config = case_config(name)
    if not ON_CPU:
        return [(files.reference(name), DEVICE_TOLERANCE, "oracle")]
    checks = [(files.reference(name), TOLERANCES[arithmetic(config)], "oracle")]
    if arithmetic(config) == "quantized":
        checks.append((files.reference(name, int16_activations=True), INT16_ACTIVATION_TOLERANCE,
                       "int16-activation oracle"))
    return checks


def assert_close(actual, expected, tolerance, what):
    atol, rtol = tolerance
    err = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    assert np.all(err <= atol + rtol * np.abs(expected)), f"{what}: max |error| {err.max():.3g}"


def decode_logits(model, tokens, depth, **context_options):
    """Logits after each position from PREFILL on: one append of the first PREFILL tokens
    (in the model's prefill chunks), then one token per append."""
    with model.context(**context_options) as ctx:
        rows = [ctx.append(tokens[:PREFILL], depth=depth)]
        rows += [ctx.append(tokens[i:i + 1]) for i in range(PREFILL, len(tokens))]
    return np.array(rows)


def decode_calls(n):
    return [CHUNK, CHUNK, PREFILL - 2 * CHUNK] + [1] * (n - PREFILL)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", LOOP_CASES)
def test_policy_matches_the_oracle_over_chunks_then_decoding(files, name, policy):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"]
    options, ring = POLICIES[policy]
    with tinyloop.Model(files.path(name), device=DEVICE, prefill_chunk=CHUNK, **options) as model:
        logprobs = model.score(tokens, depth=depth)   # the internal context: calls of 3
        decoded = decode_logits(model, tokens, depth)
    for reference, tolerance, which in oracle_checks(files, name):
        label = f"{name} {policy} depth {depth} vs {which}"
        scored = reference.logits(tokens, depth, kv_ring=ring, calls=[CHUNK] * (len(tokens) // CHUNK))
        assert_close(logprobs, next_token_logprobs(scored, tokens), tolerance, f"{label}: chunked score")
        stepped = reference.logits(tokens, depth, kv_ring=ring, calls=decode_calls(len(tokens)))
        assert_close(decoded, stepped[PREFILL - 1:], tolerance, f"{label}: prefill then decode")


def test_the_policies_are_approximate_and_depend_on_the_calls(files):
    """Guards the test above against checking nothing: on the base case the oracle's
    policies differ from exact far beyond the tolerance, and depend on the call boundaries;
    one call of the whole sequence is exact under every policy."""
    config = case_config("base")
    tokens, depth = case_tokens(config), config["max_depth"]
    reference = files.reference("base")
    exact = reference.logits(tokens, depth)
    calls = decode_calls(len(tokens))
    for ring in (1, 2, 3):
        stepped = reference.logits(tokens, depth, kv_ring=ring, calls=calls)
        assert np.abs(stepped - exact).max() > 1e-2, ring
        other = reference.logits(tokens, depth, kv_ring=ring, calls=[6, 6])
        assert np.abs(stepped - other).max() > 1e-2, ring
        assert np.allclose(reference.logits(tokens, depth, kv_ring=ring), exact, rtol=0, atol=1e-12)
    assert np.allclose(reference.logits(tokens, depth, calls=calls), exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["base", "init-warm", "huginn-q4", "core2-no-coda", "q2-g32"])
def test_ring_at_least_the_depth_and_the_default_are_exact_bit_for_bit(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    top, default = config["max_depth"], config["default_depth"]
    path = files.path(name)
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK) as exact, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="exact") as named, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="ring",
                           kv_ring_slots=top) as ring_top, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="ring",
                           kv_ring_slots=default) as ring_default:
        for depth, rings in ((top, (named, ring_top)), (default, (named, ring_top, ring_default))):
            expected = exact.score(tokens, depth=depth), decode_logits(exact, tokens, depth)
            for model in rings:
                assert np.array_equal(model.score(tokens, depth=depth), expected[0]), (name, depth)
                assert np.array_equal(decode_logits(model, tokens, depth), expected[1]), (name, depth)
            # a context's own policy over the model's
            assert np.array_equal(decode_logits(exact, tokens, depth, kv_policy="ring", kv_ring_slots=depth),
                                  expected[1])
        # and the exact default still is the oracle's exact pass
        reference = files.reference(name)
        tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE
        if arithmetic(config) == "float" or not ON_CPU:
            assert_close(decode_logits(exact, tokens, top), reference.logits(tokens, top)[PREFILL - 1:],
                         tolerance, f"{name}: exact decode vs oracle")


def test_a_contexts_policy_overrides_the_models(files):
    config = case_config("huginn-q4")
    tokens, depth = case_tokens(config), config["max_depth"]
    path = files.path("huginn-q4")
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK) as exact, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="share_last") as shared:
        assert np.array_equal(decode_logits(exact, tokens, depth, kv_policy="share_last"),
                              decode_logits(shared, tokens, depth))
        assert np.array_equal(decode_logits(shared, tokens, depth, kv_policy="exact"),
                              decode_logits(exact, tokens, depth))
        assert not np.array_equal(decode_logits(shared, tokens, depth), decode_logits(exact, tokens, depth))


def context_kv_bytes(model, **options):
    before = model.memory_report()["kv_cache_bytes"]
    with model.context(**options):
        return model.memory_report()["kv_cache_bytes"] - before


@pytest.mark.parametrize("name", ["base", "huginn-q4", "core2-no-coda"])
def test_kv_bytes_shrink_by_the_shared_slots(files, name):
    config = case_config(name)
    kv_row = 2 * 4 * config["max_seq_len"] * config["n_kv_head"] * config["head_dim"]   # K and V, f32

    def expected(loop_slots):
        return kv_row * (config["n_pre"] + loop_slots * config["n_core"] + config["n_post"])

    top = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        assert context_kv_bytes(model) == expected(top)
        assert context_kv_bytes(model, kv_policy="share_last") == expected(1)
        assert context_kv_bytes(model, kv_policy="ring", kv_ring_slots=2) == expected(2)
        assert context_kv_bytes(model, kv_policy="ring", kv_ring_slots=top + 4) == expected(top)
        assert context_kv_bytes(model, kv_policy="share_last", max_depth=3) == expected(1)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_policy="ring", kv_ring_slots=2) as model:
        assert context_kv_bytes(model) == expected(2)     # contexts take the load option
        model.score(case_tokens(config))                  # and so does the internal context
        assert model.memory_report()["kv_cache_bytes"] == expected(2)


def test_values_and_refused_combinations(files):
    path = files.path("base")
    for bad in (dict(kv_policy="shared"), dict(kv_policy="ring"), dict(kv_policy="share_last", kv_ring_slots=2),
                dict(kv_policy="exact", kv_ring_slots=1)):
        with pytest.raises(ValueError):
            tinyloop.Model(path, device=DEVICE, **bad)
    with pytest.raises(TypeError):
        tinyloop.Model(path, device=DEVICE, kv_policy=2)
    tokens = case_tokens(case_config("base"))
    with tinyloop.Model(path, device=DEVICE, kv_policy="share_last") as model:
        with pytest.raises(UnsupportedError, match="keeping loop states: kv_policy share_last"):
            model.context(keep_loop_states=True)
        with model.context(kv_policy="exact", keep_loop_states=True) as ctx:   # exact may deepen
            ctx.append(tokens, depth=1)
            ctx.deepen(3)
        with pytest.raises(UnsupportedError, match="speculative decoding needs kv_policy exact"):
            model.generate(tokens[:4], max_tokens=4, temperature=0, draft_depth=1)
        with model.context() as ctx:
            with pytest.raises(UnsupportedError, match="kv_policy exact"):
                ctx.generate(tokens[:4], max_tokens=4, draft_depth=1)
            with pytest.raises(InvalidArgumentError, match="keeps no loop states"):
                ctx.append(tokens[:3])
                ctx.deepen(4)
        with pytest.raises(ValueError):
            model.context(kv_policy="ring", kv_ring_slots=0)


def test_c_level_values_and_first_release_struct_sizes(files):
    """The library's own checks (the Python layer bypassed) and old struct sizes: a
    tl_context_options without the kv fields (20 bytes) takes the model's policy, a
    tl_load_options without them (48 bytes) loads exact."""
    path = files.path("base")
    config = case_config("base")
    with tinyloop.Model(path, device=DEVICE, kv_policy="share_last") as model:
        native, ffi = model._native, model._native.ffi
        lib = native.lib

        def create(**fields):
            return create_context(model, **fields)

        assert create(kv_policy=5)[0] == "TL_ERR_INVALID_ARGUMENT"
        assert "tl_context_options.kv_policy is 5" in create(kv_policy=5)[1]
        assert "TL_KV_RING needs at least 1" in create(kv_policy=3)[1]
        assert "only TL_KV_RING uses it" in create(kv_policy=2, kv_ring_slots=3)[1]
        assert "only TL_KV_RING uses it" in create(kv_ring_slots=3)[1]
        assert create(kv_policy=1, keep_loop_states=1)[0] == "TL_OK"
        assert create(keep_loop_states=1)[0] == "TL_ERR_UNSUPPORTED"   # the model's share_last
        before = model.memory_report()["kv_cache_bytes"]
        old = ffi.new("tl_context_options *")
        lib.tl_context_options_default(old)
        old.struct_size = 20
        old.kv_policy = 1           # past the old struct's end: must not be read
        out = ffi.new("tl_context **")
        native.check(lib.tl_context_create(model._require_open(), old, out))
        kv_row = 2 * 4 * config["max_seq_len"] * config["n_kv_head"] * config["head_dim"]
        assert model.memory_report()["kv_cache_bytes"] - before == kv_row * 3   # share_last: 1 + 1 + 1 slots
        lib.tl_context_free(out[0])

        load = ffi.new("tl_load_options *")
        lib.tl_load_options_default(load)
        load.kv_policy = 9
        handle = ffi.new("tl_model **")
        status = lib.tl_load_model(str(path).encode(), load, handle)
        assert ffi.string(lib.tl_status_name(status)) == b"TL_ERR_INVALID_ARGUMENT"
        assert "tl_load_options.kv_policy is 9" in native.last_error()
        load.struct_size = 48       # the release before the kv fields
        load.kv_policy, load.kv_ring_slots = 2, 1
        native.check(lib.tl_load_model(str(path).encode(), load, handle))
        try:
            ctx = ffi.new("tl_context **")
            native.check(lib.tl_context_create(handle[0], ffi.NULL, ctx))
            report = ffi.new("tl_memory_report *")
            lib.tl_memory_report_default(report)
            native.check(lib.tl_memory_report_get(handle[0], report))
            assert report.kv_cache_bytes == kv_row * (2 + config["max_depth"])   # exact
            lib.tl_context_free(ctx[0])
        finally:
            lib.tl_free_model(handle[0])


def oracle_greedy(reference, prompt, depth, n_new, ring):
    """Greedy tokens under the policy: the prompt in one call, then one call per token."""
    tokens = list(prompt)
    for _ in range(n_new):
        calls = [len(prompt)] + [1] * (len(tokens) - len(prompt))
        tokens.append(int(np.argmax(reference.logits(tokens, depth, kv_ring=ring, calls=calls)[-1])))
    return tokens[len(prompt):]


@pytest.mark.parametrize("name", ["base", "huginn-q4", "init-warm"])
def test_generation_through_the_load_option(files, name):
    """tl_generate, a stream, a batched generation and batched decode steps under
    share_last: the oracle's greedy tokens for a prompt in one call then one call per
    token (rows of a batched step are one-token calls of their own sequences)."""
    config = case_config(name)
    tokens = case_tokens(config)
    prompt, depth, n_new = tokens[:5], config["max_depth"], 6
    expected = oracle_greedy(files.reference(name), prompt, depth, n_new, 1)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_policy="share_last") as model:
        got = model.generate(prompt, max_tokens=n_new, depth=depth, temperature=0, eos=False)
        assert got.tokens == expected, name
        assert list(model.stream(prompt, max_tokens=n_new, depth=depth, temperature=0, eos=False)) == expected
        batch = model.generate_batch([prompt, tokens[2:6]], max_tokens=n_new, depth=depth, temperature=0,
                                     eos=False)
        assert batch[0].tokens == expected
        with model.context() as a, model.context() as b, model.context() as alone:
            a.append(tokens[:5], depth=depth)
            b.append(tokens[:3], depth=depth)
            alone.append(tokens[:5], depth=depth)
            rows = [model.append_batch([a, b], [t, t])[0] for t in tokens[5:9]]
            single = [alone.append([t]) for t in tokens[5:9]]
    assert_close(rows, np.array(single, dtype=np.float64), SAME, f"{name}: batched rows vs stepped alone")
    reference = files.reference(name).logits(tokens[:9], depth, kv_ring=1, calls=[5, 1, 1, 1, 1])
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE
    assert_close(rows, reference[5:9], tolerance, f"{name}: batched rows vs oracle")


@pytest.mark.parametrize("chunk", [0, 5])
def test_logit_lens_and_escalation_are_the_policys_passes(files, chunk):
    """The logit lens row d is score_last_token at depth d under the policy; escalation
    (each pass run anew, since it cannot deepen) returns score_with_uncertainty's arrays
    at the depth it stops at."""
    config = case_config("base")
    tokens = case_tokens(config)
    with tinyloop.Model(files.path("base"), device=DEVICE, prefill_chunk=chunk, kv_policy="share_last") as model:
        lens = model.score_logit_lens(tokens)
        for depth in range(1, config["max_depth"] + 1):
            assert np.array_equal(lens[depth - 1], model.score_last_token(tokens, depth=depth)), depth
        logprobs, entropies, used = model.score_with_consistency_escalation(tokens, min_depth=1, max_depth=4)
        expected = model.score_with_uncertainty(tokens, depth=used)
        assert np.array_equal(logprobs, expected[0]) and np.array_equal(entropies, expected[1])
        reference = files.reference("base")
        calls = [len(tokens)] if not chunk else [5, 5, 2]
        assert_close(lens[-1], reference.logits(tokens, config["max_depth"], kv_ring=1, calls=calls)[-1],
                     TOLERANCES["float"] if ON_CPU else DEVICE_TOLERANCE, f"lens chunk {chunk} vs oracle")


def test_kv_share_mode_sets_the_load_options(files):
    config = parse_config('[modes.kv_share]\npolicy = "ring"\nring_slots = 2\n')
    options = config.load_options()
    assert (options["kv_policy"], options["kv_ring_slots"]) == ("ring", 2)
    assert parse_config("[modes.kv_share]\n").load_options()["kv_policy"] == "share_last"
    with pytest.raises(ConfigError, match="modes.kv_share.ring_slots: policy 'ring' needs ring_slots >= 1"):
        parse_config('[modes.kv_share]\npolicy = "ring"\n').load_options()
    with pytest.raises(ConfigError, match="only policy 'ring' uses it"):
        parse_config("[modes.kv_share]\nring_slots = 3\n").load_options()
    with pytest.raises(ConfigError, match="modes.kv_share.policy"):
        parse_config('[modes.kv_share]\npolicy = "exact"\n')
    with pytest.raises(ConfigError, match="conflicts"):
        parse_config("[modes.kv_share]\n[modes.speculative]\n")
    path = files.path("base")
    text = f'[model]\npath = "{path}"\ndevice = "{DEVICE}"\n[modes.kv_share]\n'
    with tinyloop.Model.from_config(parse_config(text)) as model:
        kv_row = 2 * 4 * case_config("base")["max_seq_len"] * 2 * 16
        assert context_kv_bytes(model) == kv_row * 3


def test_the_kv_policy_benchmark(tmp_path):
    """tools/bench/kv_policy.py on a tiny text model: exact decoding agrees with one full
    score (the script checks it), ring 4 = the depth is exact, and the KV shares are the
    slot counts (1 prelude, 1 core, 1 coda block at depth 4: 6 slots exact)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    model = tmp_path / "text.tinyloop"
    textmodel.make_text_model(model)
    text = tmp_path / "text.txt"
    text.write_text("Four score and seven years ago our fathers brought forth, upon this continent.")
    out = tmp_path / "kv.json"
    script = Path(__file__).resolve().parents[2] / "tools" / "bench" / "kv_policy.py"
    subprocess.run([sys.executable, str(script), "--model", str(model), "--text", str(text), "--prompt-tokens",
                    "8", "--depth", "4", "--threads", "1", "--json", str(out)],
                   check=True, timeout=120, capture_output=True)
    report = json.loads(out.read_text())
    rows = {row["policy"]: row for row in report["rows"]}
    assert list(rows) == ["exact", "share_last", "ring 2", "ring 4"]
    assert report["decoded_tokens"] == report["tokens"] - 8 and report["exact_vs_one_pass_max_diff"] < 1e-4
    assert [rows[p]["kv_share_of_exact"] for p in rows] == [1.0, 0.5, 4 / 6, 1.0]
    assert rows["ring 4"]["perplexity"] == rows["exact"]["perplexity"]
    assert rows["ring 4"]["top1_same_as_exact"] == 1.0
    assert rows["share_last"]["perplexity"] != rows["exact"]["perplexity"]


def test_the_prompt_cache_keeps_plain_contexts_under_a_shared_policy(files):
    """The server's prompt cache asks for contexts that keep their loop states; under
    share_last they are refused, and it falls back to contexts at one depth."""
    from tinyloop.prompt_cache import PromptCache
    tokens = case_tokens(case_config("base"))
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_policy="share_last") as model:
        cache = PromptCache(model, 2)
        lease = cache.acquire(tokens[:6].tolist(), 3)
        assert lease.cached == 0 and not lease.sequence.keeps_loop_states
        lease.context.append(lease.rest, depth=3)
        cache.release(lease, tokens[:6].tolist())
        again = cache.acquire(tokens[:9].tolist(), 3)
        assert again.cached == 6 and again.rest == tokens[6:9].tolist()
        assert cache.acquire(tokens[:9].tolist(), 5).cached == 0   # deeper: starts over
        cache.close()


def test_a_batched_step_mixes_policies(files):
    """Each row of a batched step uses its own context's slot map (exact, share_last,
    ring 2 in one pass, the lead context being the exact one)."""
    config = case_config("huginn-q4")
    tokens, depth = case_tokens(config), config["max_depth"]
    with tinyloop.Model(files.path("huginn-q4"), device=DEVICE) as model:
        options = [dict(), dict(kv_policy="share_last"), dict(kv_policy="ring", kv_ring_slots=2)]
        batched = [model.context(**o) for o in options]
        alone = [model.context(**o) for o in options]
        for ctx in batched + alone:
            ctx.append(tokens[:6], depth=depth)
        for t in tokens[6:9]:
            rows = model.append_batch(batched, [t] * 3)
            for row, ctx, o in zip(rows, alone, options):
                assert_close(row, ctx.append([t]).astype(np.float64), SAME, f"batched row under {o}")
        for ctx in batched + alone:
            ctx.close()
