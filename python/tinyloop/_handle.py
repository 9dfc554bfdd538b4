"""The lifetime of native handles: the base classes of every object that owns one
(Model, Context, TokenStream, PrefixCache, PrefixPool, Grammar)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from .errors import TinyLoopError

if TYPE_CHECKING:
    from .model import Model

_Handle = TypeVar("_Handle", bound="NativeHandle")


class NativeHandle:
    """Owns a native handle (`_handle`, None once freed), freed by close(), by the
    with-statement or when collected. Subclasses free it in _free(handle)."""

    _handle: Any = None   # a cffi pointer

    def _free(self, handle: Any) -> None:
        raise NotImplementedError

    def _collectable(self) -> bool:
        """Whether collection may free the handle."""
        return True

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Free the handle; idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._free(handle)

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._handle is not None and self._collectable():
            self.close()


class ModelChild(NativeHandle):
    """A native handle that lives on a model (`_model`): the model's close() closes it
    first, and it refuses use once either is closed."""

    #: what "... is closed" calls it (default: the class name)
    _kind: str | None = None
    _model: "Model"

    def _adopt(self, handle: Any) -> None:
        """Take ownership of a new handle; the model closes it when it closes."""
        self._handle = handle
        self._model._children.add(self)

    def _require_open(self) -> Any:
        self._model._require_open()
        if self._handle is None:
            raise TinyLoopError(f"{self._kind or type(self).__name__} is closed")
        return self._handle

    def _collectable(self) -> bool:
        # once the model is freed, a handle it did not close (collected together with it)
        # must not be touched any more
        return not self._model.closed
