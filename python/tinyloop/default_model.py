"""The model used when none is named: the one shipped inside the package.

The package carries its models in `tinyloop/models/`: `<name>.tinyloop` and its card,
`<name>.md`, next to it. `tinyloop-smollm2-looped` is the default (docs/models.md).
`$TINYLOOP_DEFAULT_MODEL` (a model file or a name `tinyloop pull` cached) replaces it,
e.g. for tests or for a user who prefers another model; the card of such a model is the
`.md` file with the same name next to it, if there is one.

This module only finds files (also a named model's, resolve_model); loading is
tinyloop.Model's job (Model.default()).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelIOError

DEFAULT_MODEL_NAME = "tinyloop-smollm2-looped"
OVERRIDE_VARIABLE = "TINYLOOP_DEFAULT_MODEL"
MODEL_SUFFIX = ".tinyloop"
CARD_SUFFIX = ".md"

# Installed by python/tinyloop/meson.build (install_subdir); in a source checkout and in
# editable installs this is the source folder itself.
MODELS_DIR = Path(__file__).resolve().parent / "models"


class DefaultModelMissingError(ModelIOError):
    """No model was named and the default model file is not there."""


@dataclass(frozen=True)
class DefaultModel:
    path: Path
    card_path: Path | None
    source: str  # "package" or the override variable's name

    def card(self) -> str | None:
        """The card's markdown text, or None when the model has no card."""
        if self.card_path is None:
            return None
        return self.card_path.read_text(encoding="utf-8")


def packaged_model_path() -> Path:
    """The default model's file inside the package (also what its name resolves to)."""
    path = MODELS_DIR / f"{DEFAULT_MODEL_NAME}{MODEL_SUFFIX}"
    if not path.is_file():
        raise DefaultModelMissingError(
            f"the default model {DEFAULT_MODEL_NAME} is not in this installation ({path} "
            "does not exist: the package was built from a source tree without the trained "
            "file). Name a model: a .tinyloop file, or a pulled name such as smollm2-135m "
            f"after `tinyloop pull smollm2-135m`; or set {OVERRIDE_VARIABLE} to one")
    return path


def card_path_for(model_path: Path) -> Path | None:
    """`X.md` next to `X.tinyloop`, when it exists."""
    card = Path(model_path).with_suffix(CARD_SUFFIX)
    return card if card.is_file() else None


def resolve_model(name_or_path: str | os.PathLike[str], *, strict: bool = True) -> str:
    """What a MODEL argument names: a model file path (a GGUF file: its cached conversion,
    made on first use), the package's model by its name, or the cached file of a name
    `tinyloop pull` fetched (a known name, hf:ORG/NAME[/FILE][@REVISION]).

    strict=False (Model()): anything else is returned as given, for the loader to report."""
    from .convert.hub import is_hub_name
    from .convert.pull import KNOWN_MODELS, resolve_model_name
    name = os.fspath(name_or_path)
    exists = Path(name).exists()
    if name == DEFAULT_MODEL_NAME and not exists:
        return str(packaged_model_path())
    if not strict and not exists and name not in KNOWN_MODELS and not is_hub_name(name):
        return name
    return str(resolve_model_name(name))


def _from_override(value: str) -> Path:
    path = Path(value)
    if path.is_file():
        return path
    from .convert.pull import resolve_model_name  # a pulled name; imported only when needed
    try:
        return Path(resolve_model_name(value))
    except ModelIOError as e:
        raise ModelIOError(f"{OVERRIDE_VARIABLE}={value}: {e}") from None


def resolve_default_model() -> DefaultModel:
    """$TINYLOOP_DEFAULT_MODEL when set (and not empty), else the package's model.

    Raises DefaultModelMissingError when the package's file is missing, ModelIOError when
    the variable names nothing that exists."""
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        path = _from_override(override)
        return DefaultModel(path=path, card_path=card_path_for(path), source=OVERRIDE_VARIABLE)
    path = packaged_model_path()
    return DefaultModel(path=path, card_path=card_path_for(path), source="package")


def default_model_path() -> Path:
    return resolve_default_model().path


def default_model_card() -> str | None:
    """The default model's card, or None when it has none (only possible through the
    override: the package ships its card with the model)."""
    return resolve_default_model().card()
