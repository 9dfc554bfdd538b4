"""Prefix caches and prefix pools (docs/api.md, "Prefix caches and pools").

Checked: a context loaded from a prefix cache continues bit for bit (on the CPU; within
the same-backend bound elsewhere) as one that appended the prefix, for the architecture
options, weight types and state inits (warm included) of the parity cases below, and its
logits are the float64 oracle's; generations from a pool give plain generation's tokens
(greedy and seeded sampling, buffers and streams) and report the prompt tokens they
reused; least recently used prefixes are evicted first within the byte budget, and a
cache still held outlives its eviction; threads share one pool; kept loop states travel
with a snapshot; the memory report counts live caches; bad input gives clear errors."""

import threading

import numpy as np
import pytest

import tinyloop
from test_parity import CASES, DEVICE, DEVICE_TOLERANCE, ON_CPU, SAME, TOLERANCES, arithmetic, \
    assert_close, case_config, case_depths, case_tokens
from tinyloop.errors import ContextFullError, InvalidArgumentError, TinyLoopError

PARITY_CASES = ["base", "init-warm", "init-noise", "init-zeros", "injection-concat", "coda2",
                "plain-llama", "sliding_window", "q4-g32", "bf16", "huginn-q4", "warm-window-q8"]
SPLIT = 5   # prefix tokens of the 12 of case_tokens


def assert_same(actual, expected, what):
    if ON_CPU:
        assert np.array_equal(actual, expected), f"{what}: max |diff| {np.abs(actual - expected).max():.3g}"
    else:
        assert_close(actual, np.asarray(expected, dtype=np.float64), SAME, what)


def open_model(files, name, **options):
    return tinyloop.Model(files.path(name), device=DEVICE, threads=2, **options)


@pytest.mark.parametrize("name", PARITY_CASES)
def test_loaded_prefix_continues_as_appended_and_matches_oracle(files, name):
    assert name in CASES
    config = case_config(name)
    tokens = case_tokens(config)
    reference = files.reference(name)
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE
    with open_model(files, name) as model:
        for depth in case_depths(config):
            with model.prefix_cache(tokens[:SPLIT], depth=depth) as cache, \
                    model.context() as appended, model.context(prefix=cache) as loaded:
                assert len(loaded) == SPLIT and cache.n_tokens == SPLIT
                appended.append(tokens[:SPLIT], depth=depth)
                expected = reference.logits(tokens, depth)
                # one token at a time: every position after the prefix, then decode steps
                for i in range(SPLIT, len(tokens)):
                    want = appended.append(tokens[i:i + 1])
                    got = loaded.append(tokens[i:i + 1])
                    assert_same(got, want, f"{name} depth {depth} position {i}")
                    assert_close(got, expected[i], tolerance, f"{name} depth {depth} position {i} vs oracle")
                # a whole chunk after the prefix, as after appending it
                appended.load_prefix(cache)
                loaded.reset()
                loaded.append(tokens[:SPLIT], depth=depth)
                assert_same(appended.append(tokens[SPLIT:]), loaded.append(tokens[SPLIT:]),
                            f"{name} depth {depth} chunk after the prefix")


@pytest.mark.parametrize("name", ["base", "init-warm", "plain-llama", "q4-g32"])
def test_pool_generation_matches_plain_generation(files, name):
    tokens = case_tokens(case_config(name)).tolist()
    with open_model(files, name) as model, tinyloop.PrefixPool(model) as pool:
        pool.add(tokens[:SPLIT])
        pool.add(tokens)   # the whole prompt held: its last token is still computed
        for options in (dict(temperature=0.0), dict(temperature=0.9, seed=7, top_k=0)):
            for prompt, cached in ((tokens[:SPLIT + 3], SPLIT), (tokens, len(tokens) - 1)):
                plain = model.generate(prompt, max_tokens=8, eos=False, **options)
                pooled = model.generate(prompt, max_tokens=8, eos=False, pool=pool, **options)
                assert pooled.tokens == plain.tokens, options
                assert pooled.cached_tokens == cached and plain.cached_tokens == 0
                assert pooled.prompt_tokens == len(prompt)
                stream = model.stream(prompt, max_tokens=8, eos=False, pool=pool, **options)
                assert list(stream) == plain.tokens
                assert stream.result.cached_tokens == cached
        miss = model.generate(tokens[1:], max_tokens=3, temperature=0.0, pool=pool)
        assert miss.cached_tokens == 0
        stats = pool.stats()
        assert stats["prefixes"] == 2 and stats["hits"] == 8 and stats["misses"] == 1


def test_register_prompts_reuses_them(files):
    tokens = case_tokens(case_config("base")).tolist()
    with open_model(files, "base") as model, tinyloop.PrefixPool(model, register_prompts=True) as pool:
        first = model.generate(tokens[:8], max_tokens=4, temperature=0.0, pool=pool)
        assert first.cached_tokens == 0 and pool.lookup(tokens[:8]) == 8
        again = model.generate(tokens, max_tokens=4, temperature=0.0, pool=pool)
        assert again.cached_tokens == 8
        assert again.tokens == model.generate(tokens, max_tokens=4, temperature=0.0).tokens
        assert pool.stats()["prefixes"] == 2   # the longer prompt was added too


