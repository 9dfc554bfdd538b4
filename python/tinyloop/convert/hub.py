"""`pull("hf:ORG/NAME")`: a Hugging Face Hub repository converted into the model cache.

Downloads go through huggingface_hub (`hf_hub_download`), so its cache ($HF_HUB_CACHE),
progress bars, tokens ($HF_TOKEN, `hf auth login`), mirrors ($HF_ENDPOINT) and offline
mode ($HF_HUB_OFFLINE) apply as they do for other libraries.
A repository with `config.json` and safetensors weights goes through the Hugging Face
checkpoint importers (Llama / Mistral / Qwen2, the looped families); a GGUF repository
through the GGUF importer, one file of it (`--file`, or the only one it has).

Names: `hf:ORG/NAME[/FILE][@REVISION]`; `tinyloop pull hf:ORG/NAME --file F --revision R`
is `hf:ORG/NAME/F@R`. The cache entry belongs to the name as asked, and its manifest
records the commit and files it was made from: a second pull of a branch converts again
only when the branch moved.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..errors import TinyLoopError
from .cache import CacheEntry
from .progress import note

PREFIX = "hf:"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# read by the checkpoint importers when present; nothing else of the repo is downloaded
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
LOGIN_HINT = ("log in with `hf auth login` (`huggingface-cli login` with huggingface_hub "
              "before 1.0) or set HF_TOKEN to an access token")


class HubError(TinyLoopError):
    """A Hub repository could not be listed, downloaded or converted."""


@dataclass(frozen=True)
class HubModel:
    repo: str
    revision: str | None = None
    file: str | None = None  # a GGUF file's path inside the repository

    @property
    def name(self) -> str:
        """The canonical name: what `tinyloop list` shows and Model() resolves."""
        return (PREFIX + self.repo + (f"/{self.file}" if self.file else "")
                + (f"@{self.revision}" if self.revision else ""))

    @property
    def key(self) -> str:
        # repo ids have no "--" and quote() escapes "@" and "/": the key is unambiguous
        org, name = self.repo.split("/")
        key = f"hf--{org}--{name}"
        if self.file:
            key += "--" + quote(self.file, safe="")
        if self.revision:
            key += "@" + quote(self.revision, safe="")
        return key


def is_hub_name(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse_name(name: str, *, revision: str | None = None, file: str | None = None) -> HubModel:
    """`hf:ORG/NAME[/FILE][@REVISION]`, with `revision` / `file` given apart (as --revision
    and --file) when the name does not carry them."""
    if not is_hub_name(name):
        raise HubError(f"{name!r}: a Hugging Face model is named hf:ORG/NAME")
    body = name[len(PREFIX):]
    if "@" in body:
        body, named_revision = body.rsplit("@", 1)
        if not named_revision:
            raise HubError(f"{name!r}: nothing after '@' (the revision: a branch, tag or commit)")
        if revision is not None and revision != named_revision:
            raise HubError(f"{name!r} names revision {named_revision!r} and --revision {revision!r}")
        revision = named_revision
    parts = body.split("/", 2)
    if len(parts) < 2 or not all(parts[:2]):
        raise HubError(f"{name!r}: a Hugging Face model is named hf:ORG/NAME (e.g. "
                       "hf:HuggingFaceTB/SmolLM2-135M-Instruct)")
    repo = "/".join(parts[:2])
    if len(parts) == 3 and parts[2]:
        if file is not None and file != parts[2]:
            raise HubError(f"{name!r} names file {parts[2]!r} and --file {file!r}")
        file = parts[2]
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise HubError(f"{name!r}: {e}") from None
    if file is not None and not file.endswith(".gguf"):
        raise HubError(f"--file {file!r}: --file picks one GGUF file of a repository (a .gguf "
                       "path inside it); a safetensors repository is pulled whole")
    return HubModel(repo, revision or None, file or None)


# ---------------------------------------------------------------- errors

def _network_errors() -> tuple:
    """Exceptions that mean the Hub could not be reached (huggingface_hub 1.x+ uses httpx,
    earlier releases requests)."""
    from huggingface_hub.utils import OfflineModeIsEnabled
    found = [OfflineModeIsEnabled]
    for module, names in (("httpx", ("TransportError",)), ("httpx2", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(m, n) for n in names if hasattr(m, n)]
    return tuple(found)


class HubUnreachable(HubError):
    """The Hub could not be reached (offline mode or no network) and its cache lacks what
    was asked."""


def _logged_in() -> bool:
    try:
        from huggingface_hub import get_token
    except ImportError:  # before 0.22
        from huggingface_hub import HfFolder
        return HfFolder.get_token() is not None
    return get_token() is not None


@contextlib.contextmanager
def _hub_errors(model: HubModel):
    """huggingface_hub's exceptions as HubErrors that say what to do."""
    from huggingface_hub import utils as hf
    try:
        yield
    except hf.GatedRepoError:
        raise HubError(f"{model.name}: a gated repository; accept its conditions on "
                       f"https://huggingface.co/{model.repo} and "
                       + (LOGIN_HINT if not _logged_in() else "use a token of that account")) from None
    except hf.RepositoryNotFoundError:
        raise _not_found(model) from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{model.name}: no revision {model.revision!r} (a branch, tag or "
                       "commit of the repository)") from None
    except hf.EntryNotFoundError as e:  # also a file missing from the cache when offline
        if isinstance(e, hf.LocalEntryNotFoundError):
            raise HubUnreachable(f"{model.name}: {_offline_reason()}, and the Hugging Face "
                                 f"cache does not hold the files ({e})") from None
        raise HubError(f"{model.name}: {e}") from None
    except _network_errors() as e:
        raise HubUnreachable(f"{model.name}: {_offline_reason()} ({type(e).__name__}: {e}); "
                             "pull again: files already downloaded are kept") from None
    except hf.HfHubHTTPError as e:
        # the Hub says RepoNotFound itself; a mirror may answer a bare 401
        if getattr(getattr(e, "response", None), "status_code", None) == 401:
            raise _not_found(model) from None
        raise HubError(f"{model.name}: the Hub answered: {e}") from None


