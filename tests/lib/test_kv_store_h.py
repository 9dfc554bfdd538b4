"""The store_h KV policy (docs/model.md, "The store_h KV policy"; TL_KV_STORE_H).

store_h keeps each core block's input per loop iteration and position instead of its K/V
and recomputes the K/V of earlier positions when a block attends. It computes the exact
policy's function, so it is held to the float64 oracle's exact pass on every parity case
with a loop (every architecture option and weight type), plus GQA with head_dim != d / h
and a post-loop norm, over a chunked prefill then token-by-token decoding, and to the
backend's exact cache within float rounding (f32 weights: 1e-5 on log-probs). Also:
greedy tokens, batched steps beside exact contexts, deepening, forks, adaptive depth,
speculative decoding, the memory it holds and reports, and the refused combinations (on CUDA:
the refusal by name)."""

import numpy as np
import pytest

import tinyloop
from test_kv_policy import CHUNK, PREFILL, assert_close, context_kv_bytes, decode_logits, oracle_checks
from test_parity import CASES, DEVICE, ON_CPU, SAME, TOLERANCES, ModelFiles, arithmetic, case_config, case_tokens
from reference import ReferenceModel
from reference.ops import next_token_logprobs
from tinyloop.errors import UnsupportedError
from tinyloop.fileformat.random_model import make_random_model

cpu_only = pytest.mark.skipif(not ON_CPU, reason="store_h runs on the CPU backend (refused elsewhere: below)")

LOOP_CASES = [name for name in CASES if case_config(name)["n_core"] > 0]
# shapes the parity cases do not have: head_dim != d / n_head under GQA, a post-loop norm
EXTRA = {"gqa-wide-heads": dict(n_head=4, n_kv_head=2, head_dim=24),
         "post_norm-huginn": dict(norm_placement="sandwich_outer", injection="concat", post_norm=1,
                                  n_pre=1, n_core=2, n_post=1, n_kv_head=1, head_dim=20)}
F32_LOGPROB = 1e-5   # store_h vs exact, same backend, f32 weights


def extra_config(name):
    return {**case_config("base"), **EXTRA[name]}


class _Files(ModelFiles):
    """The parity cases and EXTRA, written once per session."""

    def path(self, name):
        if name not in EXTRA:
            return super().path(name)
        path = self.directory / f"{name}.tinyloop"
        if not path.exists():
            make_random_model(path, **extra_config(name))
        return path

    def reference(self, name, int16_activations=False):
        if name not in EXTRA:
            return super().reference(name, int16_activations)
        return ReferenceModel.from_file(self.path(name), int16_activations)


@pytest.fixture(scope="module")
def all_files(files):
    return _Files(files.directory)


def config_of(name):
    return extra_config(name) if name in EXTRA else case_config(name)


@cpu_only
@pytest.mark.parametrize("name", LOOP_CASES + list(EXTRA))
def test_store_h_is_the_exact_pass(all_files, name):
    config = config_of(name)
    tokens = case_tokens(config)
    path = all_files.path(name)
    for depth in sorted({1, config["max_depth"]}):
        with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="store_h") as model, \
                tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK) as exact:
            logprobs = model.score(tokens, depth=depth)
            decoded = decode_logits(model, tokens, depth)
            exact_logprobs = exact.score(tokens, depth=depth)
            exact_decoded = decode_logits(exact, tokens, depth)
        float_weights = arithmetic(config) == "float"
        assert_close(logprobs, exact_logprobs.astype(np.float64), (F32_LOGPROB, 0) if float_weights else SAME,
                     f"{name} depth {depth}: store_h vs exact score")
        assert_close(decoded, exact_decoded.astype(np.float64), SAME, f"{name} depth {depth}: store_h vs exact decode")
        checks = oracle_checks(all_files, name) if name not in EXTRA else \
            [(all_files.reference(name), TOLERANCES["float"], "oracle")]
        for reference, tolerance, which in checks:
            expected = reference.logits(tokens, depth)
            label = f"{name} store_h depth {depth} vs {which}"
            assert_close(logprobs, next_token_logprobs(expected, tokens), tolerance, f"{label}: chunked score")
            assert_close(decoded, expected[PREFILL - 1:], tolerance, f"{label}: prefill then decode")
        # cached decode equals full scoring
        assert_close(next_token_logprobs(np.vstack([np.zeros((PREFILL - 1, decoded.shape[1])), decoded]),
                                         tokens)[PREFILL - 1:], logprobs[PREFILL - 1:].astype(np.float64), SAME,
                     f"{name} depth {depth}: store_h decode vs its score")


