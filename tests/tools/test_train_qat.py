"""tools/train/qat.py's learned q4 grid (train.py --qat-learn-grid) and its export: the
training forward equals what export.py writes, it starts at the rtn grid, its gradients are
the exact ones for the grid (codes held), and learning it lowers the rounding error. Needs PyTorch (the training tools'
environment, tools/train/README.md); without it the module is skipped with that reason."""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the training tools' tests need it")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "train"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from export import quantize_on_grid  # noqa: E402
from import_model import file_grid  # noqa: E402
from qat import (QAT, QMAX, fake_quant_q4_learned, fake_quant_q4_on_grid, fake_quant_q4_values,  # noqa: E402
                 grid_values, rtn_grid, split_grid)

GROUP = 32


def weights(seed: int, rows: int = 6, cols: int = 96) -> torch.Tensor:
    """Heavy-tailed rows (a learned grid has outliers to clip) and one constant group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((rows, cols)) * 0.02
    w = torch.randn(rows, cols, generator=gen) * 0.02 + w * (torch.rand(rows, cols, generator=gen) < 0.1)
    w[2, :GROUP] = 0.015625  # f16-exact
    return w


def perturbed_grid(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale, vmin = rtn_grid(w, GROUP)
    gen = torch.Generator().manual_seed(seed)
    log_scale = scale.clamp_min(2.0 ** -24).log() + 0.3 * torch.randn(scale.shape, generator=gen)
    return log_scale, vmin + scale * torch.randn(scale.shape, generator=gen)


class Linear(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(w)


@pytest.mark.parametrize("group", [32, 64])
def test_rtn_fake_quantization_is_tinyloop_quantize(group):
    from tinyloop.fileformat.quantize import quantize
    w = weights(10, cols=128).half().float()  # export.py reads the fp16 shards
    expected = quantize(w.numpy(), "q4", group, "rtn").dequantize().astype(np.float32)
    assert np.array_equal(fake_quant_q4_values(w, group).numpy(), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_export_writes_the_weights_training_saw(seed):
    w = weights(seed)
    log_scale, vmin = perturbed_grid(w, seed)
    trained = fake_quant_q4_learned(w, log_scale, vmin, GROUP)
    scale16 = log_scale.exp().half().numpy()
    exported = quantize_on_grid(w.half().float().numpy(), scale16, vmin.half().numpy(), GROUP)
    assert np.array_equal(exported.dequantize().astype(np.float32), trained.numpy())
    assert np.array_equal(exported.scales, scale16.reshape(-1))
    codes = exported.codes()
    assert codes.min() == 0 and codes.max() == QMAX  # the perturbed grids clip at both ends


def test_learned_grid_starts_as_the_rtn_grid():
    w = weights(3)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    with qat.active():  # before init_grid: the rtn grid
        before = qat.model.proj.weight.detach().clone()
    qat.init_grid()
    with qat.active():
        learned = qat.model.proj.weight.detach().clone()
    with qat.active(learned=False):
        rtn = qat.model.proj.weight.detach().clone()
    assert torch.equal(learned, fake_quant_q4_values(w, GROUP))
    assert torch.equal(before, rtn)
    # the rtn path's w + (w' - w).detach() may round w' by an ulp; the learned path is exact
    assert torch.allclose(learned, rtn, rtol=1e-6, atol=0)
    assert torch.equal(learned[2, :GROUP], torch.full((GROUP,), 0.015625))  # constant group exact


def f16_positions(w, log_scale, vmin):
    """(f16(w) - f16(min)) / f16(scale) per group in float64: where each weight falls."""
    g = w.detach().half().double().reshape(w.shape[0], -1, GROUP)
    s = log_scale.detach().exp().half().double()[..., None]
    return (g - vmin.detach().half().double()[..., None]) / s


def test_grid_gradients_hold_the_codes_and_weights_pass_unless_clipped():
    w = weights(4).requires_grad_()
    log_scale, vmin = (t.requires_grad_() for t in perturbed_grid(w.detach(), 4))
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    (fake_quant_q4_learned(w, log_scale, vmin, GROUP) * upstream).sum().backward()

    x = f16_positions(w, log_scale, vmin)
    unclipped = (x >= -0.5) & (x <= QMAX + 0.5)
    codes = grid_values(w, log_scale.exp(), vmin, GROUP)[1].float()
    assert torch.equal(codes, torch.round(x).clamp(0, QMAX).float())
    up = upstream.reshape(x.shape)
    s = log_scale.detach().exp()[..., None]
    assert not unclipped.all() and unclipped.any()
    assert torch.equal(w.grad, (up * unclipped).reshape(w.shape))
    assert torch.allclose(log_scale.grad, (up * codes * s).sum(-1), rtol=1e-4, atol=1e-7)
    assert torch.allclose(vmin.grad, up.sum(-1), rtol=1e-5, atol=1e-6)


def test_every_weight_learns_on_the_starting_grid():
    """At the rtn start nothing is clipped: a group's own min and max get their gradient."""
    w = weights(12, rows=32, cols=256)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    qat.init_grid()
    with qat.active():
        qat.model.proj.weight.sum().backward()
    assert torch.equal(qat.model.proj.weight.grad, torch.ones_like(w))


