"""Paged KV caches (tl_load_options.kv_page_size / kv_pool_bytes; docs/api.md, "Paged KV").

Pages of page_size positions come from a pool of the model's as a sequence grows and go
back on truncate, reset and free; forks and prefix caches share them by reference count and
a shared page is copied before it is written. Checked here, for every parity case (every
architecture option and weight dtype) and page sizes below, across and above the sequence:
scores and cached decoding against the float64 oracle, cached decoding against
full-sequence scoring, and paged against contiguous results. On the CPU those are equal bit
for bit: the attention kernels split a key range at page boundaries only between rows, and
both their dot products (one per key) and their value sums (one row after another into the
same accumulators) give the same floats split or not. Other devices are held to the
same-backend tolerance (their split-sequence kernels may sum in another order).

Also: the memory report's pages (forks of one prompt cost its pages once, copy on write adds
one page per writer, truncate and free give pages back), the pool's cap (a clear
TL_ERR_OUT_OF_MEMORY naming kv_pool_bytes, the sequence left usable), bad options,
speculative and tree speculative decoding, deepening, batched decoding, KV policies, prefix
caches and pools, and the paged_kv mode in TOML.

TINYLOOP_TEST_DEVICE=cuda runs the same tests on the CUDA backend (tools/gpu_check)."""

import numpy as np
import pytest

import tinyloop
from test_parity import CASES, DEVICE, ON_CPU, SAME, TOLERANCES, DEVICE_TOLERANCE, arithmetic, \
    assert_close, case_config, case_tokens, check_against_references
from reference.ops import log_softmax
from tinyloop.config import parse_config
from tinyloop.errors import ConfigError, InvalidArgumentError, OutOfMemoryError

GREEDY = dict(temperature=0, eos=False)
# N_TOKENS is 12: pages of 1 and 4 positions are crossed many times, 8 leaves the last one
# partly filled, 64 holds the whole sequence in one partly filled page
PAGE_SIZES = [1, 4, 8, 64]


def assert_same(actual, expected, what):
    """Bit for bit on the CPU (see the module's docstring), else within the same-backend bound."""
    if ON_CPU:
        assert np.array_equal(np.asarray(actual), np.asarray(expected)), what
    else:
        assert_close(actual, np.asarray(expected, dtype=np.float64), SAME, what)


def oracle_tolerance(config):
    return TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE


def decode(model, tokens, depth, prefill=5):
    """Last-position logits after each append: a prefill of `prefill` tokens, then one at a time."""
    with model.context() as ctx:
        rows = [ctx.append(tokens[:prefill], depth=depth)]
        rows += [ctx.append(tokens[i:i + 1]) for i in range(prefill, len(tokens))]
    return np.array(rows)


def depth_of(config):
    return config["max_depth"] if config["n_core"] else 0


def page_bytes(config, page_size, loop_slots=None):
    """Bytes of one page: keys and values of every slot (n_pre + loop slots * n_core + n_post)."""
    slots = config["n_pre"] + (config["max_depth"] if loop_slots is None else loop_slots) * config["n_core"] \
        + config["n_post"]
    return 2 * slots * page_size * config["n_kv_head"] * config["head_dim"] * 4


def pages(model):
    return model.memory_report()["kv_pages_in_use"]


# ---------------------------------------------------------------- parity

@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_scores_and_decoding_match_the_oracle_and_the_contiguous_cache(files, name, page_size):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = depth_of(config)
    with tinyloop.Model(files.path(name), device=DEVICE) as plain:
        plain_scores = plain.score(tokens, depth=depth)
        plain_decode = decode(plain, tokens, depth)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=page_size, prefill_chunk=3) as model:
        scores = model.score(tokens, depth=depth)   # chunks of 3 rows: pages filled over calls
        last = model.score_last_token(tokens, depth=depth)
        stepped = decode(model, tokens, depth)
    label = f"{name} pages of {page_size}"
    check_against_references(files, name, depth, scores, last, label)
    reference = files.reference(name).logits(tokens, depth)
    assert_close(stepped, reference[4:], oracle_tolerance(config), f"{label}: cached decode vs oracle")
    # cached decoding equals full-sequence scoring
    for i, pos in enumerate(range(4, len(tokens) - 1)):
        cached = log_softmax(np.asarray(stepped[i], dtype=np.float64))[tokens[pos + 1]]
        assert_close([cached], [scores[pos]], SAME, f"{label}: cached log-prob at {pos}")
    assert_close(stepped[-1], last.astype(np.float64), SAME, f"{label}: cached last logits")
    assert_same(stepped, plain_decode, f"{label}: paged decode vs contiguous")
    assert_same(scores, plain_scores, f"{label}: paged score vs contiguous")