@cpu_only
@pytest.mark.parametrize("name", ["base", "huginn-q4", "init-warm", "post_norm-huginn"])
def test_greedy_tokens_and_batched_steps(all_files, name):
    config = config_of(name)
    tokens = case_tokens(config)
    prompt, depth, n_new = tokens[:5], config["max_depth"], 6
    path = all_files.path(name)
    with tinyloop.Model(path, device=DEVICE) as exact:
        expected = exact.generate(prompt, max_tokens=n_new, depth=depth, temperature=0, eos=False).tokens
    with tinyloop.Model(path, device=DEVICE, kv_policy="store_h") as model:
        assert model.generate(prompt, max_tokens=n_new, depth=depth, temperature=0, eos=False).tokens == expected
        assert list(model.stream(prompt, max_tokens=n_new, depth=depth, temperature=0, eos=False)) == expected
        batch = model.generate_batch([prompt, tokens[2:6]], max_tokens=n_new, depth=depth, temperature=0, eos=False)
        assert batch[0].tokens == expected
        # a batched step whose rows are a store_h and an exact context, against each alone
        with model.context() as a, model.context(kv_policy="exact") as b, model.context() as alone:
            a.append(tokens[:5], depth=depth)
            b.append(tokens[:3], depth=depth)
            alone.append(tokens[:5], depth=depth)
            rows = [model.append_batch([a, b], [t, t])[0] for t in tokens[5:9]]
            single = [alone.append([t]) for t in tokens[5:9]]
    assert_close(rows, np.array(single, dtype=np.float64), SAME, f"{name}: batched rows vs stepped alone")


@cpu_only
def test_deepen_fork_adaptive_depth_and_speculation(all_files):
    config = case_config("huginn-q4")
    tokens = case_tokens(config)
    top = config["max_depth"]
    path = all_files.path("huginn-q4")
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK, kv_policy="store_h") as model, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=CHUNK) as exact:
        with model.context(keep_loop_states=True) as ctx:
            ctx.append(tokens, depth=1)
            deeper = ctx.deepen(top)
            assert_close(deeper, decode_logits(exact, tokens, top)[-1].astype(np.float64), SAME, "deepen")
            with ctx.fork() as other:
                assert np.array_equal(other.append(tokens[:1]), ctx.append(tokens[:1]))
        given = np.array([1, 2, 3, 1, top, 2, 2, 3, 1, top, 3, 2], dtype=np.int32)[:len(tokens)]
        got, _ = model.score_with_depths(tokens, depth=top, given_depths=given)
        want, _ = exact.score_with_depths(tokens, depth=top, given_depths=given)
        assert_close(got, want.astype(np.float64), SAME, "given depths")
        plain = exact.generate(tokens[:4], max_tokens=8, depth=top, temperature=0, eos=False).tokens
        spec = model.generate(tokens[:4], max_tokens=8, depth=top, temperature=0, eos=False, draft_depth=1)
        assert spec.tokens == plain


@cpu_only
def test_memory_held_and_reported(all_files):
    for name in ("base", "huginn-q4"):
        config = case_config(name)
        kv_row = 2 * 4 * config["max_seq_len"] * config["n_kv_head"] * config["head_dim"]
        slots = config["n_pre"] + config["n_core"] + config["n_post"]
        inputs = 4 * config["max_seq_len"] * config["d_model"] * config["n_core"] * config["max_depth"]
        with tinyloop.Model(all_files.path(name), device=DEVICE, kv_policy="store_h") as model:
            assert context_kv_bytes(model) == kv_row * slots + inputs
            assert context_kv_bytes(model, kv_policy="exact") == \
                kv_row * (config["n_pre"] + config["max_depth"] * config["n_core"] + config["n_post"])
            report = model.kv_policy_report()
            assert report["kv_policy"] == "store_h"
            assert report["kv_bytes_per_token"] == (kv_row * slots + inputs) // config["max_seq_len"]
        with tinyloop.Model(all_files.path(name), device=DEVICE) as model:
            assert model.kv_policy_report()["kv_policy"] == "exact"


