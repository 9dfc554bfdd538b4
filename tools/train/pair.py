"""Train variants of the student side by side, one per GPU, on the same data and schedule.

Each variant is a train.py run in ROOT/NAME with the common arguments plus its own, on
GPU i (CUDA_VISIBLE_DEVICES). Calling the same command again resumes every run (train.py
resumes from ROOT/NAME/latest.pt). A run whose schedule is finished is exported with
export.py (the common export arguments plus the variant's) and its .tinyloop is cut into
pieces small enough to come back from the GPU machine (`cat NAME.tinyloop.part-* >
NAME.tinyloop` joins them). Into --copy-to go, per variant: NAME-results.json,
NAME-train.log and, once exported, the pieces.

  python3 tools/train/pair.py --teacher T.gguf --root /tmp/runs --copy-to $OUT \\
      --run-minutes 8 --common "--max-minutes 14 --n-post 3" \\
      --variant a="" --variant b="--train-embed" \\
      --export-common "--method rtn --group-size 64 --default-depth 6" \\
      --export a="--embed-method search" --export b="--embed-method rtn"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECE_BYTES = 15 << 20  # files come back from the GPU machine only below 16 MiB each


def named(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"{flag} {item!r}: expected NAME=ARGS")
        out[name] = value
    return out


def split_file(path: Path, dest: Path) -> list[Path]:
    pieces = []
    with open(path, "rb") as f:
        while chunk := f.read(PIECE_BYTES):
            piece = dest / f"{path.name}.part-{len(pieces)}"
            piece.write_bytes(chunk)
            pieces.append(piece)
    return pieces


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--root", required=True, help="one run folder per variant below it")
    ap.add_argument("--copy-to", required=True, help="where results, logs and model pieces go")
    ap.add_argument("--run-minutes", type=float, required=True, help="train.py --run-minutes")
    ap.add_argument("--common", default="", help="train.py arguments of every variant")
    ap.add_argument("--variant", action="append", default=[], help="NAME=ARGS (train.py), one per GPU")
    ap.add_argument("--gpus", default="", help="comma-separated GPU indices, one per variant in order "
                                               "(default 0, 1, ...); an index may repeat, but a run "
                                               "takes ~35 GB at --batch 16 --seq 1024: three fit an H200")
    ap.add_argument("--export-common", default="", help="export.py arguments of every variant")
    ap.add_argument("--export", action="append", default=[], help="NAME=ARGS (export.py)")
    ap.add_argument("--tokenizer-from", default="", help="export.py --teacher-tinyloop")
    args = ap.parse_args(argv)
    variants, exports = named(args.variant, "--variant"), named(args.export, "--export")
    if not variants:
        raise SystemExit("give at least one --variant")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] or [str(i) for i in range(len(variants))]
    if len(gpus) < len(variants) or not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--gpus {args.gpus!r}: one GPU index per variant ({len(variants)})")
    root, dest = Path(args.root), Path(args.copy_to)
    dest.mkdir(parents=True, exist_ok=True)

    procs = {}
    for gpu, (name, extra) in zip(gpus, variants.items()):
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / "train.py"), "--teacher", args.teacher, "--out", str(out),
               "--run-minutes", str(args.run_minutes), *shlex.split(args.common), *shlex.split(extra)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"}
        log = open(out / "train.log", "a")
        print(f"[pair] {name} on GPU {gpu}: {shlex.join(cmd)}", flush=True)
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)

    status, exporting = 0, {}
    for name, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        out = root / name
        print(f"[pair] {name}: train.py exited {rc}", flush=True)
        shutil.copy(out / "train.log", dest / f"{name}-train.log")
        results = out / "results.json"
        if rc != 0 or not results.exists():
            status = 1
            continue
        shutil.copy(results, dest / f"{name}-results.json")
        if not json.loads(results.read_text()).get("finished"):
            continue
        model = out / f"{name}.tinyloop"
        cmd = [sys.executable, str(HERE / "export.py"), "--weights", str(out / "weights"), "--gguf",
               args.teacher, "--out", str(model), *shlex.split(args.export_common),
               *shlex.split(exports.get(name, ""))]
        if args.tokenizer_from:
            cmd += ["--teacher-tinyloop", args.tokenizer_from]
        print(f"[pair] export {name}: {shlex.join(cmd)}", flush=True)
        exporting[name] = (subprocess.Popen(cmd), model)  # side by side: search takes ~1 min

    for name, (proc, model) in exporting.items():
        if proc.wait() != 0:
            status = 1
            continue
        pieces = split_file(model, dest)
        print(f"[pair] {name}: {model.stat().st_size} bytes in {len(pieces)} pieces", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
