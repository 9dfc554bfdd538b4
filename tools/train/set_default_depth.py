"""Copy a .tinyloop with another default loop depth; tensors and metadata unchanged.

The default depth is chosen after evaluation (the depth with the lowest held-out
perplexity), when the training run's fp16 weights may no longer be at hand. Re-exporting
from a rebuilt weights folder would quantize the q4 values a second time; this copies
every tensor's bytes as they are and changes only the header's default_depth.

  python3 tools/train/set_default_depth.py IN.tinyloop OUT.tinyloop --depth 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from tinyloop.format import TinyLoopWriter, read_file  # noqa: E402


def copy_with_default_depth(src: str, dst: str, depth: int) -> None:
    if Path(src).resolve() == Path(dst).resolve():
        raise SystemExit("OUT must differ from IN: the input is read while the output is written")
    with read_file(src, verify_checksums=True) as f:
        if not 1 <= depth <= f.dims["max_depth"]:
            raise SystemExit(f"--depth {depth} is outside 1..{f.dims['max_depth']} (the file's max_depth)")
        writer = TinyLoopWriter({**f.dims, "default_depth": depth})
        for key, value in f.metadata.items():
            writer.add_metadata(key, value)
        for name, e in f.tensors.items():
            # a copy: views into the mapping would keep it from closing
            writer.add_raw_tensor(name, e.dtype, e.shape, e.group_size, bytes(f.raw(name)))
        writer.write(dst)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--depth", type=int, required=True)
    args = ap.parse_args(argv)
    copy_with_default_depth(args.src, args.dst, args.depth)
    with read_file(args.dst, verify_checksums=True) as f:
        print(f"wrote {args.dst}: default depth {f.dims['default_depth']}, {len(f.tensors)} tensors")


if __name__ == "__main__":
    main()
