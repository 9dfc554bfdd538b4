"""The looped families end to end on tiny random checkpoints in their exact HF layout
(tests/looped_checkpoints.py): Huginn (bf16, one file), Ouro (f32, two shards), Nanbeige
(bf16, three shards), converted with `tinyloop convert`.

Checked for each family: a second oracle written from the families' reference code on the
raw checkpoint tensors (tests/looped_oracle.py) agrees with the float64 oracle on the
converted file (so the mapping is right); the CPU runtime agrees with that oracle at two
depths for f32, the checkpoint's own dtype, q4 and q2 (quantized: on the same dequantized
weights, within 1e-4 with float arithmetic, within parity's quantized tolerance as stored);
cached decode equals full scoring; generate and stream give the oracle's greedy tokens; the
KV policies apply; Ouro's exit gate and the loop defaults, metadata and refusals of bad
checkpoints. Also the model options these families brought (post-loop norm, no final norm,
exit gate, truncated noise) on random .tinyloop models."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import looped_oracle as oracle
import tinyloop
from looped_checkpoints import (huginn_checkpoint, nanbeige_checkpoint, ouro_checkpoint, read_checkpoint,
                                write_weights)
from reference import ReferenceModel
from reference.noise import truncated_seeded_normal
from reference.ops import exit_distribution, log_softmax, next_token_logprobs
from tinyloop.convert.cli_entry import main_convert
from tinyloop.convert.from_nanbeige import convert_nanbeige
from tinyloop.convert.looped import convert_looped
from tinyloop.errors import FormatError, UnsupportedError
from tinyloop.fileformat.tinyloop_file import TinyLoopWriter, read_file
from tinyloop.fileformat.random_model import make_random_model

TOKENS = np.array([5, 9, 17, 30, 2, 44, 60, 7, 11, 80, 23, 64], dtype=np.int32)
# two depths each: 1 and the checkpoint's default
DEPTHS = {"huginn": (1, 4), "ouro": (1, 3), "nanbeige": (1, 2)}
MAKERS = {"huginn": huginn_checkpoint, "ouro": ouro_checkpoint, "nanbeige": nanbeige_checkpoint}
FAMILIES = list(MAKERS)
FLOAT_TOLERANCE = 1e-4
QUANTIZED_STORED = (1e-3, 1e-4)      # docs/testing.md: backend vs oracle, quantized matrices
SAME_BACKEND = 2e-5                  # cached decode vs one-shot scoring


def oracle_logits(family, directory, tokens, depth):
    if family == "huginn":
        return oracle.huginn_logits(directory, tokens, depth)
    if family == "ouro":
        return oracle.ouro_forward(directory, tokens, depth)[0]
    return oracle.nanbeige_logits(directory, tokens, depth)


def convert(src, out, *args) -> Path:
    assert main_convert([str(src), "-o", str(out), "--no-progress", *args]) == 0
    return Path(out)


class Files:
    """Checkpoints and their conversions, each made once per module."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._made = {}

    def checkpoint(self, family, **overrides) -> Path:
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in self._made:
            self._made[key] = MAKERS[family](self.directory / f"{family}-{len(self._made)}", **overrides)
        return self._made[key]

    def converted(self, family, target, **overrides) -> Path:
        """The checkpoint (made with `overrides`) converted with --dtype target."""
        key = (family, target, json.dumps(overrides, sort_keys=True))
        if key not in self._made:
            args = ["--dtype", target, "--max-depth", "6"]
            if target in ("q8", "q4", "q2"):
                args += ["--group-size", "32", "--embed-dtype", "keep"]
            out = self.directory / f"{family}-{target}-{len(self._made)}.tinyloop"
            self._made[key] = convert(self.checkpoint(family, **overrides), out, *args)
        return self._made[key]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return Files(tmp_path_factory.mktemp("looped"))


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# ---------------------------------------------------------------- the mapping

@pytest.mark.parametrize("family", FAMILIES)
def test_second_oracle_on_the_raw_checkpoint_agrees_with_the_reference(files, family):
    src, path = files.checkpoint(family), files.converted(family, "f32")
    reference = ReferenceModel.from_file(path)
    for depth in DEPTHS[family]:
        err = max_error(reference.logits(TOKENS, depth), oracle_logits(family, src, TOKENS, depth))
        # Huginn's oracle reads the stored float32 RoPE table, the reference computes it
        assert err <= 1e-6, f"{family} depth {depth}: logits differ by {err:.3g}"