@cpu_only
def test_refused_combinations(all_files):
    path = all_files.path("base")
    tokens = case_tokens(case_config("base"))
    with pytest.raises(UnsupportedError, match="kv_policy store_h .* paged KV"):
        tinyloop.Model(path, device=DEVICE, kv_policy="store_h", kv_page_size=16)
    with tinyloop.Model(path, device=DEVICE, kv_page_size=16) as paged:
        with pytest.raises(UnsupportedError, match="kv_policy store_h .* paged KV"):
            paged.context(kv_policy="store_h")
    with tinyloop.Model(path, device=DEVICE, kv_policy="store_h") as model:
        with pytest.raises(UnsupportedError, match="tree speculation: kv_policy store_h"):
            model.generate(tokens[:4], max_tokens=4, temperature=0, draft_depth=1, tree=(2, 2))
        with pytest.raises(UnsupportedError, match="prefix caches .* store_h"):
            model.prefix_cache(tokens[:4])
        with model.context() as ctx:
            ctx.append(tokens[:4])
            with pytest.raises(UnsupportedError, match="prefix caches .* store_h"):
                ctx.prefix_cache()


@cpu_only
def test_toml_cli_and_info(all_files, capsys):
    """[modes.kv_share] policy = "store_h", `--kv-policy store_h` (over the config's ring)
    and what `tinyloop info` reports per token."""
    import json

    from tinyloop.cli import main
    from tinyloop.config import parse_config

    options = parse_config('[modes.kv_share]\npolicy = "store_h"\n').load_options()
    assert (options["kv_policy"], options["kv_ring_slots"]) == ("store_h", 0)
    config = case_config("base")
    path = all_files.path("base")
    toml = all_files.directory / "ring.toml"
    toml.write_text('[modes.kv_share]\npolicy = "ring"\nring_slots = 2\n')
    assert main(["info", str(path), "--json", "--config", str(toml), "--kv-policy", "store_h"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kv_slot = 2 * 4 * config["n_kv_head"] * config["head_dim"]
    inputs = 4 * config["d_model"] * config["n_core"] * config["max_depth"]
    assert payload["kv_policy"] == {"kv_policy": "store_h", "kv_bytes_per_token": 3 * kv_slot + inputs}
    top = {row["depth"]: row for row in payload["kv_per_token"]}[config["max_depth"]]
    assert top["store_h_bytes_per_token"] == 3 * kv_slot + inputs
    assert top["bytes_per_token"] == (2 + config["max_depth"]) * kv_slot
    assert main(["info", str(path), "--kv-policy", "store_h"]) == 0
    assert f"kv policy:    store_h, {(3 * kv_slot + inputs) / 1024:.1f} KiB per token" in capsys.readouterr().out


@cpu_only
def test_batched_streams_with_exit_rules(all_files):
    """A batched step whose rows stop at different iterations runs them in runs of rows:
    each store_h row recomputes its own sequence's K/V (the exact model's tokens and
    depths, streams stepped together, one row an exact context's)."""
    config = case_config("huginn-q4")
    tokens = case_tokens(config)
    depth = config["max_depth"]
    prompts = [tokens[:3], tokens[2:8], tokens[1:2], tokens[5:9]]
    rules = ["latent_delta:0.3", "fixed", "argmax_stable:2", "latent_delta:0.6"]
    path = all_files.path("huginn-q4")

    def stepped(model, policies):
        contexts = [model.context(kv_policy=p) for p in policies]
        streams = [ctx.stream(p, max_tokens=6, depth=depth, temperature=0, eos=False, exit=r)
                   for ctx, p, r in zip(contexts, prompts, rules)]
        got = [[] for _ in streams]
        for _ in range(6):
            for i, token in enumerate(model.next_batch(streams)):
                assert not isinstance(token, Exception), token
                if token is not None:
                    got[i].append(token)
        for s, ctx in zip(streams, contexts):
            s.close()
            ctx.close()
        return got

    with tinyloop.Model(path, device=DEVICE) as exact, \
            tinyloop.Model(path, device=DEVICE, kv_policy="store_h") as model:
        assert stepped(model, [None, None, "exact", None]) == stepped(exact, [None] * 4)


@cpu_only
def test_the_store_h_benchmark(tmp_path):
    """tools/bench/kv_store_h.py on its Huginn-shaped model: the two policies agree and
    store_h holds 0.55 of exact's KV bytes per token (8 K/V slots and 128 block inputs of
    256 floats against 132 slots of 2 x 256)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "store_h.json"
    script = Path(__file__).resolve().parents[2] / "tools" / "bench" / "kv_store_h.py"
    subprocess.run([sys.executable, str(script), "--models", "huginn-r32", "--prompt-tokens", "6", "--new-tokens",
                    "2", "--threads", "1", "--json", str(out)], check=True, timeout=300, capture_output=True)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["same_greedy_tokens"] and row["max_logprob_diff"] < 1e-4
    assert row["exact"]["kv_bytes_per_token"] == 132 * 2 * 256 * 4
    assert row["store_h"]["kv_bytes_per_token"] == (8 * 2 + 128) * 256 * 4


@cpu_only
def test_the_servers_prompt_cache_deepens_under_store_h(all_files):
    """The prompt cache keeps loop states under store_h (exact): a deeper request continues
    a cached prompt, and its logits are a fresh exact context's."""
    from tinyloop.prompt_cache import PromptCache
    tokens = case_tokens(case_config("base"))
    path = all_files.path("base")
    with tinyloop.Model(path, device=DEVICE, kv_policy="store_h") as model, \
            tinyloop.Model(path, device=DEVICE) as exact:
        cache = PromptCache(model, 2)
        lease = cache.acquire(tokens[:6].tolist(), 3)
        assert lease.sequence.keeps_loop_states
        lease.context.append(lease.rest, depth=3)
        cache.release(lease, tokens[:6].tolist())
        again = cache.acquire(tokens[:9].tolist(), 5)
        assert again.cached == 6 and again.sequence.depth == 5   # deepened
        got = again.context.append(again.rest)
        cache.release(again, tokens[:9].tolist())
        cache.close()
        with exact.context() as ctx:
            want = ctx.append(tokens[:9], depth=5)
    assert_close(got, want.astype(np.float64), SAME, "prompt cache deepened under store_h")


@cpu_only
def test_serve_on_ray_takes_the_policy_from_the_config(all_files, capsys):
    from tinyloop.cli import main
    assert main(["serve", str(all_files.path("base")), "--ray", "--kv-policy", "store_h"]) != 0
    assert "--kv-policy: not with --ray" in capsys.readouterr().err


@cpu_only
def test_logit_lens_and_escalation(all_files):
    """The logit lens and consistency escalation (which deepens a context keeping its loop
    states) under store_h are exact caching's."""
    tokens = case_tokens(case_config("huginn-q4"))
    path = all_files.path("huginn-q4")
    with tinyloop.Model(path, device=DEVICE, prefill_chunk=5, kv_policy="store_h") as model, \
            tinyloop.Model(path, device=DEVICE, prefill_chunk=5) as exact:
        assert_close(model.score_logit_lens(tokens), exact.score_logit_lens(tokens).astype(np.float64), SAME, "lens")
        got = model.score_with_consistency_escalation(tokens, min_depth=1, max_depth=5)
        want = exact.score_with_consistency_escalation(tokens, min_depth=1, max_depth=5)
        assert got[2] == want[2]
        assert_close(got[0], want[0].astype(np.float64), SAME, "escalation log-probs")


@pytest.mark.skipif(ON_CPU, reason="the refusal of a backend that replays recorded steps (CUDA)")
def test_a_recording_backend_refuses_store_h_by_name(all_files):
    path = all_files.path("base")
    with pytest.raises(UnsupportedError, match="kv_policy store_h: the .* backend replays recorded decode steps"):
        tinyloop.Model(path, device=DEVICE, kv_policy="store_h")
    with tinyloop.Model(path, device=DEVICE) as model:
        with pytest.raises(UnsupportedError, match="kv_policy store_h: the .* backend replays recorded"):
            model.context(kv_policy="store_h")
