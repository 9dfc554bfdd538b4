"""Independent float64 numpy oracle of the TinyLoop model family (docs/model.md)."""

from .config import ModelConfig
from .model import ReferenceModel

__all__ = ["ModelConfig", "ReferenceModel"]
