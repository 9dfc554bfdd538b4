"""Tree speculation (tree_widths / tree_budget with draft_depth; docs/api.md, "Tree
speculation").

- The tree-masked forward pass: every node of a token tree after a prefix gets the
  oracle's logits of prefix + the node's path (tests/reference/, which knows nothing of
  trees: a path is a plain sequence), for architecture options, weight dtypes and state
  inits (warm is refused), in one pass and split in two passes as drafting's levels run.
- Greedy tree speculation gives plain greedy decoding's tokens on random models and the
  shipped model, for several shapes, budgets and draft depths.
- After a round the accepted path's K/V rows are where a linear append puts them: the
  context goes on and its next logits equal a fresh full scoring's.
- Sampled tree speculation (multi-candidate speculative sampling) returns tokens
  distributed as plain sampling's (counts over many seeds against the exact
  distributions), is seeded, and leaves the context as plain decoding does.
- Bad shapes, budgets, draft depths and combinations are clear errors; a warm state init
  is TL_ERR_UNSUPPORTED.

The random models have untied heads, as in test_speculative.py, so that greedy decoding
does not repeat one token and the refusal path runs."""

import numpy as np
import pytest

import tinyloop
from test_parity import DEVICE, ON_CPU, SAME, TOLERANCES, arithmetic, assert_close, case_config
from testing_hooks import hooks_of, through_testing_library  # noqa: F401 (autouse: the models load through the testing library)
from tinyloop import default_model
from tinyloop.default_model import DEFAULT_MODEL_NAME
from reference import ReferenceModel
from test_speculative import PROMPT, check_seeded, model_file

GREEDY = dict(temperature=0, eos=False)
# a tree after the prefix: node i's parent (-1: the prefix's last token); breadth first
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 9]
PASS_CASES = ["base", "sandwich_outer", "sandwich_branch", "rope_interleaved", "rope_partial-interleaved",
              "qkv_bias", "sliding_window", "injection-concat", "injection-none", "init-noise", "loop_norm",
              "mqa", "core2-no-coda", "coda2", "plain-llama", "bf16", "q8-g32", "q4-g64", "q2-g32",
              "huginn-q4", "ouro-bf16"]
GREEDY_CASES = ["base", "init-noise", "injection-concat", "injection-none", "loop_norm", "sliding_window",
                "core2-no-coda", "coda2", "q4-g32", "huginn-q4"]
SHAPES = [((1,), 0), ((3,), 0), ((2, 2), 0), ((4, 2, 1, 1), 0), ((3, 2, 1, 1, 1, 1), 7),
          ((2, 1, 1, 1, 1, 1, 1, 1), 0), ((8, 8), 63)]




def tree_logits(ctx, tokens, parents, depth, n_first=0):
    """Every node's logits from the tree-masked pass after ctx's sequence."""
    native = ctx._model._native
    ffi, lib = hooks_of(native)
    n = len(tokens)
    logits = np.empty((n, ctx._model.info.vocab_size), dtype=np.float32)
    native.check(lib.tl_testing_tree_logits(
        ctx._require_open(), ffi.new("int32_t[]", list(tokens)), ffi.new("int32_t[]", list(parents)), n, n_first,
        depth, ffi.from_buffer("float[]", logits, require_writable=True)))
    return logits


def path_of(node, tokens, parents):
    path = []
    while node >= 0:
        path.append(int(tokens[node]))
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("name", PASS_CASES)
def test_tree_pass_gives_each_node_its_paths_logits(model_dir, name):
    config = case_config(name)
    path = model_file(model_dir, name)
    reference = ReferenceModel.from_file(path)
    depths = [0] if config["n_core"] == 0 else sorted({1, config["max_depth"]})
    rng = np.random.default_rng(config["seed"] + 7)
    tokens = rng.integers(0, config["vocab_size"], len(PARENTS)).tolist()
    prefix = PROMPT[:5]
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else (1e-4, 2e-5)
    with tinyloop.Model(path, device=DEVICE) as model:
        for depth in depths:
            for n_first in (0, 4):   # one pass; two, the second seeing the first's rows
                with model.context() as ctx:
                    ctx.append(prefix, depth=depth)
                    got = tree_logits(ctx, tokens, PARENTS, depth, n_first)
                for node in range(len(PARENTS)):
                    expected = reference.logits(prefix + path_of(node, tokens, PARENTS), depth)[-1]
                    assert_close(got[node], expected, tolerance,
                                 f"{name} depth {depth} node {node} (passes split at {n_first})")