def _not_found(model: HubModel) -> HubError:
    if _logged_in():
        return HubError(f"{model.name}: repository not found, or your token cannot read it "
                        "(a private repository of another account?)")
    return HubError(f"{model.name}: repository not found, or private: to pull a private "
                    f"repository, {LOGIN_HINT}")


def _offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def _offline_reason() -> str:
    return ("HF_HUB_OFFLINE is set" if _offline()
            else "the Hugging Face Hub is unreachable (no network?)")


# ---------------------------------------------------------------- which files

def _hub_storage(model: HubModel) -> Path:
    """The repository's folder in huggingface_hub's cache (its documented layout:
    `models--ORG--NAME/refs/REVISION` holds a commit, `snapshots/COMMIT/...` the files)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=model.repo, repo_type="model")


def _record_ref(model: HubModel, commit: str) -> None:
    """Point the revision at `commit` in huggingface_hub's cache, as its own snapshot
    download does: files fetched by commit do not, and offline pulls look the name up."""
    revision = model.revision or "main"
    if _COMMIT.fullmatch(revision):
        return
    ref = _hub_storage(model) / "refs" / revision
    try:
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(ref.name + ".partial")
        partial.write_text(commit)
        os.replace(partial, ref)
    except OSError as e:  # a read-only shared cache: offline pulls then need the commit
        note(f"{model.name}: could not record {revision!r} -> {commit[:12]} in {ref}: {e}")


def _cached_listing(model: HubModel) -> tuple[str, list] | None:
    """(commit, files) of the revision in huggingface_hub's cache, or None."""
    storage = _hub_storage(model)
    revision = model.revision or "main"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return commit, files


def _listing(model: HubModel) -> tuple[str, list]:
    """The commit the revision names and the repository's files at it: from the Hub, or
    from huggingface_hub's cache when offline (then only the files downloaded before)."""
    from huggingface_hub import HfApi

    if not _offline():
        try:
            with _hub_errors(model):
                info = HfApi().model_info(model.repo, revision=model.revision)
                return info.sha, sorted(s.rfilename for s in (info.siblings or ()))
        except HubUnreachable:
            pass
    cached = _cached_listing(model)
    if cached is None:
        raise HubUnreachable(f"{model.name}: {_offline_reason()}, and the Hugging Face cache "
                             f"has no snapshot of {model.repo} at revision "
                             f"{model.revision or 'main'!r}: pull it once with network access")
    return cached