@pytest.mark.parametrize("variant", ["huginn-untied-adapter-bias", "ouro-tied", "nanbeige-final-norm-once",
                                     "nanbeige-loss-weights", "huginn-no-qk-bias"])
def test_variants_of_the_configs_map_exactly(files, variant):
    family, overrides = {
        "huginn-untied-adapter-bias": ("huginn", dict(tie_embeddings=False, bias=True)),
        "huginn-no-qk-bias": ("huginn", dict(qk_bias=False)),
        "ouro-tied": ("ouro", dict(tie_word_embeddings=True)),
        "nanbeige-final-norm-once": ("nanbeige", dict(skip_loop_final_norm=True)),
        "nanbeige-loss-weights": ("nanbeige", dict(loop_loss_weights=[0.2, 0.3])),
    }[variant]
    src, path = files.checkpoint(family, **overrides), files.converted(family, "f32", **overrides)
    reference = ReferenceModel.from_file(path)
    depth = reference.config.default_depth
    assert max_error(reference.logits(TOKENS, depth), oracle_logits(family, src, TOKENS, depth)) <= 1e-6
    with tinyloop.Model(path) as model:
        assert max_error(model.score(TOKENS, depth), reference.logprobs(TOKENS, depth)) <= FLOAT_TOLERANCE
    if variant == "nanbeige-loss-weights":
        assert depth == 3          # len(loop_loss_weights) + 1 wins over num_loops
    if variant == "ouro-tied":
        assert "output.weight" not in read_file(path).tensors


def test_f16_checkpoints_keep_their_dtype(files):
    path = files.converted("ouro", "keep", dtype="F16")
    with read_file(path) as f:
        assert f.tensors["core.1.mlp.down.weight"].dtype == "f16" and f.metadata["general.source_dtype"] == "f16"
    reference = ReferenceModel.from_file(path)
    src = files.checkpoint("ouro", dtype="F16")
    assert max_error(reference.logits(TOKENS, 3), oracle_logits("ouro", src, TOKENS, 3)) <= 1e-6
    with tinyloop.Model(path) as model:
        assert max_error(model.score(TOKENS, 3), reference.logprobs(TOKENS, 3)) <= FLOAT_TOLERANCE


def test_checkpoint_layouts_are_the_real_ones(files):
    """The generator writes the families' real names: sharded with an index, bf16."""
    ouro = files.checkpoint("ouro")
    index = json.loads((ouro / "model.safetensors.index.json").read_text())
    assert "model.layers.1.post_attention_layernorm_2.weight" in index["weight_map"]
    assert "model.early_exit_gate.bias" in index["weight_map"]
    huginn = read_checkpoint(files.checkpoint("huginn"))
    assert {"transformer.core_block.1.attn.Wqkv.weight", "transformer.adapter.weight",
            "transformer.ln_f.weight", "freqs_cis", "transformer.prelude.0.attn.qk_bias"} <= set(huginn)
    assert len(list(files.checkpoint("nanbeige").glob("model-0000*-of-00003.safetensors"))) == 3


# ---------------------------------------------------------------- the runtime against the oracle