def test_tree_pass_refuses_a_warm_state_init(model_dir):
    with tinyloop.Model(model_file(model_dir, "init-warm"), device=DEVICE) as model:
        with model.context() as ctx:
            ctx.append(PROMPT)
            with pytest.raises(tinyloop.UnsupportedError, match="warm"):
                tree_logits(ctx, [1, 2], [-1, 0], 1)


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_tree_tokens_are_plain_greedy_tokens(model_dir, name):
    config = case_config(name)
    depth = config["max_depth"]
    with tinyloop.Model(model_file(model_dir, name), device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=30, depth=depth, **GREEDY)
        refused = False
        for draft_depth in sorted({1, 2, depth}):
            for tree, budget in SHAPES:
                spec = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=draft_depth, tree=tree,
                                      tree_budget=budget, **GREEDY)
                label = f"{name}: draft depth {draft_depth}, tree {tree}, budget {budget}"
                assert spec.tokens == plain.tokens, label
                assert spec.stop_reason == "max_tokens", label
                assert 0 < spec.drafted_tokens and 0 <= spec.accepted_tokens <= spec.drafted_tokens, label
                refused |= spec.accepted_tokens < spec.drafted_tokens
                if draft_depth == depth and len(tree) == 1 and tree[0] == 1 and ON_CPU:
                    assert spec.accepted_tokens == spec.drafted_tokens, label   # the draft is the full pass
        assert refused, f"{name}: no draft was ever refused"


def test_wider_trees_keep_more_drafts_per_round(model_dir):
    """A draft refused at level 1 may still be kept as a sibling: on a random model at draft
    depth 1, (4, 1) keeps more tokens per verification than a chain of 2."""
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model:
        kept = {}
        for tree in ((1, 1), (4, 1)):
            r = model.generate(PROMPT, max_tokens=40, depth=5, draft_depth=1, tree=tree, **GREEDY)
            rounds = len(r.tokens) - r.accepted_tokens   # each round returns its kept drafts + 1
            kept[tree] = len(r.tokens) / rounds
        assert kept[(4, 1)] > kept[(1, 1)], kept


@pytest.mark.parametrize("name", ["base", "injection-concat", "huginn-q4", "sliding_window"])
def test_context_after_tree_rounds_is_a_linear_append(model_dir, name):
    """After a tree-speculative generation the context holds the prompt and the generated
    tokens but the last, with K/V as a linear append leaves them: appending the last token
    gives the logits of a fresh full pass over the whole sequence (and the oracle's)."""
    config = case_config(name)
    depth = config["max_depth"]
    path = model_file(model_dir, name)
    with tinyloop.Model(path, device=DEVICE) as model:
        with model.context() as ctx:
            spec = ctx.generate(PROMPT, max_tokens=20, depth=depth, draft_depth=1, tree=(3, 2, 1), **GREEDY)
            assert spec.accepted_tokens > 0
            sequence = PROMPT + spec.tokens
            assert len(ctx) == len(sequence) - 1
            cont = ctx.append([spec.tokens[-1]], depth=depth)
            extra = ctx.append([3], depth=depth)   # and one more plain step on top
        full = model.score_last_token(sequence, depth=depth)
        full_extra = model.score_last_token(sequence + [3], depth=depth)
    assert_close(cont, full.astype(np.float64), SAME, f"{name}: continued vs full pass")
    assert_close(extra, full_extra.astype(np.float64), SAME, f"{name}: one more step vs full pass")
    tolerance = TOLERANCES[arithmetic(config)] if ON_CPU else (1e-4, 2e-5)
    assert_close(cont, ReferenceModel.from_file(path).logits(sequence, depth)[-1], tolerance, f"{name}: oracle")