def choose_files(model: HubModel, files: list) -> tuple[str, list]:
    """("safetensors", the files to download) or ("gguf", [the GGUF file])."""
    top = [f for f in files if "/" not in f]
    ggufs = [f for f in files if f.endswith(".gguf")]
    if model.file is not None:
        if model.file not in files:
            offline = " (in the Hugging Face cache: the Hub is not reachable)" if _offline() else ""
            raise HubError(f"{model.name}: no file {model.file!r} in {model.repo}{offline}; "
                           f"its GGUF files: {_some(ggufs)}")
        return "gguf", [model.file]
    weights = [f for f in top if f.endswith(".safetensors")]
    if "config.json" in top and weights:
        if INDEX_NAME in top:
            weights = [INDEX_NAME]  # the shards it lists are chosen once it is downloaded
        elif SINGLE_NAME in top:
            weights = [SINGLE_NAME]
        return "safetensors", [f for f in SIDE_FILES if f in top] + weights
    if len(ggufs) == 1:
        return "gguf", ggufs
    if ggufs:
        raise HubError(f"{model.name}: {len(ggufs)} GGUF files; pick one with --file "
                       f"(or hf:{model.repo}/FILE): {_some(ggufs)}")
    bins = [f for f in top if f.endswith((".bin", ".pt", ".pth"))]
    extra = (f"; its PyTorch weights ({_some(bins)}) cannot be read: TinyLoop imports "
             "safetensors and GGUF") if bins else ""
    raise HubError(f"{model.name}: neither safetensors weights (config.json and *.safetensors) "
                   f"nor a GGUF file in the repository{extra}; files: {_some(files)}")


def _some(names: list, limit: int = 12) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---------------------------------------------------------------- download and convert

@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from huggingface_hub import utils as hf
    was_disabled = hf.are_progress_bars_disabled()
    if not enabled:
        hf.disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            hf.enable_progress_bars()


def _download(model: HubModel, commit: str, files: list) -> dict:
    """{repo path: local path} for `files` at `commit`, fetched (or found) by huggingface_hub."""
    from huggingface_hub import hf_hub_download

    local = {}
    with _hub_errors(model):
        for name in files:
            local[name] = Path(hf_hub_download(model.repo, name, revision=commit))
        if INDEX_NAME in local:
            with open(local[INDEX_NAME], encoding="utf-8") as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            for name in shards:
                local[name] = Path(hf_hub_download(model.repo, name, revision=commit))
    return local


def _convert(kind: str, local: dict, dst: Path, checkpoint: Path, show_progress: bool) -> dict:
    if kind == "gguf":
        from .from_gguf import convert_gguf
        (path,) = local.values()
        return convert_gguf(path, dst, show_progress=show_progress)
    # a folder of links to exactly the chosen files (a snapshot may hold other weights),
    # named as the repository: the importers name the model after their folder
    checkpoint.mkdir()
    for name, path in local.items():
        os.symlink(path.resolve(), checkpoint / name)
    from .looped import convert_looped, is_looped
    if is_looped(checkpoint):
        return convert_looped(checkpoint, dst, show_progress=show_progress)
    from .from_safetensors import convert_safetensors
    return convert_safetensors(checkpoint, dst, show_progress=show_progress)


def pull_hub(name: str, *, revision: str | None = None, file: str | None = None,
             force: bool = False, show_progress: bool = True) -> Path:
    """Download (or find in huggingface_hub's cache) and convert `hf:ORG/NAME` into the
    TinyLoop cache; the path of its .tinyloop file."""
    model = parse_name(name, revision=revision, file=file)
    entry = CacheEntry(model.key)
    try:
        commit, files = _listing(model)
    except HubUnreachable as e:
        if not force and entry.is_valid():
            note(f"{model.name}: {e}; using the converted copy made before, {entry.path}")
            return entry.path
        raise
    kind, chosen = choose_files(model, files)
    source = {"source": "hf", "name": model.name, "repo": model.repo, "revision": model.revision,
              "file": model.file, "commit": commit, "format": kind, "files": chosen}
    if not force and entry.matches(source):
        note(f"{model.name}: using cached {entry.path} (commit {commit[:12]})")
        return entry.path
    note(f"{model.name}: commit {commit[:12]}, {kind}: {_some(chosen)}")
    with _progress_bars(show_progress):
        local = _download(model, commit, chosen)
    _record_ref(model, commit)
    with entry.staging() as tmp:
        built = tmp / entry.path.name
        _convert(kind, local, built, tmp / model.repo.split("/")[1], show_progress)
        entry.install(built, source)
    note(f"{model.name}: ready at {entry.path}")
    return entry.path


def cached_path(name: str) -> Path:
    """The converted file of a pulled hf: name (it need not exist)."""
    return CacheEntry(parse_name(name).key).path
