"""A student .tinyloop file back into a weights folder that train.py --init-weights takes.

export.py keeps only the quantized matrices of a run; when a run's fp16 weight shards
are gone, this turns the file (the shipped model, say) into student-0N.pt shards and a
student.json again, every tensor dequantized, so that training can continue from it
(with quantization-aware training the file's grid values are what was trained for).
The tied embedding is left out, as train.py saves it: training re-reads the teacher's.
Each q4 matrix's grid (f16 scale and min per group) goes with it as NAME.q4_scale and
NAME.q4_min, the form train.py --qat-learn-grid saves: a continuation with
--qat-learn-grid starts QAT on the file's own grids (train.py drops them otherwise). The
embedding's grid comes without the embedding: train.py --qat-learn-embed-grid starts from
it, and export.py writes the teacher's embedding on it (as the file did).

  python3 tools/train/import_model.py --model python/tinyloop/models/tinyloop-smollm2-looped.tinyloop \\
      --out .traindata/init
  python3 tools/train/import_model.py --model FILE --out DIR --check   # also compare logits

--check builds the student from the folder (with the file's own embedding) and compares
its logits, in float64 on the CPU, with TinyLoop's runtime on the same file, at depths
1 and the default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "python"))
from layers import Dims  # noqa: E402
from student import LoopedStudent, StudentConfig  # noqa: E402
from tinyloop.fileformat.quantize import QTensor  # noqa: E402
from tinyloop.fileformat.tinyloop_file import read_file  # noqa: E402
from qat import GRID_SUFFIXES  # noqa: E402
from train import SHARD_BYTES, load_init_weights  # noqa: E402



def file_config(f) -> tuple[dict, dict]:
    """(dims as train.py records them, student config) from a student file's header."""
    d, meta = f.dims, f.metadata
    dims = {"vocab": d["vocab_size"], "d": d["d_model"], "heads": d["n_head"], "kv_heads": d["n_kv_head"],
            "head_dim": d["head_dim"], "ffn": d["ffn_dim"], "eps": float(meta["arch.norm_eps"]),
            "rope_theta": float(meta["arch.rope_theta"])}
    cfg = {"n_pre": d["n_pre"], "n_core": d["n_core"], "n_post": d["n_post"], "max_depth": d["max_depth"],
           "default_depth": d["default_depth"], "injection": meta["loop.injection"],
           "state_init": meta["loop.state_init"], "loop_norm": bool(meta["loop.norm"]),
           "core_init": "stepwise", "core_start": -1}
    return dims, cfg


def file_grid(f, name: str) -> dict:
    """{NAME.q4_scale, NAME.q4_min: f16 [rows, cols // group]} of a q4 matrix, else {}."""
    e = f.tensors[name]
    if e.dtype != "q4":
        return {}
    q = QTensor.from_bytes(e.dtype, e.shape, e.group_size, f.raw(name))
    shape = (q.shape[0], q.shape[1] // q.group_size)
    return {name + GRID_SUFFIXES[0]: torch.from_numpy(q.scales.reshape(shape).copy()),
            name + GRID_SUFFIXES[1]: torch.from_numpy(q.mins.reshape(shape).copy())}


def import_model(model: Path, out: Path) -> dict:
    with read_file(str(model)) as f:
        dims, cfg = file_config(f)
        # vocab.frequency is no weight: token_frequency.py adds it to an export again
        names = sorted(n for n in f.tensors if n not in ("embed.weight", "vocab.frequency"))
        state = {n: torch.from_numpy(f.tensor(n).astype(np.float32)).to(torch.float16) for n in names}
        for n in names + ["embed.weight"]:  # the embedding's grid too (train.py --qat-learn-embed-grid)
            state.update(file_grid(f, n))
        source = f.metadata.get("general.source", "")
    names = sorted(state)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("student-*.pt"):
        old.unlink()
    groups, size = [{}], 0   # fp16 shards of at most SHARD_BYTES, as train.py writes them
    for n in names:
        nbytes = state[n].numel() * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][n] = state[n]
        size += nbytes
    shards = []
    for i, group in enumerate(groups):
        torch.save(group, out / f"student-{i:02d}.pt")
        shards.append(f"student-{i:02d}.pt")
    info = {"dims": dims, "student": cfg, "embed_trained": False, "step": None,
            "imported_from": f"{model.name} ({source})", "shards": shards}
    (out / "student.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


@torch.no_grad()
def check(model: Path, out: Path, info: dict) -> float:
    """Largest |logit difference| between the student built from `out` and the runtime."""
    import tinyloop
    dims, cfg = Dims(**info["dims"]), StudentConfig(**info["student"])
    student = LoopedStudent(dims, cfg).double().eval()
    load_init_weights(student, out, dims)
    with read_file(str(model)) as f:   # the file's own embedding, not the teacher's
        student.embed.weight.copy_(torch.from_numpy(f.tensor("embed.weight")))
    tokens = np.random.default_rng(0).integers(0, dims.vocab, 24).astype(np.int32)
    worst = 0.0
    with tinyloop.Model(str(model)) as rt:
        for depth in sorted({1, cfg.default_depth}):
            ours = student(torch.from_numpy(tokens.astype(np.int64))[None], depth)[0, -1].numpy()
            theirs = rt.score_last_token(tokens, depth=depth)
            err = float(np.abs(ours - theirs).max())
            print(f"depth {depth}: max |logit difference| {err:.3g} (logit range {np.ptp(theirs):.3g})")
            worst = max(worst, err)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a student .tinyloop written by export.py")
    ap.add_argument("--out", required=True, help="weights folder to write")
    ap.add_argument("--check", action="store_true", help="compare the student's logits with the runtime's")
    ap.add_argument("--tolerance", type=float, default=0.05, help="--check: largest logit difference")
    args = ap.parse_args(argv)
    info = import_model(Path(args.model), Path(args.out))
    print(f"wrote {args.out}: {len(info['shards'])} shards, student {info['student']}")
    if args.check and check(Path(args.model), Path(args.out), info) > args.tolerance:
        print(f"logits differ by more than {args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