def test_streams_and_stops(model_dir):
    """A pull stream gives generate's tokens; a stop sequence inside a round's tokens and
    a stream closed early leave the context as plain decoding does."""
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model:
        options = dict(max_tokens=24, depth=5, draft_depth=2, tree=(2, 2, 1), **GREEDY)
        plain = model.generate(PROMPT, max_tokens=24, depth=5, **GREEDY)
        assert list(model.stream(PROMPT, **options)) == plain.tokens
        stop = plain.tokens[9:11]
        first = next(i for i in range(len(plain.tokens)) if plain.tokens[i:i + 2] == stop)
        for how in ("stop", "closed"):
            with model.context() as ctx:
                if how == "stop":
                    r = ctx.generate(PROMPT, stop=[stop], **options)
                    assert r.tokens == plain.tokens[:first + 2] and r.stop_reason == "stop_sequence"
                    kept = len(PROMPT) + len(r.tokens) - 1
                else:
                    stream = ctx.stream(PROMPT, **options)
                    got = [next(stream) for _ in range(5)]
                    assert got == plain.tokens[:5]
                    stream.close()
                    kept = len(PROMPT) + 5 - 1
                assert len(ctx) == kept, how
                logits = ctx.append([plain.tokens[kept - len(PROMPT)]], depth=5)
            full = model.score_last_token(PROMPT + plain.tokens[:kept - len(PROMPT) + 1], depth=5)
            assert_close(logits, full.astype(np.float64), SAME, how)


def _tree_call(model, widths, draft_depth=1, budget=0, **options):
    """tl_generate_tree_speculative through the ABI."""
    native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_generate_options *")
    native.lib.tl_generate_options_default(opts)
    opts.max_tokens, opts.depth, opts.temperature, opts.eos_token = 16, 5, 0.0, -2
    for key, value in options.items():
        setattr(opts, key, value)
    out = ffi.new("int32_t[]", 16)
    result = ffi.new("tl_generate_result *")
    native.lib.tl_generate_result_default(result)
    native.check(native.lib.tl_generate_tree_speculative(
        model._require_open(), ffi.new("int32_t[]", PROMPT), len(PROMPT), opts, draft_depth,
        ffi.new("int32_t[]", list(widths) or [0]), len(widths), budget, out, 16, result))
    return [out[i] for i in range(result.n_tokens)]


def test_abi_call_and_option_errors(model_dir):
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model:
        plain = model.generate(PROMPT, max_tokens=16, depth=5, **GREEDY)
        assert _tree_call(model, [3, 2, 1]) == plain.tokens
        bad = [
            (dict(widths=[]), "levels"),
            (dict(widths=[2] * 9), "levels"),
            (dict(widths=[2, 0, 1]), "widths\\[1\\] is 0"),
            (dict(widths=[9]), "tree_widths\\[0\\] is 9"),
            (dict(widths=[2], budget=64), "tree_budget 64"),
            (dict(widths=[2], budget=-1), "tree_budget -1"),
            (dict(widths=[2], draft_depth=0), "draft_depth is 0"),
            (dict(widths=[2], draft_depth=6), "deeper than the generation's depth"),
            (dict(widths=[2], n_draft=3), "n_draft 3"),
            (dict(widths=[2], draft_p_min=1.5), "draft_p_min 1.5"),
        ]
        for args, message in bad:
            with pytest.raises(tinyloop.InvalidArgumentError, match=message):
                _tree_call(model, **args)
        with pytest.raises(tinyloop.InvalidArgumentError, match="tree_widths is set but draft_depth is 0"):
            model.generate(PROMPT, tree=(2,), **GREEDY)
        for draft_depth in (0, 1):   # a budget without a tree would silently do nothing
            with pytest.raises(tinyloop.InvalidArgumentError, match="tree_budget 5 is set but tree_widths is not"):
                model.generate(PROMPT, draft_depth=draft_depth, tree_budget=5, **GREEDY)
        for width in (0, 9):
            with pytest.raises(ValueError, match="tree"):
                model.generate(PROMPT, draft_depth=1, tree=(2, width), **GREEDY)
        with pytest.raises(ValueError, match="levels"):
            model.generate(PROMPT, draft_depth=1, tree=(1,) * 9, **GREEDY)
    with tinyloop.Model(model_file(model_dir, "init-warm"), device=DEVICE) as model:
        with pytest.raises(tinyloop.UnsupportedError, match="warm"):
            model.generate(PROMPT, draft_depth=1, tree=(2,), **GREEDY)
    with tinyloop.Model(model_file(model_dir, "plain-llama"), device=DEVICE) as model:
        with pytest.raises(tinyloop.UnsupportedError, match="no loop"):
            model.generate(PROMPT, draft_depth=1, tree=(2,), **GREEDY)


