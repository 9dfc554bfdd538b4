"""Write the trained student as a .tinyloop file (docs/format.md).

Reads the fp16 weight shards and student.json that train.py leaves in RUN/weights, takes
the tied embedding from the teacher GGUF (it is not trained by default), quantizes the
matrices (q4 by default; a matrix trained with a learned grid, train.py --qat-learn-grid,
on its own grid) and writes dims, architecture/loop metadata, the tokenizer and
provenance. Fails when the file is larger than --max-bytes.

  python3 tools/train/export.py --weights RUN/weights --gguf TEACHER.gguf --out student.tinyloop
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
from qat import QMAX, split_grid  # noqa: E402
from tinyloop.convert import from_gguf  # noqa: E402
from tinyloop.convert.gguf_reader import GGUFFile  # noqa: E402
from tinyloop.fileformat.quantize import QTensor, pack_codes, quantize  # noqa: E402
from tinyloop.fileformat.tinyloop_file import TinyLoopWriter, read_file  # noqa: E402

MODEL_NAME = "tinyloop-smollm2-looped"


def load_weights(folder: Path) -> tuple[dict, dict]:
    info = json.loads((folder / "student.json").read_text())
    state = {}
    for shard in info["shards"]:
        state.update(torch.load(folder / shard, map_location="cpu", weights_only=True))
    return info, {k: v.float().numpy() for k, v in state.items()}


def usable_embed_grid(grid, cols: int, dtype: str, group: int) -> bool:
    """Whether a weights folder's embedding grid (a learned one, or the file's that
    import_model.py carried) is how the embedding is written: only as q4 in its own groups;
    another encoding asked for drops it, with a note."""
    if grid is None:
        return False
    groups = cols // grid[0].shape[1]
    if dtype == "q4" and groups == group:
        return True
    print(f"the folder's q4 embedding grid (groups of {groups}) is not used: the embedding is "
          f"written as {dtype} group {group}")
    return False


def quantize_on_grid(w: np.ndarray, scale: np.ndarray, vmin: np.ndarray, group: int) -> QTensor:
    """q4 of w on a learned grid (f16 scale and min per group, [rows, cols // group]), with
    the codes qat.grid_values trained against: clip(rint((f16(w) - min) / scale), 0, 15)."""
    rows, cols = w.shape
    if scale.shape != (rows, cols // group) or vmin.shape != scale.shape:
        raise SystemExit(f"learned grid {scale.shape} does not fit {w.shape} in groups of {group} "
                         f"(--group-size must be train.py's --qat-group)")
    with np.errstate(over="ignore"):  # an overflow to inf is refused just below
        s16, m16 = scale.astype(np.float16), vmin.astype(np.float16)
    if not (np.isfinite(s16).all() and (s16 > 0).all() and np.isfinite(m16).all()):
        raise SystemExit(f"learned grid of a {w.shape} matrix has a scale that is not a positive "
                         f"f16 number or a min that is not finite")
    g = w.astype(np.float16).astype(np.float64).reshape(rows, cols // group, group)
    s, m = s16.astype(np.float64)[..., None], m16.astype(np.float64)[..., None]
    q = np.clip(np.rint((g - m) / s), 0, QMAX).astype(np.uint8).reshape(rows, cols)
    return QTensor("q4", (rows, cols), group, pack_codes("q4", q), s16, m16)


def tokenizer_metadata(gguf: GGUFFile, teacher_tinyloop: str | None) -> dict:
    """tokenizer.* keys: copied from a converted teacher file when given, else built from
    the GGUF vocabulary as the converter builds them."""
    if teacher_tinyloop:
        with read_file(teacher_tinyloop) as f:
            meta = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
        if "tokenizer.json" not in meta:
            raise SystemExit(f"{teacher_tinyloop} has no tokenizer.json metadata")
        return meta
    return from_gguf.tokenizer_metadata(gguf, verify=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="RUN/weights folder written by train.py")
    ap.add_argument("--gguf", required=True, help="teacher GGUF (embedding, tokenizer)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--teacher-tinyloop", help="converted teacher: copy its tokenizer.* metadata")
    ap.add_argument("--dtype", default="q4", choices=("q4", "q8", "f16"), help="block matrices")
    ap.add_argument("--embed-dtype", default="q4", choices=("q4", "q8", "f16"))
    ap.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128))
    ap.add_argument("--embed-group-size", type=int, default=64, choices=(32, 64, 128),
                    help="64 keeps a q4 embedding + six q4 blocks under 32 MB")
    ap.add_argument("--method", default="rtn", choices=("rtn", "search"),
                    help="block matrices; blocks trained with QAT (train.py --qat-start) match rtn")
    ap.add_argument("--embed-method", default="", choices=("", "rtn", "search"),
                    help="embedding (default: --method); search suits the untrained embedding")
    ap.add_argument("--default-depth", type=int, default=0, help="override the trained default")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--max-bytes", type=int, default=32_000_000)
    args = ap.parse_args(argv)

    info, state = load_weights(Path(args.weights))
    state, grids = split_grid(state)
    embed_grid = grids.pop("embed.weight", None)  # the frozen embedding's: checked below
    if grids and args.dtype != "q4":
        raise SystemExit(f"{args.weights} holds learned q4 grids: --dtype must be q4")
    unquantized = [n for n, w in state.items() if w.ndim == 2 and n != "embed.weight" and n not in grids]
    if grids and unquantized:
        raise SystemExit(f"{args.weights}: learned q4 grids for some block matrices but not for "
                         f"{unquantized[:3]}: a weights folder has them for all or none")
    dims, cfg = info["dims"], info["student"]
    gguf = GGUFFile(args.gguf)
    if not info.get("embed_trained"):
        state["embed.weight"] = from_gguf.decode_tensor(gguf, "token_embd.weight")
    if usable_embed_grid(embed_grid, state["embed.weight"].shape[1], args.embed_dtype, args.embed_group_size):
        grids["embed.weight"] = embed_grid
    default_depth = args.default_depth or cfg["default_depth"]
    if not 1 <= default_depth <= cfg["max_depth"]:
        raise SystemExit(f"default depth {default_depth} is outside 1..{cfg['max_depth']}")

    writer = TinyLoopWriter({
        "vocab_size": dims["vocab"], "d_model": dims["d"], "n_head": dims["heads"],
        "n_kv_head": dims["kv_heads"], "head_dim": dims["head_dim"], "ffn_dim": dims["ffn"],
        "n_pre": cfg["n_pre"], "n_core": cfg["n_core"], "n_post": cfg["n_post"],
        "default_depth": default_depth, "max_depth": cfg["max_depth"],
        "max_seq_len": args.max_seq_len})
    meta = {
        "arch.norm_placement": "pre", "arch.norm_type": "rmsnorm", "arch.norm_eps": float(dims["eps"]),
        "arch.rope_style": "interleaved", "arch.rope_theta": float(dims["rope_theta"]),
        "arch.rope_dims": dims["head_dim"], "arch.activation": "silu", "arch.tied_embeddings": 1,
        "loop.injection": cfg["injection"], "loop.state_init": cfg["state_init"],
        "loop.norm": int(cfg["loop_norm"]),
        "general.name": MODEL_NAME,
        "general.source": f"distilled from {info.get('teacher', 'SmolLM2-135M-Instruct')} "
                          f"(HuggingFaceTB) by tools/train, step {info.get('step')}",
        "general.license": "apache-2.0",
        "general.converter": "tools/train/export.py",
        **tokenizer_metadata(gguf, args.teacher_tinyloop),
    }
    for key, value in meta.items():
        writer.add_metadata(key, value)

    for name in sorted(state):
        w = np.ascontiguousarray(state[name], dtype=np.float32)
        dtype = args.embed_dtype if name == "embed.weight" else args.dtype
        group = args.embed_group_size if name == "embed.weight" else args.group_size
        if w.ndim == 1 or dtype == "f16":
            writer.add_tensor(name, w, "f32" if w.ndim == 1 else "f16")
        elif name in grids:
            writer.add_tensor(name, quantize_on_grid(w, *grids[name], group))
        else:
            method = (args.embed_method or args.method) if name == "embed.weight" else args.method
            writer.add_tensor(name, quantize(w, dtype, group, method))
    out = Path(args.out)
    writer.write(str(out))
    size = out.stat().st_size
    print(f"wrote {out}: {size} bytes, {len(state)} tensors ({len(grids)} on learned grids), "
          f"default depth {default_depth}")
    if size > args.max_bytes:
        raise SystemExit(f"{out} is {size} bytes, over the limit of {args.max_bytes}")


if __name__ == "__main__":
    main()
