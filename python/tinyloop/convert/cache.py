"""The TinyLoop model cache: converted models and what they were made from.

One flat folder ($TINYLOOP_CACHE, else $XDG_CACHE_HOME/tinyloop, else ~/.cache/tinyloop).
Each entry is `<key>.tinyloop` and, beside it, `<key>.json`, its manifest: the name it is
known by (`smollm2-135m`, `hf:ORG/NAME`, a GGUF's path), its source and what identifies
the source's version (a Hub commit and file list, a GGUF's size and mtime). A manifest is
removed before its model file is replaced and written after it, so an interrupted update
leaves an entry without a manifest, which is converted again, never a stale pairing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from ..errors import FormatError, ModelIOError
from ..fileformat.tinyloop_file import read_file
from .progress import note

MODEL_SUFFIX = ".tinyloop"
MANIFEST_SUFFIX = ".json"


def cache_dir() -> Path:
    if os.environ.get("TINYLOOP_CACHE"):
        return Path(os.environ["TINYLOOP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tinyloop"


def current_converters() -> frozenset:
    """The `general.converter` values today's importers write; a cached file made by an
    older importer version is converted again."""
    from . import from_gguf, from_huginn, from_nanbeige, from_ouro, from_safetensors
    return frozenset(m.CONVERTER for m in (from_gguf, from_huginn, from_nanbeige, from_ouro,
                                           from_safetensors))


class CacheEntry:
    """`<cache>/<key>.tinyloop` and its manifest."""

    def __init__(self, key: str):
        self.key = key
        self.path = cache_dir() / f"{key}{MODEL_SUFFIX}"
        self.manifest_path = self.path.with_suffix(MANIFEST_SUFFIX)

    def manifest(self) -> dict | None:
        try:
            with open(self.manifest_path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def is_valid(self) -> bool:
        """The model file parses and came from a current importer."""
        try:
            with read_file(self.path) as f:
                return f.metadata.get("general.converter") in current_converters()
        except (FormatError, OSError):
            return False

    def matches(self, source: dict) -> bool:
        """A valid file whose manifest records exactly `source` (the fields that identify
        the source's version)."""
        manifest = self.manifest()
        if manifest is None or any(manifest.get(k) != v for k, v in source.items()):
            return False
        return self.is_valid()

    @contextlib.contextmanager
    def staging(self):
        """A temporary folder inside the cache dir (same file system: the finished model is
        moved into place atomically); removed afterwards, whatever happens."""
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ModelIOError(f"cannot create the cache dir {directory}: {e}") from e
        with tempfile.TemporaryDirectory(prefix="tinyloop-pull-", dir=directory) as tmp:
            yield Path(tmp)

    def install(self, built: Path, manifest: dict) -> Path:
        """Move the converted file `built` (inside staging()) into place with its manifest."""
        self.manifest_path.unlink(missing_ok=True)
        os.replace(built, self.path)  # atomic: a half-written model is never visible
        record = dict(manifest, converted_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        partial = self.manifest_path.with_name(self.manifest_path.name + ".partial")
        partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(partial, self.manifest_path)
        return self.path

    def remove(self) -> None:
        self.manifest_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def entries() -> list[dict]:
    """Every cached model: name, path, bytes and its manifest's fields (a file without a
    manifest, such as one an earlier version pulled, is named by its stem)."""
    directory = cache_dir()
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob(f"*{MODEL_SUFFIX}")):
        if not path.is_file():
            continue
        manifest = CacheEntry(path.stem).manifest() or {}
        found.append({**manifest, "name": manifest.get("name", path.stem), "key": path.stem,
                      "path": str(path), "bytes": path.stat().st_size})
    return found


def find_entry(name: str) -> CacheEntry | None:
    """The entry `tinyloop list` shows as `name` (or whose key is `name`)."""
    for e in entries():
        if name in (e["name"], e["key"]):
            return CacheEntry(e["key"])
    return None


# ---------------------------------------------------------------- GGUF files run directly

GGUF_MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _gguf_key(path: Path) -> str:
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)[:80]
    return f"gguf--{stem}-{digest}"


def converted_gguf(path, *, show_progress: bool | None = None) -> Path:
    """The cached conversion of a GGUF file, made on first use (with a note on stderr) and
    made again when the file's size or modification time changes."""
    from .from_gguf import convert_gguf

    # named by its absolute path as written, not through links: a GGUF in huggingface_hub's
    # cache is a link to a blob named by its hash
    src = Path(os.path.abspath(path))
    st = src.stat()
    source = {"source": "gguf", "name": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry = CacheEntry(_gguf_key(src))
    if entry.matches(source):
        return entry.path
    if show_progress is None:
        show_progress = _stderr_is_terminal()
    note(f"{path}: a GGUF file; converting it once into the TinyLoop cache ({entry.path})")
    with entry.staging() as tmp:
        built = tmp / entry.path.name
        convert_gguf(src, built, show_progress=show_progress)
        entry.install(built, source)
    note(f"{path}: converted; later runs load {entry.path} (`tinyloop rm {src}` removes it)")
    return entry.path


def _stderr_is_terminal() -> bool:
    import sys
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