@pytest.mark.skipif(not (default_model.MODELS_DIR / f"{DEFAULT_MODEL_NAME}.tinyloop").exists(),
                    reason="the shipped model is not in this checkout")
def test_shipped_model_tree_equals_greedy():
    """The trained model on real text: trees at draft depth 2 give the default depth's
    greedy tokens, and keep more than one token per verification."""
    with tinyloop.Model(default_model.packaged_model_path(), threads=2, device=DEVICE) as model:
        prompt = "The state of our union is strong, and"
        plain = model.generate(prompt, max_tokens=48, **GREEDY)
        for tree in ((2, 1), (3, 2, 1, 1)):
            spec = model.generate(prompt, max_tokens=48, draft_depth=2, tree=tree, **GREEDY)
            assert spec.tokens == plain.tokens, tree
            rounds = len(spec.tokens) - spec.accepted_tokens
            assert len(spec.tokens) / rounds > 1.5, (tree, spec.accepted_tokens)


def test_mode_from_config(tmp_path):
    """[modes.tree_speculative] through the CLI gives plain greedy decoding's tokens and
    reports its drafts; a bad shape is a config error naming the key; with speculative on
    too it is a conflict."""
    import textmodel
    from cli_run import last_json, run
    from tinyloop.config import ConfigError, load_config
    model_path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(model_path)
    plain = last_json(run("generate", model_path, "Hello", "--max-tokens", 12, "--temperature", 0, "--threads", 1,
                          "--json"))
    config = tmp_path / "tinyloop.toml"
    config.write_text("[sampling]\ntemperature = 0\n[modes.tree_speculative]\ndraft_depth = 1\nwidths = \"3, 2, 1\"\n")
    tree = last_json(run("generate", model_path, "Hello", "--max-tokens", 12, "--threads", 1, "--config", config,
                         "--json"))
    assert tree["mode"] == "tree_speculative" and tree["tokens"] == plain["tokens"]
    assert 0 <= tree["accepted_tokens"] <= tree["drafted_tokens"] and tree["drafted_tokens"] > 0
    for widths, problem in (('"2, 0"', "level 1"), ('""', "levels"), ('"1,1,1,1,1,1,1,1,1"', "levels"),
                            ('"2, x"', "level 1"), ('"2, \u00b2"', "level 1"), ("[3, 1]", "expected str")):
        config.write_text(f"[modes.tree_speculative]\nwidths = {widths}\n")
        with pytest.raises(ConfigError, match=f"modes.tree_speculative.widths: .*{problem}"):
            load_config(config)
    config.write_text("[modes.tree_speculative]\n[modes.speculative]\n")
    with pytest.raises(ConfigError, match="conflict"):
        load_config(config)


