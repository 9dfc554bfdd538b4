"""Re-quantize the matrices of a .tinyloop file (q8 / q4 / q2, rtn or search).

Every 2-D weight matrix is decoded to float64 and quantized with
tinyloop.fileformat.quantize; norms, biases and anything else are copied byte for byte.
The embedding and the untied head can get their own dtype (q8 keeps most of their
accuracy for little size) or be kept as they are.
"""

from __future__ import annotations

import os

from ..errors import FormatError
from ..fileformat.quantize import quantize
from ..fileformat.tinyloop_file import TinyLoopWriter, read_file
from .progress import Progress

QUANTIZER = "tinyloop.convert.quantize_model 1"
EMBEDDING_NAMES = ("embed.weight", "output.weight")
# one-row matrices whose every value matters: the exit gate (loop.exit_gate) stays a float
FLOAT_ONLY_NAMES = ("exit_gate.weight",)


def _target_dtype(name: str, ndim: int, dtype: str, embed_dtype: str | None) -> str | None:
    """The dtype to quantize `name` to, or None to copy it as is."""
    if ndim != 2 or name in FLOAT_ONLY_NAMES:
        return None
    if name in EMBEDDING_NAMES and embed_dtype is not None:
        return None if embed_dtype == "keep" else embed_dtype
    return dtype


def quantize_model(src, dst, *, dtype: str = "q4", group_size: int = 64, method: str = "rtn",
                   embed_dtype: str | None = None, show_progress: bool = True) -> dict:
    """Write `dst`: `src` with its matrices quantized to `dtype`.

    `embed_dtype`: None (same as `dtype`), "keep" (copy), or q8/q4/q2 for the embedding and
    the untied head."""
    if dtype not in ("q8", "q4", "q2"):
        raise ValueError(f"dtype must be q8, q4 or q2, got {dtype!r}")
    if embed_dtype not in (None, "keep", "q8", "q4", "q2"):
        raise ValueError(f"embed_dtype must be keep, q8, q4 or q2, got {embed_dtype!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("the output must be a different file than the input (the input is mmapped)")
    counts = {}
    with read_file(src) as f:
        writer = TinyLoopWriter(f.dims)
        for key, value in f.metadata.items():
            if key != "general.quantization":
                writer.add_metadata(key, value)
        writer.add_metadata("general.quantization", f"{QUANTIZER}: {dtype} group {group_size} {method}"
                            + (f", embeddings {embed_dtype}" if embed_dtype else ""))

        entries = list(f.tensors.values())
        total = sum(e.size for e in entries)
        progress = Progress(f"quantizing to {dtype}", show_progress)
        done = 0
        for e in entries:
            target = _target_dtype(e.name, len(e.shape), dtype, embed_dtype)
            if target is not None and e.shape[1] % group_size:
                raise FormatError(f"tensor {e.name!r}: {e.shape[1]} columns are not a multiple of "
                                  f"group size {group_size}")
            if target is None:
                writer.add_raw_tensor(e.name, e.dtype, e.shape, e.group_size, bytes(f.raw(e.name)))
                counts[e.dtype] = counts.get(e.dtype, 0) + 1
            else:
                writer.add_tensor(e.name, quantize(f.tensor(e.name), target, group_size, method))
                counts[target] = counts.get(target, 0) + 1
            done += e.size
            progress(done, total, e.name)
        progress.finish()

    progress = Progress(f"writing {os.path.basename(os.fspath(dst))}", show_progress)
    writer.write(dst, progress=progress)
    progress.finish()
    return {"tensors": counts}