@pytest.mark.parametrize("name", ["base", "sliding_window", "init-warm", "coda2", "plain-llama"])
def test_pages_follow_the_sequence(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=4) as model:
        assert pages(model) == 0
        report = model.memory_report()
        assert report["kv_page_size"] == 4 and report["kv_pool_cap_bytes"] == 0
        with model.context() as ctx:
            for n in range(1, len(tokens) + 1):
                ctx.append(tokens[n - 1:n], depth=depth_of(config))
                assert pages(model) == (n + 3) // 4, f"{n} tokens"
            one = page_bytes(config, 4)
            assert model.memory_report()["kv_pool_bytes"] == 3 * one
            assert model.memory_report()["kv_cache_bytes"] >= 3 * one
            ctx.truncate(5)
            assert pages(model) == 2
            ctx.truncate(4)
            assert pages(model) == 1
            ctx.reset()
            assert pages(model) == 0
            ctx.append(tokens, depth=depth_of(config))
            assert pages(model) == 3
        assert pages(model) == 0 and model.memory_report()["kv_pool_bytes"] == 0


def test_contiguous_default_reports_no_pages(files):
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        with model.context() as ctx:
            ctx.append(case_tokens(case_config("base")))
            report = model.memory_report()
    assert report["kv_page_size"] == report["kv_pages_in_use"] == report["kv_pool_bytes"] == 0
    assert report["kv_cache_bytes"] > 0


# ---------------------------------------------------------------- sharing, copy on write

@pytest.mark.parametrize("name", ["base", "init-warm", "injection-concat", "sliding_window"])
@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_forks_share_pages_and_copy_on_write(files, name, page_size):
    """A fork costs no page; then parent and fork go on with different tokens, each equal to
    a fresh run of its own sequence, and only the shared partly filled page is copied."""
    config = case_config(name)
    tokens = case_tokens(config)
    depth = depth_of(config)
    prompt, a = tokens[:10], tokens[10:]
    b = (a[::-1] + 1) % config["vocab_size"]
    with tinyloop.Model(files.path(name), device=DEVICE) as plain:
        expect_a = decode(plain, np.concatenate([prompt, a]), depth, prefill=10)
        expect_b = decode(plain, np.concatenate([prompt, b]), depth, prefill=10)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=page_size) as model:
        with model.context() as parent:
            first = parent.append(prompt, depth=depth)
            held = pages(model)
            assert held == -(-10 // page_size)
            with parent.fork() as child:
                assert len(child) == 10
                assert pages(model) == held, "a fork takes no page"
                rows_a, rows_b = [first], [first]
                for x, y in zip(a, b):
                    rows_a.append(parent.append([int(x)]))
                    rows_b.append(child.append([int(y)]))
                # the pages wholly before position 10 stay shared; each has its own from
                # there (the partly filled one is copied once: its last holder writes it in place)
                own = -(-12 // page_size) - 10 // page_size
                assert pages(model) == 10 // page_size + 2 * own, f"pages of {page_size}"
            assert pages(model) == -(-12 // page_size)
    assert_same(np.array(rows_a), expect_a, f"{name}: the parent after the fork")
    assert_same(np.array(rows_b), expect_b, f"{name}: the fork")


def test_eight_forks_of_a_prompt_cost_its_pages_once(files):
    config = case_config("base")
    tokens = np.arange(40, dtype=np.int32) % config["vocab_size"]
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=8) as model:
        with model.context() as ctx:
            ctx.append(tokens[:32])
            assert pages(model) == 4
            forks = [ctx.fork() for _ in range(8)]
            assert pages(model) == 4
            for i, f in enumerate(forks):   # a full last page: the first new token opens a page of its own
                f.append([i])
            assert pages(model) == 4 + 8
            for f in forks:
                f.close()
            assert pages(model) == 4


@pytest.mark.parametrize("page_size", [4, 16])
def test_prefix_caches_share_pages(files, page_size):
    config = case_config("base")
    tokens = case_tokens(config)
    depth = config["max_depth"]
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain:
        expected = decode(plain, tokens, depth, prefill=7)
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=page_size) as model:
        with model.context() as ctx:
            ctx.append(tokens[:7], depth=depth)
            held = pages(model)
            cache = ctx.prefix_cache()
            assert pages(model) == held, "a snapshot takes no page"
            assert model.memory_report()["prefix_cache_bytes"] == 0
        assert pages(model) == held, "the snapshot keeps the context's pages"
        with model.context(prefix=cache) as a, model.context(prefix=cache) as b:
            assert pages(model) == held
            rows_a = [a.append(tokens[7:8])] + [a.append(tokens[i:i + 1]) for i in range(8, len(tokens))]
            rows_b = [b.append(tokens[7:8])] + [b.append(tokens[i:i + 1]) for i in range(8, len(tokens))]
        # a cache computed on a context of its own depth lays out fewer slots: copied in
        shallow = model.prefix_cache(tokens[:7], depth=2)
        with model.context(prefix=shallow) as c:
            rows_c = [c.append(tokens[i:i + 1]) for i in range(7, len(tokens))]
        cache.close()
        shallow.close()
        assert pages(model) == 0
    assert_same(np.array(rows_a), expected[1:], "first context from the prefix")
    assert_same(np.array(rows_b), expected[1:], "second context from the prefix")
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain:
        expected2 = decode(plain, tokens, 2, prefill=7)
    assert_same(np.array(rows_c), expected2[1:], "a prefix computed at depth 2, copied")


def test_prefix_pool_generation_with_paged_kv(files):
    prompt = list(case_tokens(case_config("base")))
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain:
        expected = plain.generate(prompt, max_tokens=8, **GREEDY).tokens
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4) as model:
        pool = tinyloop.PrefixPool(model, register_prompts=True)
        assert model.generate(prompt, max_tokens=8, pool=pool, **GREEDY).tokens == expected
        assert model.generate(prompt, max_tokens=8, pool=pool, **GREEDY).tokens == expected
        assert pool.stats()["hits"] >= 1
        pool.close()