def test_benchmark_tool_runs_trees(tmp_path):
    """tools/bench/speculative.py --trees on a tiny model: a row per tree beside plain and
    linear drafts (the tool fails when any greedy run's tokens differ), greedy and sampled."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench" / "speculative.py"
    out = tmp_path / "report.json"
    args = [sys.executable, str(tool), "--model", str(path), "--threads", "1", "--new-tokens", "8", "--repeat", "1",
            "--drafts", "1:2", "--trees", "1:3x1,1:2x2x1:5", "--json", str(out)]
    subprocess.run(args, check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [row["config"] for row in rows] == ["plain", "draft depth 1, 2 drafts", "draft depth 1, tree 3x1",
                                               "draft depth 1, tree 2x2x1 budget 5"]
    assert all(0 <= row["acceptance"] <= 1 and row["tokens_per_full_pass"] >= 1 for row in rows[1:])
    subprocess.run(args + ["--temperature", "0.8"], check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["temperature"] == 0.8 and len(report["rows"]) == 4


@pytest.mark.parametrize("name", ["base", "huginn-q4"])
def test_tree_drafts_over_a_draft_vocabulary(tmp_path, name):
    """With a draft vocabulary the tree's candidates come from its tokens (their ids mapped
    back): a one-wide chain drafts exactly the linear drafts' tokens (the same kept counts,
    round by round), and every shape still gives plain greedy decoding's tokens."""
    from test_draft_vocab import with_frequencies
    path = with_frequencies(tmp_path, name, tied=False)
    depth = case_config(name)["max_depth"]
    with tinyloop.Model(path, device=DEVICE, draft_vocab=40) as model:
        assert model.info.draft_vocab == 40
        plain = model.generate(PROMPT, max_tokens=30, depth=depth, **GREEDY)
        for n in (1, 3):
            linear = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=2, n_draft=n, **GREEDY)
            chain = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=2, tree=(1,) * n, **GREEDY)
            assert chain.tokens == linear.tokens == plain.tokens, n
            assert (chain.accepted_tokens, chain.drafted_tokens) == (linear.accepted_tokens, linear.drafted_tokens), n
            assert chain.accepted_tokens > 0, n
        for tree in ((3,), (4, 2, 1)):
            spec = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=2, tree=tree, **GREEDY)
            assert spec.tokens == plain.tokens, tree


def test_full_context_and_small_chunks(model_dir):
    """A tree never writes past the context (it shrinks as the context fills, and the
    stream stops with context_full where plain decoding does), and never holds more rows
    than one pass (a 3-row prefill chunk caps it at 2 nodes); a 1-row chunk is refused."""
    path = model_file(model_dir, "base")
    with tinyloop.Model(path, device=DEVICE) as model:
        with model.context(max_seq_len=14) as ctx:
            plain = ctx.generate(PROMPT, max_tokens=30, depth=5, **GREEDY)
        with model.context(max_seq_len=14) as ctx:
            spec = ctx.generate(PROMPT, max_tokens=30, depth=5, draft_depth=1, tree=(4, 2, 1), **GREEDY)
            assert len(ctx) == 14
        assert spec.tokens == plain.tokens and spec.stop_reason == plain.stop_reason == "context_full"
        full = model.generate(PROMPT, max_tokens=30, depth=5, **GREEDY)
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=3) as model:
        spec = model.generate(PROMPT, max_tokens=30, depth=5, draft_depth=1, tree=(4, 2, 1), **GREEDY)
        assert spec.tokens == full.tokens
        rounds = len(spec.tokens) - spec.accepted_tokens
        assert spec.drafted_tokens <= 2 * rounds
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=1) as model:
        with pytest.raises(tinyloop.InvalidArgumentError, match="prefill chunk is 1 row"):
            model.generate(PROMPT, max_tokens=4, depth=5, draft_depth=1, tree=(2,), **GREEDY)


@pytest.mark.parametrize("tree,sampling,p_min", [((3,), "plain", 0.0), ((2, 2), "plain", 0.0),
                                                 ((3, 1), "truncated, penalized", 0.0),
                                                 ((4,), "truncated, penalized", 0.0), ((3, 1), "plain", 0.1)])
