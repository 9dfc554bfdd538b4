"""Move the teacher GGUF to the GPU machine in pieces.

The working tree that travels to the GPU machine is limited to 64 MiB per call and the
teacher GGUF is 94 MiB, so it goes in two calls: `split` cuts it here into parts under
.traindata/teacher/ (with parts.json: sizes and sha256); on the GPU machine `gather`, run in
each call with whichever parts that call carried, copies them into a stash outside the
tree (/tmp, which survives between calls while the machine stays warm) and, once all parts
are there, joins them and checks the whole file's sha256.

  here:      python3 tools/train/pieces.py split --gguf PATH.gguf --part-mib 56
  GPU call:  python3 tools/train/pieces.py gather   (prints the joined path, exit 0 when complete)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS_DIR = REPO / ".traindata" / "teacher"
STASH = Path("/tmp/tinyloop-train/teacher")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split(gguf: Path, part_mib: float) -> None:
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    for old in PARTS_DIR.glob("part-*"):
        old.unlink()
    data = gguf.read_bytes()
    size = int(part_mib * (1 << 20))
    parts = []
    for i in range(-(-len(data) // size)):
        path = PARTS_DIR / f"part-{i}"
        path.write_bytes(data[i * size:(i + 1) * size])
        parts.append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
    manifest = {"file": gguf.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "parts": parts}
    (PARTS_DIR / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for p in parts:
        print(f"{PARTS_DIR / p['name']}: {p['bytes']} bytes")


def gather() -> int:
    manifest_path = PARTS_DIR / "parts.json"
    if not manifest_path.exists():
        print(f"{manifest_path} missing: carry .traindata/teacher/parts.json", file=sys.stderr)
        return 2
    manifest = json.loads(manifest_path.read_text())
    STASH.mkdir(parents=True, exist_ok=True)
    joined = STASH / manifest["file"]
    if joined.exists() and sha256(joined) == manifest["sha256"]:
        print(joined)
        return 0
    missing = []
    for p in manifest["parts"]:
        src, dst = PARTS_DIR / p["name"], STASH / p["name"]
        if src.exists() and sha256(src) == p["sha256"]:
            shutil.copyfile(src, dst)
        if not (dst.exists() and sha256(dst) == p["sha256"]):
            missing.append(p["name"])
    if missing:
        print(f"teacher parts still missing: {missing} (stash {STASH}); carry them in the next call",
              file=sys.stderr)
        return 1
    with open(joined, "wb") as f:
        for p in manifest["parts"]:
            f.write((STASH / p["name"]).read_bytes())
    if sha256(joined) != manifest["sha256"]:
        joined.unlink()
        print("joined teacher has the wrong sha256", file=sys.stderr)
        return 1
    print(joined)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--gguf", required=True)
    s.add_argument("--part-mib", type=float, default=56,
                   help="largest part; the first call carries part-0, the second the rest + tokens")
    sub.add_parser("gather")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        split(Path(args.gguf), args.part_mib)
        return 0
    return gather()


if __name__ == "__main__":
    sys.exit(main())