def test_lookup_is_longest_prefix_at_the_requested_depth(files):
    tokens = case_tokens(case_config("base")).tolist()
    with open_model(files, "base") as model, tinyloop.PrefixPool(model) as pool:
        pool.add(tokens[:3])
        pool.add(tokens[:7])
        pool.add(tokens[:7], depth=1)
        assert pool.lookup(tokens) == 7
        assert pool.lookup(tokens[:6]) == 3
        assert pool.lookup(tokens[1:]) == 0
        assert pool.lookup(tokens, depth=1) == 7
        assert pool.lookup(tokens, depth=2) == 0   # a prefix of another depth is no match
        assert pool.stats()["prefixes"] == 3


def test_lru_eviction_order_and_budget_accounting(files):
    config = case_config("base")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config["vocab_size"], 6).tolist() for _ in range(4)]
    with open_model(files, "base") as model:
        with model.prefix_cache(prompts[0]) as probe:
            one = probe.bytes
        with tinyloop.PrefixPool(model, max_bytes=2 * one + one // 2) as pool:
            pool.add(prompts[0])
            pool.add(prompts[1])
            assert pool.lookup(prompts[0]) == 6      # 0 becomes the most recently used
            pool.add(prompts[2])                     # evicts 1
            assert pool.lookup(prompts[1]) == 0
            assert pool.lookup(prompts[2]) == 6 and pool.lookup(prompts[0]) == 6
            pool.add(prompts[3])                     # evicts 2, used before 0
            assert pool.lookup(prompts[2]) == 0 and pool.lookup(prompts[0]) == 6
            stats = pool.stats()
            assert stats == dict(stats, prefixes=2, bytes=2 * one, max_bytes=2 * one + one // 2, evicted=2)
            assert model.memory_report()["prefix_cache_bytes"] == 2 * one


def test_a_held_cache_outlives_its_eviction_and_its_pool(files):
    tokens = case_tokens(case_config("init-warm")).tolist()
    with open_model(files, "init-warm") as model:
        held = model.prefix_cache(tokens[:SPLIT])
        pool = tinyloop.PrefixPool(model, max_bytes=held.bytes)
        pool.add_cache(held)
        pool.add(tokens[1:SPLIT + 1])              # evicts the held cache from the pool
        assert pool.lookup(tokens) == 0 and pool.stats()["evicted"] == 1
        pool.close()
        with model.context(prefix=held) as loaded, model.context() as appended:
            appended.append(tokens[:SPLIT])
            assert_same(loaded.append(tokens[SPLIT:]), appended.append(tokens[SPLIT:]), "held cache")
        held.close()
        assert model.memory_report()["prefix_cache_bytes"] == 0


def test_kept_loop_states_travel_with_a_snapshot(files):
    tokens = case_tokens(case_config("base")).tolist()
    with open_model(files, "base") as model, model.context(keep_loop_states=True) as source:
        source.append(tokens, depth=2)
        with source.prefix_cache() as cache, model.context(keep_loop_states=True, prefix=cache) as loaded:
            assert cache.depth == 2 and len(loaded) == len(tokens)
            assert_same(loaded.deepen(4), source.deepen(4), "deepened after loading")
            with pytest.raises(InvalidArgumentError, match="keeps loop states"):
                model.context(keep_loop_states=True, prefix=model.prefix_cache(tokens[:3]))


def test_threads_share_one_pool(files):
    tokens = case_tokens(case_config("base")).tolist()
    rng = np.random.default_rng(5)
    prompts = [tokens[:SPLIT] + rng.integers(0, 96, 4).tolist() for _ in range(4)]
    with open_model(files, "base", max_seq_len=32) as model:
        want = [model.generate(p, max_tokens=6, temperature=0.0, eos=False).tokens for p in prompts]
        with model.prefix_cache(prompts[0]) as probe:
            budget = 2 * probe.bytes + probe.bytes // 2
        with tinyloop.PrefixPool(model, max_bytes=budget, register_prompts=True) as pool:
            pool.add(tokens[:SPLIT])
            failures = []

            def run(index):
                for rep in range(6):
                    which = (index + rep) % 4
                    got = model.generate(prompts[which], max_tokens=6, temperature=0.0, eos=False, pool=pool)
                    if got.tokens != want[which]:
                        failures.append((index, which))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert failures == []
            stats = pool.stats()
            assert stats["hits"] + stats["misses"] == 24 and stats["bytes"] <= budget


def test_errors(files, tmp_path):
    tokens = case_tokens(case_config("base")).tolist()
    with open_model(files, "base") as model, open_model(files, "base") as other:
        cache = model.prefix_cache(tokens)
        with other.context() as foreign, pytest.raises(InvalidArgumentError, match="another model"):
            foreign.load_prefix(cache)
        with pytest.raises(ContextFullError, match="longer than the context"):
            model.context(max_seq_len=8, prefix=cache)
        with pytest.raises(InvalidArgumentError, match="max_bytes"):
            tinyloop.PrefixPool(model, max_bytes=cache.bytes - 1).add(tokens)
        with pytest.raises(ValueError, match="max_depth"):
            model.prefix_cache(tokens, depth=model.info.max_depth + 1)
        with pytest.raises(InvalidArgumentError, match="another model"):
            other.generate(tokens, max_tokens=2, pool=tinyloop.PrefixPool(model))
        with pytest.raises(InvalidArgumentError, match="another model"):
            tinyloop.PrefixPool(other).add_cache(cache)
        with model.context() as ctx, pytest.raises(InvalidArgumentError, match="context of its own"):
            ctx.generate(tokens, max_tokens=2, pool=tinyloop.PrefixPool(model))
        with pytest.raises(TypeError):
            model.generate(tokens, max_tokens=2, pool="pool")
        with pytest.raises(TypeError):
            model.context(prefix=tokens)
        with pytest.raises(InvalidArgumentError, match="empty"):
            model.context().prefix_cache()
        with pytest.raises(ValueError):
            model.prefix_cache([])
        cache.close()
        with pytest.raises(TinyLoopError, match="closed"):
            model.context(prefix=cache)
        # the model's close() releases what is still open on it
        model.prefix_cache(tokens)
        tinyloop.PrefixPool(model).add(tokens)
    assert model.closed


def test_the_benchmark_tool_runs(tmp_path):
    """tools/bench/prefix_pool.py on a tiny model: three rows, the pool's supplying the
    prefix (the tool itself fails when the ways' tokens differ)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench" / "prefix_pool.py"
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(tool), "--model", str(path), "--threads", "1", "--prefix", "12",
                    "--suffix", "3", "--repeat", "2", "--json", str(out)], check=True, timeout=300,
                   capture_output=True)
    report = json.loads(out.read_text())
    assert [row["way"] for row in report["rows"]] == ["pool", "empty pool", "plain"]
    assert [row["cached_tokens"] for row in report["rows"]] == [12, 0, 0]
    assert report["prefix_bytes"] > 0 and all(row["ttft_ms"] > 0 for row in report["rows"])


def test_prefix_caches_under_kv_policies(files):
    """A snapshot keeps every loop iteration's K/V apart: contexts whose KV policy shares
    the slots of the sequence's iterations neither give nor take one; a ring at least the
    depth is exact and does."""
    from tinyloop.errors import UnsupportedError
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        depth = case_config("base")["default_depth"]
        tokens = [1, 2, 3, 4, 5]
        with model.prefix_cache(tokens, depth=depth) as cache:
            with model.context(kv_policy="share_last") as shared:
                with pytest.raises(UnsupportedError, match="KV policy"):
                    shared.load_prefix(cache)
                shared.append(tokens, depth=depth)
                with pytest.raises(UnsupportedError, match="KV policy"):
                    shared.prefix_cache()
            with model.context(kv_policy="ring", kv_ring_slots=depth) as ring, model.context() as plain:
                ring.load_prefix(cache)
                plain.load_prefix(cache)
                assert np.array_equal(ring.append([6], depth=depth), plain.append([6], depth=depth))


def test_a_model_without_a_loop_ignores_the_depth_of_its_prefixes(files):
    """On a plain dense model (n_core 0) depth means nothing, as for its contexts and
    generations: every prefix is kept at depth 0, whatever depth it was added at, and a
    lookup or a generation at any depth matches it (one entry, not one per depth). A
    looped model's prefix matches only its own depth."""
    config = case_config("plain-llama")
    assert config["n_core"] == 0
    tokens = case_tokens(config)
    with open_model(files, "plain-llama") as model:
        pool = tinyloop.PrefixPool(model)
        pool.add(tokens[:SPLIT], depth=3)
        pool.add(tokens[:SPLIT], depth=0)   # the same prefix: held already
        with model.prefix_cache(tokens[:SPLIT + 2], depth=5) as cache:
            assert cache.depth == 0
            pool.add_cache(cache)
        assert pool.stats()["prefixes"] == 2
        for depth in (0, 1, 2, 7):
            assert pool.lookup(tokens, depth=depth) == SPLIT + 2, depth
            plain = model.generate(tokens, max_tokens=4, eos=False, temperature=0.0, depth=depth)
            pooled = model.generate(tokens, max_tokens=4, eos=False, temperature=0.0, depth=depth, pool=pool)
            assert pooled.tokens == plain.tokens and pooled.cached_tokens == SPLIT + 2, depth
        with pytest.raises(ValueError, match="depth"):
            pool.lookup(tokens, depth=-1)
        pool.close()
    looped = case_config("base")
    loop_tokens = case_tokens(looped)
    with open_model(files, "base") as model:
        pool = tinyloop.PrefixPool(model)
        pool.add(loop_tokens[:SPLIT], depth=1)
        assert pool.lookup(loop_tokens, depth=1) == SPLIT
        assert pool.lookup(loop_tokens, depth=2) == 0
        assert pool.lookup(loop_tokens, depth=0) == (SPLIT if model.info.default_depth == 1 else 0)
        pool.close()