def test_sampled_tree_tokens_follow_plain_sampling(model_dir, tree, sampling, p_min):
    """Multi-candidate speculative sampling: the first generated token comes from the
    prefill, the second is the first round's (a kept child of the root, judged one by one
    against p and then its residuals, or a draw from the last residual) and the third the
    next level's or the next round's. Their counts over many seeds must fit the exact
    full-depth distributions (the second token's marginal over the first; the third's
    after the most frequent first token), far from the draft depth's. With draft_p_min the
    number of draws per node depends on q alone, which keeps them fair."""
    from test_speculative import SAMPLING, check_follows_plain_sampling
    config = case_config("base")
    depth = config["max_depth"]
    options, n_runs = SAMPLING[sampling], 6000
    with tinyloop.Model(model_file(model_dir, "base"), device=DEVICE) as model:
        results = [model.generate(PROMPT, seed=seed, draft_depth=1, tree=tree, max_tokens=4, depth=depth, eos=False,
                                  draft_p_min=p_min, **options) for seed in range(n_runs)]
        runs = np.array([r.tokens for r in results])
        kept = sum(r.accepted_tokens for r in results)
        assert 0 < kept < sum(r.drafted_tokens for r in results)
        check_follows_plain_sampling(model, PROMPT, runs, depth, options, f"{tree} {sampling} p_min {p_min}, ")


def test_sampled_trees_are_seeded_and_leave_the_context_as_plain_decoding(model_dir):
    name = "huginn-q4"
    depth = case_config(name)["max_depth"]
    options = dict(max_tokens=20, depth=depth, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02,
                   repetition_penalty=1.2, eos=False, draft_depth=1, tree=(3, 2, 1))
    with tinyloop.Model(model_file(model_dir, name), device=DEVICE) as model:
        a = check_seeded(model, options)
        with model.context() as ctx:
            tokens = ctx.generate(PROMPT, seed=7, **options).tokens
            assert tokens == a.tokens and len(ctx) == len(PROMPT) + len(tokens) - 1
            follow = ctx.append([7])
        with model.context() as fresh:
            fresh.append(PROMPT + tokens[:-1], depth=depth)
            expected = fresh.append([7])
        np.testing.assert_allclose(follow, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_unsure_candidates_are_not_drafted(tmp_path, draft_vocab):
    """draft_p_min on a tree: a candidate less likely than it (by the draft's softmax;
    sampling, by q) is not drafted, and a branch with none ends. A one-wide chain with it
    is linear drafting with it (the same drafts, kept counts and tokens, greedy and
    sampled); a wide tree drafts fewer nodes than without it; the tokens stay plain
    greedy decoding's."""
    from test_draft_vocab import with_frequencies
    name = "base"
    path = with_frequencies(tmp_path, name, tied=False)
    depth = case_config(name)["max_depth"]
    with tinyloop.Model(path, device=DEVICE, draft_vocab=draft_vocab) as model:
        plain = model.generate(PROMPT, max_tokens=30, depth=depth, **GREEDY)
        for sampled in (dict(**GREEDY), dict(temperature=0.9, eos=False, seed=4)):
            linear = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=1, n_draft=3, draft_p_min=0.3,
                                    **sampled)
            chain = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=1, tree=(1, 1, 1),
                                   draft_p_min=0.3, **sampled)
            assert chain.tokens == linear.tokens, sampled
            assert (chain.accepted_tokens, chain.drafted_tokens) == (linear.accepted_tokens, linear.drafted_tokens)
        everything = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=1, tree=(4, 2, 1), **GREEDY)
        sure = model.generate(PROMPT, max_tokens=30, depth=depth, draft_depth=1, tree=(4, 2, 1), draft_p_min=0.2,
                              **GREEDY)
        assert sure.tokens == everything.tokens == plain.tokens
        assert 0 < sure.drafted_tokens < everything.drafted_tokens