@pytest.mark.parametrize("dtype", ["f32", "keep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_matches_the_reference_in_float(files, family, dtype):
    path = files.converted(family, dtype)
    reference = ReferenceModel.from_file(path)
    with tinyloop.Model(path) as model:
        for depth in DEPTHS[family]:
            err = max_error(model.score(TOKENS, depth), reference.logprobs(TOKENS, depth))
            assert err <= FLOAT_TOLERANCE, f"{family} {dtype} depth {depth}: log-probs differ by {err:.3g}"


@pytest.mark.parametrize("dtype", ["q4", "q2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_matches_the_reference_on_the_dequantized_weights(files, family, dtype):
    path = files.converted(family, dtype)
    with read_file(path) as f:
        assert f.tensors["core.0.attn.q.weight"].dtype == dtype
    reference = ReferenceModel.from_file(path)
    # float arithmetic on the loop body (decoded at load): the importer's weights exactly
    with tinyloop.Model(path, body_dtype="f32") as model:
        for depth in DEPTHS[family]:
            err = max_error(model.score(TOKENS, depth), reference.logprobs(TOKENS, depth))
            assert err <= FLOAT_TOLERANCE, f"{family} {dtype} f32 body depth {depth}: {err:.3g}"
    # as stored: activations rounded to int16 before each quantized matrix (docs/testing.md)
    atol, rtol = QUANTIZED_STORED
    with tinyloop.Model(path) as model:
        for depth in DEPTHS[family]:
            expected = reference.logprobs(TOKENS, depth)
            err = np.abs(model.score(TOKENS, depth) - expected)
            assert np.all(err <= atol + rtol * np.abs(expected)), f"{family} {dtype} depth {depth}: {err.max():.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_full_scoring(files, family):
    path = files.converted(family, "f32")
    depth = DEPTHS[family][1]
    with tinyloop.Model(path) as model:
        full = model.score(TOKENS, depth)
        with model.context() as ctx:
            rows = [ctx.append(TOKENS[:1], depth=depth)]
            rows += [ctx.append(TOKENS[i:i + 1]) for i in range(1, len(TOKENS) - 1)]
    stepped = log_softmax(np.array(rows, dtype=np.float64))[np.arange(len(TOKENS) - 1), TOKENS[1:]]
    assert max_error(stepped, full) <= SAME_BACKEND


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_and_stream_give_the_oracles_greedy_tokens(files, family):
    path = files.converted(family, "f32")
    reference = ReferenceModel.from_file(path)
    prompt = TOKENS[:5].tolist()
    expected = list(prompt)
    for _ in range(6):
        expected.append(int(np.argmax(reference.logits(expected)[-1])))
    with tinyloop.Model(path) as model:
        result = model.generate(prompt, max_tokens=6, temperature=0.0, eos=False)
        streamed = list(model.stream(prompt, max_tokens=6, temperature=0.0, eos=False))
        text = model.generate("w1 w2 w3", max_tokens=3, temperature=0.0, eos=False)
    assert result.tokens == expected[5:] == streamed
    assert len(text.tokens) == 3 and isinstance(text.text, str)


# ---------------------------------------------------------------- metadata and loop defaults

def test_the_files_record_family_depth_tokenizer_and_exit_rule(files):
    expect = {"huginn": (4, 1, "config.json mean_recurrence = 4"),
              "ouro": (3, 3, "config.json total_ut_steps = 3"),
              "nanbeige": (2, 3, "config.json num_loops = 2")}
    for family, (depth, eos, source) in expect.items():
        with read_file(files.converted(family, "keep")) as f:
            meta = f.metadata
            assert f.dims["default_depth"] == depth and f.dims["max_depth"] == 6
            assert meta["general.family"] == family and meta["general.default_depth_from"] == source
            assert meta["tokenizer.eos_id"] == eos          # generation_config.json's first
            assert "im_start" in meta["tokenizer.chat_template"]
    with read_file(files.converted("ouro", "keep")) as f:
        assert f.metadata["loop.exit_rule"] == "cdf_threshold" and f.metadata["loop.exit_threshold"] == 1.0
        assert f.tensors["exit_gate.weight"].dtype == "f32" and "final_norm.weight" not in f.tensors
    with read_file(files.converted("huginn", "keep")) as f:
        assert f.metadata["loop.state_init"] == "zeros" and f.metadata["general.source_dtype"] == "bf16,f32"
        assert f.tensors["embed.weight"].dtype == "bf16"
        assert bytes(f.raw("post_loop_norm.weight")) == bytes(f.raw("final_norm.weight"))


def test_python_api_converts_with_quantization(files, tmp_path):
    out = tmp_path / "ouro-q8.tinyloop"
    summary = convert_looped(files.checkpoint("ouro"), out, dtype="q8", group_size=64, show_progress=False)
    assert summary["family"] == "ouro" and summary["tensors"]["q8"] > 0
    with tinyloop.Model(out) as model:
        assert np.all(np.isfinite(model.score(TOKENS)))


# ---------------------------------------------------------------- Ouro's exit gate

def test_ouro_exit_gate_matches_the_second_oracle(files):
    src, path = files.checkpoint("ouro"), files.converted("ouro", "f32")
    steps = 3
    _, lam = oracle.ouro_forward(src, TOKENS, steps)
    p, cdf = oracle.ouro_exit_cdf(lam)
    with tinyloop.Model(path) as model:
        gate = model.score_exit_gate(TOKENS, steps)
        with model.context() as ctx:
            assert max_error(ctx.score_exit_gate(TOKENS, steps).lam, gate.lam) == 0.0
            assert len(ctx) == 0
    assert gate.lam.shape == (len(TOKENS), steps)
    assert max_error(gate.lam, lam) <= 1e-5 and max_error(gate.p, p) <= 1e-5 and max_error(gate.cdf, cdf) <= 1e-5
    assert max_error(ReferenceModel.from_file(path).exit_gate(TOKENS, steps), lam) <= 1e-9
    assert max_error(exit_distribution(lam)[1], cdf) <= 1e-12
    # the file's rule (threshold 1.0): the last step, unless a CDF reaches 1 exactly
    assert gate.exit_steps().tolist() == [steps] * len(TOKENS)
    first = np.argmax(np.concatenate([cdf[:, :-1] >= 0.5, np.ones((len(TOKENS), 1), bool)], axis=1), axis=1) + 1
    assert gate.exit_steps(0.5).tolist() == first.tolist()


def test_exit_gate_refusals(files):
    with tinyloop.Model(files.converted("nanbeige", "f32")) as model:
        with pytest.raises(UnsupportedError, match="no exit gate"):
            model.score_exit_gate(TOKENS)


# ---------------------------------------------------------------- Huginn's noise init

def test_huginn_noise_init_is_the_truncated_seeded_normal(files, tmp_path):
    out = convert(files.checkpoint("huginn"), tmp_path / "noise.tinyloop", "--dtype", "f32",
                  "--state-init", "noise", "--noise-seed", "7")
    with read_file(out) as f:
        assert f.metadata["loop.noise_truncation"] == 3.0 and f.metadata["loop.noise_seed"] == 7
        assert abs(f.metadata["loop.noise_sigma"] - np.sqrt(2 / 5)) < 1e-12
    reference = ReferenceModel.from_file(out)
    with tinyloop.Model(out) as model:
        for depth in DEPTHS["huginn"]:
            assert max_error(model.score(TOKENS, depth), reference.logprobs(TOKENS, depth)) <= FLOAT_TOLERANCE


def test_truncated_noise_values_equal_the_reference(tmp_path):
    """A model whose logits are the state init itself (no blocks, no final norm, an identity
    head), with a truncation that redraws most values."""
    d, seed, limit = 64, 99, 0.5
    writer = TinyLoopWriter(dict(vocab_size=d, d_model=d, n_head=1, n_kv_head=1, head_dim=d, ffn_dim=d,
                                 n_pre=0, n_core=0, n_post=0, default_depth=0, max_depth=0, max_seq_len=16))
    for key, value in (("arch.final_norm", 0), ("arch.tied_embeddings", 0), ("loop.state_init", "noise"),
                       ("loop.noise_seed", seed), ("loop.noise_truncation", limit), ("loop.noise_sigma", 1.0)):
        writer.add_metadata(key, value)
    writer.add_tensor("embed.weight", np.zeros((d, d), np.float32))
    writer.add_tensor("output.weight", np.eye(d, dtype=np.float32))
    writer.write(tmp_path / "noise.tinyloop")
    with tinyloop.Model(tmp_path / "noise.tinyloop") as model:
        for n in (1, 5):
            got = model.score_last_token(np.zeros(n, np.int32))
            expected = truncated_seeded_normal(seed, n - 1, d, limit)
            assert max_error(got, expected) <= 1e-6 and np.all(np.abs(got) <= limit)


# ---------------------------------------------------------------- KV cost and policies

@pytest.mark.parametrize("family", FAMILIES)
def test_kv_policies_apply(files, family):
    path = files.converted(family, "f32")
    reference = ReferenceModel.from_file(path)
    depth = DEPTHS[family][1]
    for options, ring in ((dict(kv_policy="share_last"), 1), (dict(kv_policy="ring", kv_ring_slots=2), 2)):
        with tinyloop.Model(path, prefill_chunk=4, **options) as model:
            scored = model.score(TOKENS, depth)
            with model.context() as ctx:
                rows = [ctx.append(TOKENS[:6], depth=depth)] + [ctx.append(TOKENS[i:i + 1]) for i in range(6, 12)]
        want = next_token_logprobs(reference.logits(TOKENS, depth, kv_ring=ring, calls=[4, 4, 4]), TOKENS)
        assert max_error(scored, want) <= FLOAT_TOLERANCE
        stepped = reference.logits(TOKENS, depth, kv_ring=ring, calls=[4, 2, 1, 1, 1, 1, 1, 1])
        assert max_error(np.array(rows), stepped[5:]) <= FLOAT_TOLERANCE
    exact = reference.logits(TOKENS, depth)
    assert max_error(reference.logits(TOKENS, depth, kv_ring=1, calls=[4, 4, 4]), exact) > 1e-3


def test_info_shows_the_kv_cost_per_token(files, capsys):
    from tinyloop.cli import main

    assert main(["info", str(files.converted("huginn", "keep")), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["depth"]: row for row in payload["kv_per_token"]}
    # 1 prelude + depth x 2 core + 1 coda slots of keys and values, 64 floats each
    assert rows[4]["slots"] == 10 and rows[4]["bytes_per_token"] == 10 * 2 * 64 * 4
    assert rows[6]["share_last_bytes_per_token"] == 4 * 2 * 64 * 4
    assert main(["info", str(files.converted("nanbeige", "keep"))]) == 0
    assert "kv cache:     depth 2: 4 slots, 2.0 KiB per token" in capsys.readouterr().out


# ---------------------------------------------------------------- bad checkpoints

def _copy(files, family, tmp_path) -> Path:
    return Path(shutil.copytree(files.checkpoint(family), tmp_path / family))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


_DROP = object()


def _fails(src, tmp_path, *args) -> str:
    with pytest.raises((FormatError, ValueError)) as info:
        convert_looped(src, tmp_path / "out.tinyloop", show_progress=False, **dict(args))
    assert not (tmp_path / "out.tinyloop").exists()
    return str(info.value)


@pytest.mark.parametrize("family, key, value, words", [
    ("huginn", "injection_type", "add", "injection_type"),
    ("huginn", "test_time_noise", 0.1, "test_time_noise"),
    ("huginn", "num_key_value_heads", 2, "grouped-query"),
    ("ouro", "use_sliding_window", True, "use_sliding_window"),
    ("ouro", "rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),
    ("ouro", "early_exit_step", 1, "early_exit_step"),
    ("nanbeige", "qk_layernorm", True, "qk_layernorm"),
    ("nanbeige", "emb_neighbor_num", 2, "n-gram"),
    ("nanbeige", "enable_double_loop_split", True, "LoopSplit"),
    ("nanbeige", "loop_share_kv", True, "loop_share_kv"),
    ("nanbeige", "attention_bias", True, "attention_bias"),
    ("nanbeige", "rope_scaling", {"type": "dynamic", "factor": 4.0}, "rope_scaling"),
    ("nanbeige", "mystery_option", 3, "unknown Nanbeige config keys ['mystery_option']"),
])
def test_options_that_change_the_function_are_refused_by_name(files, tmp_path, family, key, value, words):
    src = _copy(files, family, tmp_path)
    _edit_config(src, **{key: value})
    message = _fails(src, tmp_path)
    assert words in message and "config.json" in message


def test_an_unknown_key_can_be_ignored_by_name(files, tmp_path):
    src = _copy(files, "ouro", tmp_path)
    _edit_config(src, harmless_note="x")
    assert "harmless_note" in _fails(src, tmp_path)
    out = tmp_path / "ok.tinyloop"
    assert main_convert([str(src), "-o", str(out), "--no-progress", "--ignore-config-key", "harmless_note"]) == 0


def test_bad_checkpoints_name_the_file_and_key(files, tmp_path, capsys):
    ouro = _copy(files, "ouro", tmp_path)
    (ouro / "model-00002-of-00002.safetensors").unlink()
    message = _fails(ouro, tmp_path)
    assert "model-00002-of-00002.safetensors is missing" in message and "model.safetensors.index.json" in message

    huginn = _copy(files, "huginn", tmp_path)
    _edit_config(huginn, rope_base=_DROP)
    assert "required key 'rope_base' is missing" in _fails(huginn, tmp_path)
    # the CLI: exit status 1 and the message on stderr
    assert main_convert([str(huginn), "-o", str(tmp_path / "x.tinyloop"), "--no-progress"]) == 1
    assert "rope_base" in capsys.readouterr().err

    nanbeige = Path(nanbeige_checkpoint(tmp_path / "nb", shards=1))
    tensors = read_checkpoint(nanbeige)
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :64]
    write_weights(nanbeige, tensors, "BF16")
    message = _fails(nanbeige, tmp_path)
    assert "model.safetensors" in message and "'model.layers.1.mlp.down_proj.weight' has shape [64, 64]" in message

    tensors = read_checkpoint(nanbeige_checkpoint(tmp_path / "nb2", shards=1))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(32)
    write_weights(tmp_path / "nb2", tensors, "BF16")
    assert "'model.layers.0.self_attn.q_norm.weight' has no place in a Nanbeige model" in _fails(tmp_path / "nb2", tmp_path)

    with pytest.raises(FormatError, match="model_type 'ouro' is not 'nanbeige'"):
        convert_nanbeige(files.checkpoint("ouro"), tmp_path / "y.tinyloop")


# ---------------------------------------------------------------- the new model options

OPTION_CASES = {
    "post-norm-layernorm": dict(post_norm=1, norm_type="layernorm", injection="concat", n_post=2),
    "no-final-norm-loop-norm": dict(final_norm=0, loop_norm=1, n_pre=0, n_post=0, tied_embeddings=0),
    "exit-gate-branch-q4": dict(exit_gate=1, loop_norm=1, final_norm=0, norm_placement="sandwich_branch",
                                dtype="q4", group_size=32),
    "post-norm-truncated-noise": dict(post_norm=1, state_init="noise", noise_sigma=0.6, noise_truncation=2.0,
                                      noise_seed=5, norm_placement="sandwich_outer"),
    "post-norm-warm-gate": dict(post_norm=1, state_init="warm", exit_gate=1),
}
BASE = dict(seed=3, vocab_size=64, d_model=64, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128, n_pre=1,
            n_core=1, n_post=1, default_depth=2, max_depth=4, max_seq_len=32)


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_new_model_options_match_the_reference(tmp_path, case):
    config = {**BASE, **OPTION_CASES[case]}
    path = tmp_path / f"{case}.tinyloop"
    make_random_model(path, **config)
    quantized = config.get("dtype") == "q4"
    reference = ReferenceModel.from_file(path)
    tolerance = QUANTIZED_STORED[0] if quantized else FLOAT_TOLERANCE
    with tinyloop.Model(path) as model:
        for depth in (1, 4):
            assert max_error(model.score(TOKENS[:10] % 64, depth), reference.logprobs(TOKENS[:10] % 64, depth)) <= tolerance
            full = model.score_last_token(TOKENS[:10] % 64, depth)
            with model.context() as ctx:
                ctx.append(TOKENS[:6] % 64, depth=depth)
                for t in TOKENS[6:9] % 64:
                    ctx.append([t])
                assert max_error(ctx.append([TOKENS[9] % 64]), full) <= SAME_BACKEND
        if config.get("state_init") == "warm":
            with pytest.raises(UnsupportedError, match="warm"):
                model.score_exit_gate(TOKENS[:10] % 64)
        elif config.get("exit_gate"):
            lam = model.score_exit_gate(TOKENS[:10] % 64, 4).lam
            assert max_error(lam, reference.exit_gate(TOKENS[:10] % 64, 4)) <= 1e-3


def test_lazy_tensors_are_made_only_while_writing(tmp_path):
    made = []
    dims = {k: v for k, v in BASE.items() if k != "seed"}
    writer = TinyLoopWriter(dict(dims, n_pre=0, n_core=0, n_post=0, default_depth=0, max_depth=0))
    writer.add_lazy_tensor("embed.weight", "f16", (64, 64), lambda: made.append(1) or np.ones((64, 64)))
    writer.add_lazy_tensor("final_norm.weight", "f32", (64,), lambda: np.ones(64, np.float32).tobytes())
    assert made == []
    writer.write(tmp_path / "lazy.tinyloop")
    assert made == [1]
    with read_file(tmp_path / "lazy.tinyloop") as f:
        assert np.all(f.tensor("embed.weight") == 1.0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
