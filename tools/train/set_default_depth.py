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
from tinyloop.errors import FormatError  # noqa: E402
from tinyloop.fileformat.tinyloop_file import copy_file, read_file  # noqa: E402


def copy_with_default_depth(src: str, dst: str, depth: int) -> None:
    with read_file(src) as f:
        max_depth = f.dims["max_depth"]
    if not 1 <= depth <= max_depth:
        raise SystemExit(f"--depth {depth} is outside 1..{max_depth} (the file's max_depth)")
    try:
        copy_file(src, dst, dims={"default_depth": depth})
    except FormatError as e:     # OUT == IN, a corrupt IN: a message, not a traceback
        raise SystemExit(str(e)) from None


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