def test_constant_groups_start_at_a_usable_scale_and_scales_stay_positive():
    w = weights(13)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    qat.init_grid()
    log_scale = qat.grid["proj.weight"][0]
    rtn_scale, _ = rtn_grid(w, GROUP)
    assert rtn_scale[2, 0] == 0 and (rtn_scale > 0).sum() == rtn_scale.numel() - 1
    start = log_scale.detach().exp().half().float()
    assert start[2, 0] == rtn_scale[rtn_scale > 0].median()  # the constant group
    assert torch.equal(start[rtn_scale > 0], rtn_scale[rtn_scale > 0])
    with torch.no_grad():
        log_scale[0, 0] = -40.0
    qat.clamp_grid()
    assert log_scale[0, 0].exp().half() > 0


def test_learning_the_grid_lowers_the_rounding_error():
    w = weights(6, rows=16, cols=128)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    qat.init_grid()
    scales, mins = qat.grid_parameters()
    opt = torch.optim.Adam([{"params": scales, "lr": 1e-2}, {"params": mins, "lr": 1e-4}])

    def error() -> torch.Tensor:
        with qat.active():
            return ((qat.model.proj.weight - w) ** 2).sum()

    rtn_error = error().item()
    for _ in range(200):
        opt.zero_grad()
        error().backward()
        opt.step()
    assert error().item() < 0.9 * rtn_error  # 0.85 measured


def test_grid_state_round_trips_and_refuses_another_model():
    w = weights(7)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    qat.init_grid()
    with torch.no_grad():
        qat.grid["proj.weight"][0].add_(0.1)
    state = qat.grid_state()
    other = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    other.load_grid_state(state)
    assert other.grid_ready
    assert all(torch.equal(a, b) for a, b in zip(other.grid["proj.weight"], qat.grid["proj.weight"]))
    other.init_grid()  # a loaded grid is kept
    assert torch.equal(other.grid["proj.weight"][0], qat.grid["proj.weight"][0])
    with pytest.raises(SystemExit, match="do not match"):
        QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=False).load_grid_state(state)


def test_saved_grids_pair_with_their_weights():
    exported = QAT(Linear(weights(8)), group=GROUP, quantize_embed=False, learn_grid=True)
    exported.init_grid()
    saved = {"proj.weight": torch.zeros(6, 96), "norm.weight": torch.ones(96), **exported.exported_grid()}
    plain, grids = split_grid(saved)
    assert set(plain) == {"proj.weight", "norm.weight"} and set(grids) == {"proj.weight"}
    assert grids["proj.weight"][0].dtype == torch.float16
    with pytest.raises(SystemExit, match="needs"):
        split_grid({k: v for k, v in saved.items() if k != "proj.weight.q4_min"})
    with pytest.raises(SystemExit, match="without scales"):
        split_grid({k: v for k, v in saved.items() if k != "proj.weight.q4_scale"})