# ---------------------------------------------------------------- the pool's cap

def test_the_cap_fails_cleanly_and_leaves_the_sequence_usable(files):
    config = case_config("base")
    tokens = case_tokens(config)
    depth = config["max_depth"]
    one = page_bytes(config, 4)
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain:
        expected = decode(plain, tokens, depth, prefill=8)
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4, kv_pool_bytes=2 * one) as model:
        assert model.memory_report()["kv_pool_cap_bytes"] == 2 * one
        with model.context() as ctx:
            first = ctx.append(tokens[:8], depth=depth)
            assert pages(model) == 2
            with pytest.raises(OutOfMemoryError, match="kv_pool_bytes"):
                ctx.append(tokens[8:9])
            assert len(ctx) == 8 and pages(model) == 2
            # a fork shares; its first write into a full page needs a new one: refused too
            with ctx.fork() as f:
                with pytest.raises(OutOfMemoryError, match="kv_pool_bytes"):
                    f.append(tokens[8:12])
                assert len(f) == 8
            with pytest.raises(OutOfMemoryError):
                with model.context() as other:
                    other.append(tokens[:1])
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4, kv_pool_bytes=3 * one) as model:
        with model.context() as ctx:
            rows = [ctx.append(tokens[:8], depth=depth)]
            with model.context() as hog:
                hog.append(tokens[:4])   # takes the last page
                with pytest.raises(OutOfMemoryError, match="kv_pool_bytes"):
                    ctx.append(tokens[8:9])
                assert len(ctx) == 8
            rows += [ctx.append(tokens[i:i + 1]) for i in range(8, len(tokens))]   # freed: goes on
    assert_same(np.array(rows), expected, "after the refused append")
    assert_same(first, expected[0], "before the cap")


# ---------------------------------------------------------------- options

@pytest.mark.parametrize("bad", [3, 6, 8192, 1 << 20])
def test_bad_page_sizes_are_refused(files, bad):
    with pytest.raises(InvalidArgumentError, match="kv_page_size"):
        tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=bad)


def test_bad_pool_options_are_refused(files):
    with pytest.raises(InvalidArgumentError, match="kv_pool_bytes.*kv_page_size"):
        tinyloop.Model(files.path("base"), device=DEVICE, kv_pool_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_pool_bytes"):
        tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4, kv_pool_bytes=-1)
    with pytest.raises(ValueError, match="kv_page_size"):
        tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=-4)


