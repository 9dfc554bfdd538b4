"""tools/train/token_frequency.py and tinyloop.format.copy_file: a copy with the training
text's token frequencies (vocab.frequency) and draft.vocab_size, everything else unchanged.

The output is checked with tinyloop.format's reader only: the library need not load it."""

import numpy as np
import pytest

from tinyloop.errors import FormatError
from tinyloop.fileformat.random_model import make_random_model
from tinyloop.fileformat.tinyloop_file import copy_file, read_file
from tool_module import load_tool

VOCAB = 64
DIMS = dict(vocab_size=VOCAB, d_model=32, n_head=4, n_kv_head=2, head_dim=8, ffn_dim=64,
            n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=4, max_seq_len=32)


@pytest.fixture(scope="module")
def tool():
    return load_tool("train/token_frequency.py", "token_frequency")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("freq") / "m.tinyloop"
    make_random_model(path, seed=3, dtype="f32", norm_eps=1e-5, **DIMS)
    return path


def token_file(path, ids, dtype="<u2"):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def frequency(f) -> np.ndarray:
    e = f.tensors["vocab.frequency"]
    assert (e.dtype, e.shape) == ("f32", (VOCAB,))
    return np.frombuffer(f.raw("vocab.frequency"), dtype="<f4")


def assert_rest_unchanged(a, b, tensor_names):
    for name in tensor_names:
        assert bytes(b.raw(name)) == bytes(a.raw(name)), name


# ------------------------------------------------------------------ token_frequency.py