def test_export_refuses_a_grid_of_another_group_size():
    w = weights(9)
    scale, vmin = rtn_grid(w, GROUP)
    with pytest.raises(SystemExit, match="--qat-group"):
        quantize_on_grid(w.numpy(), scale.half().numpy(), vmin.half().numpy(), 2 * GROUP)


@pytest.mark.parametrize("bad", ["nan scale", "zero scale", "overflowing scale", "inf min"])
def test_export_refuses_a_broken_grid(bad):
    w = weights(14)
    scale, vmin = (t.double().numpy() for t in rtn_grid(w, GROUP))
    scale[scale == 0] = 1e-3
    if bad == "nan scale":
        scale[1, 1] = np.nan
    elif bad == "zero scale":
        scale[1, 1] = 0.0
    elif bad == "overflowing scale":
        scale[1, 1] = 1e6  # beyond f16
    else:
        vmin[0, 2] = np.inf
    with pytest.raises(SystemExit, match="positive"):
        quantize_on_grid(w.numpy(), scale, vmin, GROUP)


def test_a_files_grids_restart_qat_on_the_files_weights(tmp_path):
    """import_model.py hands a file's q4 grids to train.py (set_grid): QAT's first forward
    is the file's weights, also where the grid does not span its group's extremes."""
    from tinyloop.fileformat.tinyloop_file import TinyLoopWriter, read_file
    w = weights(11)
    log_scale, vmin = perturbed_grid(w, 11)
    writer = TinyLoopWriter(dict(vocab_size=32, d_model=96, n_head=4, n_kv_head=2, head_dim=24,
                                 ffn_dim=128, n_pre=1, n_core=1, n_post=1, default_depth=2,
                                 max_depth=4, max_seq_len=64))
    writer.add_tensor("proj.weight", quantize_on_grid(w.half().float().numpy(), log_scale.exp().half().numpy(),
                                                      vmin.half().numpy(), GROUP))
    writer.write(str(tmp_path / "m.tinyloop"))
    with read_file(str(tmp_path / "m.tinyloop")) as f:
        stored = torch.from_numpy(f.tensor("proj.weight").astype(np.float32))
        grid = file_grid(f, "proj.weight")
    imported = stored.half().float()  # import_model.py writes fp16 shards
    qat = QAT(Linear(imported), group=GROUP, quantize_embed=False, learn_grid=True)
    _, grids = split_grid({"proj.weight": imported, **grid})
    qat.set_grid(grids)
    qat.init_grid()  # at the switch: keeps the set grid
    with qat.active():
        assert torch.equal(qat.model.proj.weight, stored)
    with qat.active(learned=False):
        assert not torch.equal(qat.model.proj.weight, stored)  # rtn would move this file's weights
    with pytest.raises(SystemExit, match="--qat-group"):
        QAT(Linear(imported), group=2 * GROUP, quantize_embed=False, learn_grid=True).set_grid(grids)
    with pytest.raises(SystemExit, match="cover"):
        QAT(Linear(imported), group=GROUP, quantize_embed=False, learn_grid=True).set_grid({})


def test_compiled_fake_quantization_is_kept_only_when_exact(monkeypatch):
    w = weights(15, rows=8, cols=128)
    qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True, compile_learned=True)
    qat.init_grid()
    with torch.no_grad():
        qat.grid["proj.weight"][0].add_(0.2)  # off the rtn grid
    assert qat.check_compiled() == "compiled"
    log_scale, vmin = qat.grid["proj.weight"]
    expected = fake_quant_q4_learned(w, log_scale, vmin, GROUP).detach()
    # as train.py runs it: training under autocast with gradients, validation without
    for grad in (True, False):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16), qat.active():
            assert torch.equal(qat.model.proj.weight.detach(), expected)
    assert qat.check_compiled() == "compiled"  # the recheck train.py runs at every validation

    wrong = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True, compile_learned=True)
    wrong._on_grid = lambda *args: fake_quant_q4_on_grid(*args) * 1.0001  # a miscompilation
    wrong.init_grid()
    assert wrong.check_compiled().startswith("eager (ValueError: proj.weight: compiled values differ")
    with wrong.active():
        assert torch.equal(wrong.model.proj.weight, fake_quant_q4_values(w, GROUP))
    assert QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True).check_compiled() == "eager"