# ---------------------------------------------------------------- modes on paged KV

SPEC_PROMPT = [5, 17, 3, 88, 41, 9]


def plain_greedy(files, name):
    """(depth, the contiguous cache's greedy tokens at the case's max depth)."""
    depth = case_config(name)["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as plain:
        return depth, plain.generate(SPEC_PROMPT, max_tokens=30, depth=depth, **GREEDY).tokens


@pytest.mark.parametrize("name", ["base", "init-warm", "injection-concat", "coda2", "q4-g32"])
def test_speculative_decoding_with_paged_kv(files, name):
    depth, expected = plain_greedy(files, name)
    prompt = SPEC_PROMPT
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=4) as model:
        for n_draft in (1, 3, 8):
            r = model.generate(prompt, max_tokens=30, depth=depth, draft_depth=1, n_draft=n_draft, **GREEDY)
            assert r.tokens == expected, f"{name}: {n_draft} drafts"
            assert r.drafted_tokens > 0


@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_a_speculative_stream_gives_back_its_round_pages_at_its_end(files, tree):
    # rounds write drafts past the kept tokens and truncate without giving pages back;
    # the stream's end must leave exactly the pages of the tokens it kept
    name, page_size = "base", 2
    depth, expected = plain_greedy(files, name)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=page_size) as model:
        with model.context() as ctx:
            drafting = dict(tree=tree) if tree else dict(n_draft=8)
            r = ctx.generate(SPEC_PROMPT, max_tokens=7, depth=depth, draft_depth=1, **drafting, **GREEDY)
            assert r.tokens == expected[:7] and r.drafted_tokens > 0
            assert pages(model) == -(-len(ctx) // page_size), (len(ctx), pages(model))


@pytest.mark.parametrize("name", ["base", "injection-concat", "coda2", "sliding_window"])
def test_tree_speculation_with_paged_kv(files, name):
    depth, expected = plain_greedy(files, name)
    prompt = SPEC_PROMPT
    for page_size in (1, 4):
        with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=page_size) as model:
            for tree in ((2, 2), (3, 2, 1)):
                r = model.generate(prompt, max_tokens=30, depth=depth, draft_depth=1, tree=tree, **GREEDY)
                assert r.tokens == expected, f"{name}: pages of {page_size}, tree {tree}"
                assert r.drafted_tokens > 0


@pytest.mark.parametrize("name", ["base", "injection-concat", "coda2"])
def test_deepen_with_paged_kv_and_a_fork(files, name):
    """Deepening rewrites every page of the sequence: a fork made before it copies them
    and keeps its own depth's results."""
    config = case_config(name)
    tokens = case_tokens(config)
    deep = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE) as plain:
        expect_deep = decode(plain, tokens, deep, prefill=9)
        expect_shallow = decode(plain, tokens, 2, prefill=9)
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=4) as model:
        with model.context(keep_loop_states=True) as ctx:
            ctx.append(tokens[:9], depth=2)
            with ctx.fork() as shallow:
                held = pages(model)
                deepened = ctx.deepen(deep)
                assert pages(model) == 2 * held, "the deeper pass copied the shared pages"
                rows = [deepened] + [ctx.append(tokens[i:i + 1]) for i in range(9, len(tokens))]
                rows_s = [shallow.append(tokens[i:i + 1]) for i in range(9, len(tokens))]
    assert_close(rows, expect_deep.astype(np.float64), SAME, f"{name}: deepened")
    assert_same(np.array(rows_s), expect_shallow[1:], f"{name}: the fork at its own depth")


def test_deepen_at_the_cap_leaves_the_sequence(files):
    """Deepening a sequence whose pages a fork shares copies them all first: past the cap it
    fails before any chunk ran, and the sequence keeps its depth and goes on."""
    config = case_config("base")
    tokens = case_tokens(config)
    deep = config["max_depth"]
    with tinyloop.Model(files.path("base"), device=DEVICE) as plain:
        expect_deep = decode(plain, tokens, deep, prefill=8)
        expect_shallow = decode(plain, tokens, 2, prefill=8)
    cap = 3 * page_bytes(config, 4)
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4, prefill_chunk=3,
                        kv_pool_bytes=cap) as model:
        with model.context(keep_loop_states=True) as ctx:
            ctx.append(tokens[:8], depth=2)
            fork = ctx.fork()
            with pytest.raises(OutOfMemoryError, match="kv_pool_bytes"):
                ctx.deepen(deep)
            assert len(ctx) == 8
            fork.close()
            shallow = [ctx.append(tokens[8:9])]   # still at depth 2
            ctx.truncate(8)
            rows = [ctx.deepen(deep)] + [ctx.append(tokens[i:i + 1]) for i in range(8, len(tokens))]
    assert_same(np.array(shallow), expect_shallow[1:2], "the sequence after the refused deepening")
    assert_close(rows, expect_deep.astype(np.float64), SAME, "deepened once the fork was gone")