def test_frequencies_are_counts_over_total_and_the_rest_is_unchanged(tool, model, tmp_path):
    rng = np.random.default_rng(0)
    # skewed ids, some never seen; two files are counted together
    first = rng.zipf(1.5, 5000) % VOCAB
    second = rng.integers(0, VOCAB // 2, 777)
    out = tmp_path / "f.tinyloop"
    line = tool.write_frequencies(model, out, [token_file(tmp_path / "a.u16", first),
                                               token_file(tmp_path / "b.u16", second)],
                                  draft_vocab=10)
    counts = np.bincount(np.concatenate([first, second]), minlength=VOCAB)
    want = (counts / counts.sum()).astype(np.float32)
    with read_file(model) as a, read_file(out, verify_checksums=True) as b:
        np.testing.assert_array_equal(frequency(b), want)
        assert b.dims == a.dims
        assert b.metadata == {**a.metadata, "draft.vocab_size": 10}
        assert list(b.tensors) == [*a.tensors, "vocab.frequency"]
        assert_rest_unchanged(a, b, a.tensors)
    top = np.sort(counts)[::-1][:10].sum() / counts.sum()
    assert line == (f"5777 tokens counted, {np.count_nonzero(counts)} of {VOCAB} distinct "
                    f"tokens seen; the top 10 cover {top:.2%} of them")


def test_command_line_clips_the_draft_vocab_and_reads_u32(tool, model, tmp_path, capsys):
    ids = token_file(tmp_path / "t.u32", [VOCAB - 1, 0, 0, 5], "<u4")
    out = tmp_path / "f.tinyloop"
    tool.main([str(model), str(out), "--tokens", str(ids), "--dtype", "u32"])   # default 8192
    assert "4 tokens counted, 3 of 64 distinct tokens seen; the top 64 cover 100.00%" \
        in capsys.readouterr().out
    with read_file(out) as b:
        assert b.metadata["draft.vocab_size"] == VOCAB
        np.testing.assert_array_equal(frequency(b)[[0, 5, VOCAB - 1, 1]], [0.5, 0.25, 0.25, 0])


def test_a_second_run_replaces_the_frequencies(tool, model, tmp_path):
    once, twice = tmp_path / "1.tinyloop", tmp_path / "2.tinyloop"
    tool.write_frequencies(model, once, [token_file(tmp_path / "a.u16", [1, 2, 3])], draft_vocab=3)
    tool.write_frequencies(once, twice, [token_file(tmp_path / "b.u16", [7, 7, 9, 9])],
                           draft_vocab=0)
    with read_file(once) as a, read_file(twice, verify_checksums=True) as b:
        assert list(b.tensors) == list(a.tensors)       # replaced in place, not added twice
        assert b.metadata == {**a.metadata, "draft.vocab_size": 0}
        want = np.zeros(VOCAB, np.float32)
        want[[7, 9]] = 0.5
        np.testing.assert_array_equal(frequency(b), want)
        assert_rest_unchanged(a, b, set(a.tensors) - {"vocab.frequency"})


def test_an_id_outside_the_vocabulary_is_refused(tool, model, tmp_path):
    good = token_file(tmp_path / "good.u16", [0, 1])
    bad = token_file(tmp_path / "bad.u16", [3, 4, 5, VOCAB, 2])
    out = tmp_path / "f.tinyloop"
    with pytest.raises(SystemExit, match=r"bad\.u16: token id 64 at position 3 is outside the "
                                         r"model's vocabulary 0\.\.63"):
        tool.write_frequencies(model, out, [good, bad])
    assert not out.exists()


def test_recommended_drafting_is_written_when_given(tool, model, tmp_path):
    ids = token_file(tmp_path / "t.u16", [1, 2, 3])
    out = tmp_path / "f.tinyloop"
    tool.main([str(model), str(out), "--tokens", str(ids), "--draft-depth", "2", "--n-draft", "3"])
    with read_file(out) as b:
        assert b.metadata["draft.depth"] == 2 and b.metadata["draft.n_draft"] == 3


@pytest.mark.parametrize("args, message", [
    (dict(draft_vocab=-1), r"--draft-vocab must be >= 0, got -1"),
    (dict(n_draft=33), r"--n-draft in 0\.\.32"),
    (dict(draft_depth=99), r"--draft-depth 99 is deeper than the file's max_depth"),
    (dict(dtype="u32"), r"size is not a whole number of u32 token ids"),   # 3 u16 = 6 bytes
])
def test_bad_arguments_are_refused(tool, model, tmp_path, args, message):
    ids = token_file(tmp_path / "t.u16", [1, 2, 3])
    with pytest.raises(SystemExit, match=message):
        tool.write_frequencies(model, tmp_path / "f.tinyloop", [ids], **args)


def test_writing_over_the_input_is_refused(tool, model, tmp_path):
    before = model.read_bytes()
    with pytest.raises(SystemExit, match="must differ from the input"):
        tool.write_frequencies(model, model, [token_file(tmp_path / "t.u16", [1])])
    assert model.read_bytes() == before


# ------------------------------------------------------------------ format.copy_file

def test_copy_file_overrides_dims_metadata_and_tensors(model, tmp_path):
    out = tmp_path / "c.tinyloop"
    norm = np.linspace(0.5, 1.5, DIMS["d_model"])
    extra = np.arange(6, dtype=np.int32).reshape(2, 3)      # an int array is stored as f32
    copy_file(model, out, dims={"default_depth": 4},
              metadata={"arch.norm_eps": 1e-6, "general.new": "yes"},
              tensors={"final_norm.weight": norm, "extra": extra})
    with read_file(model) as a, read_file(out, verify_checksums=True) as b:
        assert b.dims == {**a.dims, "default_depth": 4}
        assert list(b.metadata) == [*a.metadata, "general.new"]     # replaced keys keep place
        assert b.metadata == {**a.metadata, "arch.norm_eps": 1e-6, "general.new": "yes"}
        assert list(b.tensors) == [*a.tensors, "extra"]
        assert b.tensors["final_norm.weight"].dtype == b.tensors["extra"].dtype == "f32"
        np.testing.assert_array_equal(b.tensor("final_norm.weight"), norm.astype(np.float32))
        np.testing.assert_array_equal(b.tensor("extra"), extra)
        assert_rest_unchanged(a, b, set(a.tensors) - {"final_norm.weight"})


def test_copy_file_without_changes_is_a_byte_identical_file(model, tmp_path):
    copy_file(model, tmp_path / "same.tinyloop")
    assert (tmp_path / "same.tinyloop").read_bytes() == model.read_bytes()


def test_copy_file_refuses_its_input_and_bad_dims(model, tmp_path):
    with pytest.raises(FormatError, match="must differ from the input"):
        copy_file(model, model.parent / "." / model.name)
    with pytest.raises(FormatError, match="default_depth .* must be <= max_depth"):
        copy_file(model, tmp_path / "bad.tinyloop", dims={"default_depth": 9})
    assert not (tmp_path / "bad.tinyloop").exists()