def test_saved_grids_are_kept_only_when_qat_starts_on_them():
    w = weights(16)
    scale, vmin = rtn_grid(w, GROUP)
    saved = {"proj.weight": (scale.half() * 1.5, vmin.half())}  # not the rtn grid; row 2 constant

    def started(keep_init):
        qat = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
        qat.set_grid(saved)
        return qat, qat.switch_on(keep_init), qat.grid["proj.weight"][0].detach().exp().half().float()

    qat, refit, kept = started(True)
    assert not refit and torch.equal(kept[scale > 0], (scale.half() * 1.5).float()[scale > 0])
    assert kept[2, 0] == kept[scale > 0].median()  # the constant group starts at the median
    _, refit, fresh = started(False)
    assert refit and torch.equal(fresh[scale > 0], scale[scale > 0])

    # a resumed run whose grid QAT has trained keeps it, whatever the schedule says
    resumed = QAT(Linear(w), group=GROUP, quantize_embed=False, learn_grid=True)
    resumed.load_grid_state(qat.grid_state())
    assert not resumed.switch_on(False)
    assert torch.equal(resumed.grid["proj.weight"][0], qat.grid["proj.weight"][0])


def test_qat_asked_to_start_at_once_keeps_the_saved_grids():
    """The rule reads --qat-start, not the clock at the switch: a first step that compiles
    for 16 s is 2 % of a 13-minute schedule, and must not make QAT refit the saved grids."""
    from train import INIT_GRID_MAX_PROGRESS, keeps_init_grids
    assert keeps_init_grids(1e-6) and keeps_init_grids(INIT_GRID_MAX_PROGRESS)
    assert not keeps_init_grids(0.4) and not keeps_init_grids(2 * INIT_GRID_MAX_PROGRESS)