@pytest.mark.parametrize("name", ["base", "sliding_window", "coda2"])
def test_batched_decoding_with_paged_kv(files, name):
    config = case_config(name)
    tokens = case_tokens(config)
    depth = config["max_depth"]
    with tinyloop.Model(files.path(name), device=DEVICE, kv_page_size=4) as model:
        lengths = [3, 4, 7]
        contexts = [model.context() for _ in lengths]
        for c, n in zip(contexts, lengths):
            c.append(tokens[:n], depth=depth)
        forks = [contexts[1].fork()]   # shares the full page of 4: the batch's write opens a page
        batched = model.append_batch(contexts + forks, [int(tokens[n]) for n in lengths] + [5])
        for c in contexts + forks:
            c.close()
        single = []
        for n in lengths:
            with model.context() as c:
                c.append(tokens[:n], depth=depth)
                single.append(c.append(tokens[n:n + 1]))
        with model.context() as c:
            c.append(tokens[:4], depth=depth)
            single.append(c.append([5]))
    assert_close(batched, np.array(single, dtype=np.float64), SAME, f"{name}: batched rows vs one by one")


@pytest.mark.parametrize("policy", [dict(kv_policy="share_last"), dict(kv_policy="ring", kv_ring_slots=2)])
def test_kv_policies_with_paged_kv(files, policy):
    """Approximate policies keep fewer slots per page; the results are the contiguous
    cache's under the same policy."""
    config = case_config("base")
    tokens = case_tokens(config)
    with tinyloop.Model(files.path("base"), device=DEVICE, **policy) as plain:
        expected = decode(plain, tokens, config["max_depth"])
    with tinyloop.Model(files.path("base"), device=DEVICE, kv_page_size=4, **policy) as model:
        with model.context() as ctx:
            ctx.append(tokens)
            slots = 1 if policy["kv_policy"] == "share_last" else 2
            assert model.memory_report()["kv_pool_bytes"] == 3 * page_bytes(config, 4, loop_slots=slots)
        got = decode(model, tokens, config["max_depth"])
    assert_same(got, expected, f"{policy}")


# ---------------------------------------------------------------- the paged_kv mode

def test_paged_kv_mode_in_toml(files):
    config = parse_config(f"""
[model]
path = "{files.path('base')}"
device = "{DEVICE}"
[modes.paged_kv]
page_size = 8
pool_mb = 2
""")
    options = config.load_options()
    assert options["kv_page_size"] == 8 and options["kv_pool_bytes"] == 2 << 20
    with tinyloop.Model.from_config(config) as model:
        report = model.memory_report()
        assert report["kv_page_size"] == 8 and report["kv_pool_cap_bytes"] == 2 << 20
    assert parse_config("[modes.paged_kv]\n").load_options()["kv_page_size"] == 16   # the mode's default
    # it conflicts with nothing: with speculation, tree speculation and kv_share
    for other in ("[modes.speculative]", "[modes.tree_speculative]", "[modes.kv_share]"):
        both = parse_config(f"[modes.paged_kv]\npage_size = 4\n{other}\n[sampling]\ntemperature = 0\n")
        assert both.load_options()["kv_page_size"] == 4, other


@pytest.mark.parametrize("body,match", [
    ("page_size = 8\npages = 3\n", "pages"),
    ("page_size = 12\n", "page_size"),
    ("page_size = 0\n", "page_size"),
    ("page_size = \"8\"\n", "page_size"),
    ("pool_mb = -1\n", "pool_mb"),
])
def test_paged_kv_mode_bad_keys(body, match):
    with pytest.raises(ConfigError, match=match):
        parse_config("[modes.paged_kv]\n" + body).load_options()
