"""tools/train/generate_text.py and train.py's synthetic mixing: the cached decode gives the
teacher's full-sequence logits, and mixed batches hold whole records in place of windows.
Needs PyTorch (the training tools' environment, tools/train/README.md); without it the
module is skipped with that reason."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the training tools' tests need it")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "train"))

from bench_generate import main as bench_main  # noqa: E402
from generate_text import (StopOnSigterm, Stopped, check_cache, main as generate_main,  # noqa: E402
                           sample_next, sample_records)
from layers import Dims  # noqa: E402
from teacher import Teacher  # noqa: E402
from train import SyntheticRecords, mix_synthetic  # noqa: E402


def tiny_teacher(seed: int) -> Teacher:
    torch.manual_seed(seed)
    dims = Dims(vocab=97, d=48, heads=6, kv_heads=2, head_dim=8, ffn=64, rope_theta=10000.0)
    model = Teacher(dims, n_layers=3)
    for p in model.parameters():  # norms away from 1 so a skipped norm shows
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.3)
    return model.eval()


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("prompt", [1, 5, 11])
def test_cached_decode_matches_full_pass(prompt, attention):
    teacher = tiny_teacher(prompt)
    tokens = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(prompt))
    assert check_cache(teacher, tokens, prompt, attention) < 1e-5


@pytest.mark.parametrize("sampler", ["race", "multinomial"])
def test_samplers_draw_from_the_tempered_softmax(sampler):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    for temperature in (1.0, 0.7):
        want = torch.softmax(logits / temperature, -1)
        draws = sample_next(logits.expand(40000, -1), temperature, torch.Generator().manual_seed(3), sampler)
        freq = torch.bincount(draws, minlength=5).double() / len(draws)
        sigma = (want * (1 - want) / len(draws)).sqrt()
        assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)
        assert freq[4] == 0


def test_bench_generate_times_every_path_and_names_one(tmp_path):
    choice, report = tmp_path / "choice.txt", tmp_path / "bench.json"
    assert bench_main(["--batch", "2", "--layers", "1", "--length", "16", "--position", "4", "--steps", "2",
                       "--device", "cpu", "--choice", str(choice), "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["rows"]
    assert {(r["attention"], r["sampler"]) for r in rows} == {(a, s) for a in ("sdpa", "matmul")
                                                              for s in ("race", "multinomial")}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert choice.read_text().strip() in ("sdpa", "matmul")
    assert json.loads(report.read_text())["sdpa_vs_matmul_rel_diff"] < 1e-5


def test_records_keep_their_prompts_and_reproduce():
    teacher = tiny_teacher(0)
    prompts = torch.randint(0, 97, (4, 3), generator=torch.Generator().manual_seed(1))
    a = sample_records(teacher, prompts, 10, 1.0, torch.Generator().manual_seed(7))
    b = sample_records(teacher, prompts, 10, 1.0, torch.Generator().manual_seed(7))
    assert a.shape == (4, 10) and torch.equal(a[:, :3], prompts) and torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 97


def test_mixed_batches_hold_whole_records(tmp_path):
    seq = 6
    records = np.arange(5 * (seq + 1), dtype=np.uint16) + 1000
    records.tofile(tmp_path / "s.u16")
    loaded = SyntheticRecords(f"{tmp_path / 's.u16'}", seq)
    assert loaded.shape == (5, seq + 1)
    x = torch.zeros((64, seq), dtype=torch.long)
    y = torch.zeros((64, seq), dtype=torch.long)
    mx, my = mix_synthetic(x, y, loaded, 0.5, torch.Generator().manual_seed(0))
    mixed = (mx[:, 0] >= 1000).nonzero().flatten()
    assert 16 <= len(mixed) <= 48 and torch.all(x == 0)  # inputs are not modified in place
    for r in mixed:
        start = int(mx[r, 0]) - 1000
        assert start % (seq + 1) == 0
        assert mx[r].tolist() == list(range(1000 + start, 1000 + start + seq))
        assert my[r].tolist() == list(range(1001 + start, 1001 + start + seq))
    assert torch.all(mx[(mx[:, 0] < 1000)] == 0)


def test_followed_records_grow_with_the_files_and_skip_a_partial_record(tmp_path):
    seq, width = 6, 7
    a, b = tmp_path / "a.u16", tmp_path / "b.u16"
    (np.arange(2 * width, dtype=np.uint16) + 1000).tofile(a)
    b.write_bytes(b"")  # the second sampler has written nothing yet
    records = SyntheticRecords(f"{a},{b}", seq, follow=True)
    assert records.shape == (2, width)
    with open(b, "ab") as f:  # a whole record and half of the next, as a sampler mid-write
        (np.arange(width + 3, dtype=np.uint16) + 5000).tofile(f)
    assert len(records) == 2 and records.refresh() == 3
    got = records.rows(np.array([2, 0, 1, 2]))
    assert got.dtype == np.int64 and got.shape == (4, width)
    assert got[0].tolist() == list(range(5000, 5000 + width)) == got[3].tolist()
    assert got[1].tolist() == list(range(1000, 1000 + width))
    assert got[2].tolist() == list(range(1000 + width, 1000 + 2 * width))


def test_following_still_needs_a_whole_record(tmp_path):
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "short.u16")
    with pytest.raises(SystemExit, match="no whole record"):
        SyntheticRecords(str(tmp_path / "short.u16"), 6, follow=True)


def test_sigterm_waits_for_a_batch_being_appended():
    stopper = StopOnSigterm()
    with pytest.raises(Stopped):
        with stopper.deferred():
            stopper()  # inside: noted, not raised until the block is done
            appended = True
    assert appended and stopper.requested
    with pytest.raises(Stopped):
        StopOnSigterm()()  # outside: at once


def test_ragged_record_file_is_refused(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "bad.u16")
    with pytest.raises(SystemExit, match="whole number of records"):
        SyntheticRecords(str(tmp_path / "bad.u16"), 6)


def test_missing_or_empty_record_file_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        SyntheticRecords(str(tmp_path / "absent.u16"), 6)
    (tmp_path / "empty.u16").write_bytes(b"")
    with pytest.raises(SystemExit, match="whole number of records"):
        SyntheticRecords(str(tmp_path / "empty.u16"), 6)


def test_generation_refuses_to_append_to_misaligned_records(tmp_path, capsys):
    out = tmp_path / "records.u16"
    np.arange(10, dtype=np.uint16).tofile(out)
    # refused before the teacher is read, so no teacher file is needed
    assert generate_main(["--teacher", str(tmp_path / "none.gguf"), "--out", str(out),
                          "--length", "7", "--prompt-tokens", "2", "--records", "1"]) == 2
    assert "not whole records of --length 7" in capsys.readouterr().err
    assert out.stat().st_size == 20


@pytest.mark.parametrize("attention,fused_calls", [("sdpa", 3), ("matmul", 0)])
def test_decode_steps_take_the_named_attention_path(monkeypatch, attention, fused_calls):
    import generate_text
    calls = []
    fused = generate_text.F.scaled_dot_product_attention
    monkeypatch.setattr(generate_text.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(torch.backends.cuda.cudnn_sdp_enabled()) or fused(*a, **k))
    teacher = tiny_teacher(0)
    dec = generate_text.CachedDecoder(teacher, 2, 8, torch.float32, "cpu", attention)
    dec.logits(torch.tensor([[1, 2, 3], [4, 5, 6]]))  # a prompt chunk: always the masked product
    assert calls == []
    dec.logits(torch.tensor([[7], [8]]))  # one step: each of the 3 layers
    assert calls == [False] * fused_calls  # never cuDNN's attention (a plan per key length)


def test_nan_logits_fail_loudly():
    teacher = tiny_teacher(0)
    with torch.no_grad():
        teacher.layers[1].mlp.down.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="NaN"):
        sample_records(teacher, torch.tensor([[1, 2]]), 5, 1.0, torch.Generator().manual_seed(0))


def test_main_passes_attention_and_sampler_to_every_batch(tmp_path, monkeypatch):
    import generate_text
    data = tmp_path / "data"
    data.mkdir()
    np.random.default_rng(0).integers(1, 97, 400).astype(np.uint16).tofile(data / "train.u16")
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"separator_id": 0}}))
    monkeypatch.setattr(generate_text, "load_teacher", lambda path: (tiny_teacher(0), {}))
    seen = []
    real = generate_text.sample_records
    monkeypatch.setattr(generate_text, "sample_records",
                        lambda *a: seen.append(a[5:]) or real(*a))
    out = tmp_path / "r.u16"
    assert generate_main(["--teacher", "t.gguf", "--data", str(data), "--out", str(out), "--length", "9",
                          "--prompt-tokens", "3", "--batch", "2", "--records", "4", "--device", "cpu",
                          "--attention", "matmul", "--sampler", "multinomial", "--check"]) == 0
    assert seen == [("matmul", "multinomial")] * 2
    records = np.fromfile(out, dtype=np.uint16).reshape(-1, 9)
    assert records.shape == (4, 9) and records.max() < 97
    settings = json.loads((tmp_path / "r.u16.json").read_text())
    assert settings["settings"]["attention"] == "matmul" and settings["records"] == 4


@pytest.mark.parametrize("sampler", ["race", "multinomial"])
def test_records_are_drawn_with_the_named_sampler(monkeypatch, sampler):
    import generate_text
    seen = []
    real = generate_text.sample_next
    monkeypatch.setattr(generate_text, "sample_next", lambda *a: seen.append(a[3]) or real(*a))
    generate_text.sample_records(tiny_teacher(0), torch.tensor([[1, 2]]), 6, 1.0, torch.Generator().manual_seed(0),
                                 "sdpa", sampler)
    assert seen == [sampler] * 4