class Embedded(torch.nn.Module):
    """A frozen tied embedding (qat.EMBED) beside one trained matrix."""

    def __init__(self, seed: int):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 4 * GROUP)
        self.proj = torch.nn.Linear(4 * GROUP, 4 * GROUP, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(weights(seed, rows=40, cols=4 * GROUP))
            self.proj.weight.copy_(weights(seed + 1, rows=4 * GROUP, cols=4 * GROUP))
        self.embed.weight.requires_grad_(False)


def test_learned_embedding_grid_starts_at_its_export_and_exports_as_trained():
    model = Embedded(17)  # the embedding in groups of 2 * GROUP, the matrix in groups of GROUP
    qat = QAT(model, group=GROUP, embed_group=2 * GROUP, embed_method="search", learn_grid=True,
              learn_embed_grid=True)
    qat.switch_on(False)
    assert qat.grid["embed.weight"][0].shape == (40, 2) and qat.grid["proj.weight"][0].shape == (4 * GROUP, 4)
    w = model.embed.weight
    start = qat.embed_tensor(w).detach()
    from tinyloop.fileformat.quantize import quantize
    search = torch.from_numpy(quantize(w.half().float().numpy(), "q4", 2 * GROUP, "search").dequantize()).float()
    assert torch.equal(start, search)
    with torch.no_grad():  # a grid the training has moved
        qat.grid["embed.weight"][0].add_(0.2 * torch.randn(qat.grid["embed.weight"][0].shape))
    moved = qat.embed_tensor(w)
    scale, vmin = qat.exported_grid()["embed.weight.q4_scale"], qat.exported_grid()["embed.weight.q4_min"]
    written = quantize_on_grid(w.numpy(), scale.numpy(), vmin.numpy(), 2 * GROUP).dequantize()
    assert np.array_equal(moved.detach().numpy(), written)  # export writes what training saw
    moved.square().sum().backward()
    assert w.grad is None and qat.grid["embed.weight"][0].grad.abs().sum() > 0
    assert qat.grid["embed.weight"][1].grad.abs().sum() > 0
    # the comparison pass (learned=False) keeps the embedding's fixed export
    assert torch.equal(qat.embed_tensor(w, learned=False), search)


def test_a_learned_embedding_grid_needs_the_frozen_fake_quantized_embedding():
    model = Embedded(18)
    with pytest.raises(ValueError, match="frozen embedding"):
        QAT(model, group=GROUP, embed_group=2 * GROUP, quantize_embed=False, learn_grid=True,
            learn_embed_grid=True)
    model.embed.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen embedding"):
        QAT(model, group=GROUP, embed_group=2 * GROUP, learn_grid=True, learn_embed_grid=True)


def test_a_refit_keeps_the_frozen_embeddings_saved_grid():
    """A late QAT switch refits the trained matrices from rtn; the frozen embedding has not
    moved off the grid it was saved on, so that one is kept."""
    model = Embedded(19)
    qat = QAT(model, group=GROUP, embed_group=2 * GROUP, learn_grid=True, learn_embed_grid=True)
    saved = {name: (torch.rand(shape) * 0.01 + 0.001, torch.rand(shape) * -0.05)
             for name, shape in (("embed.weight", (40, 2)), ("proj.weight", (4 * GROUP, 4)))}
    qat.set_grid(saved)
    assert qat.switch_on(keep_init=False)
    embed_scale = qat.exported_grid()["embed.weight.q4_scale"].float()
    assert torch.equal(embed_scale, saved["embed.weight"][0].half().float())
    rtn = rtn_grid(model.proj.weight, GROUP)[0]
    refit = qat.grid["proj.weight"][0].detach().exp().half().float()
    assert torch.equal(refit[rtn > 0], rtn[rtn > 0])  # (a constant group starts at the median)


@pytest.mark.parametrize("dtype, group, used", [("q4", 64, True), ("q4", 32, False), ("q8", 64, False)])
def test_export_writes_the_embedding_on_its_grid_only_as_q4_in_its_groups(dtype, group, used, capsys):
    from export import usable_embed_grid
    grid = (torch.ones(40, 2), torch.zeros(40, 2))
    assert usable_embed_grid(grid, 128, dtype, group) == used
    assert ("is not used" in capsys.readouterr().out) != used
    assert not usable_embed_grid(None, 128, "q4", 64)


REQUIRED = ["--teacher", "T.gguf", "--out", "RUN", "--max-steps", "1"]


@pytest.mark.parametrize("flags, refused", [
    (["--grids-only", "--qat-start", "1e-6", "--init-weights", "RUN0"], "--grids-only"),  # no learned grid
    (["--grids-only", "--qat-learn-grid", "--qat-start", "0.4", "--init-weights", "RUN0"], "--grids-only"),
    (["--grids-only", "--qat-learn-grid", "--qat-start", "1e-6"], "--grids-only"),  # no weights to keep
    (["--grids-only", "--qat-learn-grid", "--qat-start", "1e-6", "--init-weights", "RUN0", "--train-embed"],
     "--grids-only"),
    (["--train-norms", "--qat-learn-grid", "--qat-start", "0.4"], "--train-norms"),  # every weight trains
    (["--qat-learn-embed-grid", "--qat-start", "0.4"], "--qat-learn-embed-grid"),   # no --qat-learn-grid
    (["--qat-learn-grid", "--qat-learn-embed-grid", "--qat-start", "0.4", "--train-embed"],
     "--qat-learn-embed-grid"),
    (["--qat-learn-grid", "--qat-learn-embed-grid", "--qat-start", "0.4", "--qat-embed", "none"],
     "--qat-learn-embed-grid"),
])
def test_grid_flags_that_cannot_work_are_usage_errors(flags, refused, capsys):
    from train import parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args([*REQUIRED, *flags])
    assert exit_.value.code == 2
    assert f"error: {refused} " in capsys.readouterr().err.strip().splitlines()[-1]


def test_grids_only_and_the_embedding_grid_parse_together():
    from train import parse_args
    args = parse_args([*REQUIRED, "--qat-start", "1e-6", "--qat-learn-grid", "--qat-learn-embed-grid",
                       "--grids-only", "--init-weights", "RUN0"])
    assert args.grids_only and args.qat_learn_embed_grid and not args.train_norms
    assert parse_args([*REQUIRED, "--qat-start", "1e-6", "--qat-learn-grid", "--grids-only",
                       "--init-weights", "RUN0", "--train-norms"]).train_norms
