"""Prefix caches and prefix pools (docs/python.md, "Prefix caches and pools").

A PrefixCache is a read-only snapshot of a prompt prefix (a system prompt, few-shot
examples) computed once; contexts load it and continue exactly as if they had appended
those tokens. A PrefixPool holds many under a byte budget and lets generations start
from the longest one their prompt begins with; it may be shared by threads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _args
from ._handle import ModelChild
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .model import Model, Tokens

DEFAULT_POOL_BYTES = 256 << 20


class PrefixCache(ModelChild):
    """An immutable snapshot of a sequence's first tokens (see Model.prefix_cache and
    Context.prefix_cache). Loading it is thread-safe; close() releases this reference
    (a pool that holds the cache keeps its own)."""

    def __init__(self, model: "Model", handle: Any):
        self._model = model
        self._adopt(handle)
        native, ffi = model._native, model._native.ffi
        n, depth, size = ffi.new("size_t *"), ffi.new("int32_t *"), ffi.new("uint64_t *")
        native.check(native.lib.tl_prefix_cache_get_info(handle, n, depth, size))
        self.n_tokens, self.depth, self.bytes = int(n[0]), int(depth[0]), int(size[0])

    @classmethod
    def compute(cls, model: "Model", tokens: "Tokens", depth: int = 0) -> "PrefixCache":
        ids = _args.token_array(tokens, model.info.vocab_size)
        native, ffi = model._native, model._native.ffi
        out = ffi.new("tl_prefix_cache **")
        native.check(native.lib.tl_prefix_cache_create(
            model._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids),
            model._check_depth(depth), out))
        return cls(model, out[0])

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return f"<tinyloop.PrefixCache {self.n_tokens} tokens at depth {self.depth}, {self.bytes} bytes>"

    def _free(self, handle: Any) -> None:
        self._model._native.lib.tl_prefix_cache_free(handle)


class ResumeHandle(ModelChild):
    """An immutable snapshot of a sequence's first tokens with the loop state each
    position ended with (Context.resume_handle), which Model.resume_generate takes to a
    deeper loop depth without a new prefill. Independent of its context; close() frees it."""

    def __init__(self, model: "Model", handle: Any):
        self._model = model
        self._adopt(handle)
        native, ffi = model._native, model._native.ffi
        n, depth, size = ffi.new("size_t *"), ffi.new("int32_t *"), ffi.new("uint64_t *")
        native.check(native.lib.tl_resume_get_info(handle, n, depth, size))
        self.n_tokens, self.depth, self.bytes = int(n[0]), int(depth[0]), int(size[0])

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return f"<tinyloop.ResumeHandle {self.n_tokens} tokens at depth {self.depth}, {self.bytes} bytes>"

    def _free(self, handle: Any) -> None:
        self._model._native.lib.tl_resume_free(handle)


class PrefixPool(ModelChild):
    """A thread-safe set of prefix caches of one model within max_bytes (0 = no limit),
    least recently used evicted first. register_prompts=True makes every generation from
    the pool add its prompt. Use it with model.generate(..., pool=pool) / model.stream."""

    def __init__(self, model: "Model", max_bytes: int = DEFAULT_POOL_BYTES,
                 register_prompts: bool = False):
        self._model = model
        _args.boolean("register_prompts", register_prompts)
        native, ffi = model._native, model._native.ffi
        opts = ffi.new("tl_prefix_pool_options *")
        native.lib.tl_prefix_pool_options_default(opts)
        opts.max_bytes = _args.integer("max_bytes", max_bytes, minimum=0, maximum=2**64 - 1)
        opts.register_prompts = int(register_prompts)
        out = ffi.new("tl_prefix_pool **")
        native.check(native.lib.tl_prefix_pool_create(model._require_open(), opts, out))
        self._adopt(out[0])

    def add(self, tokens: "Tokens", depth: int = 0) -> None:
        """Compute `tokens` at `depth` (0 = the default) and hold them (a prefix already
        held is only marked as used)."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size)
        native, ffi = model._native, model._native.ffi
        native.check(native.lib.tl_prefix_pool_add(
            self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids),
            model._check_depth(depth), ffi.NULL))

    def add_cache(self, cache: PrefixCache) -> None:
        """Hold an existing cache (the pool takes its own reference)."""
        if not isinstance(cache, PrefixCache):
            raise TypeError(f"cache must be a PrefixCache, not {type(cache).__name__}")
        self._model._native.check(self._model._native.lib.tl_prefix_pool_add_cache(
            self._require_open(), cache._require_open()))

    def lookup(self, prompt: "Tokens", depth: int = 0) -> int:
        """The length of the longest held prefix that `prompt` (token ids) starts with,
        computed at `depth`; 0 when none (marks the match as used)."""
        model = self._model
        ids = _args.token_array(prompt, model.info.vocab_size, min_length=0)
        native, ffi = model._native, model._native.ffi
        out, matched = ffi.new("tl_prefix_cache **"), ffi.new("size_t *")
        native.check(native.lib.tl_prefix_pool_lookup(
            self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids),
            model._check_depth(depth), out, matched))
        native.lib.tl_prefix_cache_free(out[0])
        return int(matched[0])

    def stats(self) -> dict[str, int]:
        """prefixes held, their bytes, max_bytes, hits, misses and evicted (counts)."""
        native, ffi = self._model._native, self._model._native.ffi
        c = ffi.new("tl_prefix_pool_stats *")
        native.lib.tl_prefix_pool_stats_default(c)
        native.check(native.lib.tl_prefix_pool_get_stats(self._require_open(), c))
        return {"prefixes": int(c.n_prefixes), "bytes": int(c.bytes), "max_bytes": int(c.max_bytes),
                "hits": int(c.n_hits), "misses": int(c.n_misses), "evicted": int(c.n_evicted)}

    def _free(self, handle: Any) -> None:
        self._model._native.lib.tl_prefix_pool_free(handle)


def pool_handle(model: "Model", pool: object) -> Any:
    """The handle of a pool argument of a generation on `model`."""
    if not isinstance(pool, PrefixPool):
        raise TypeError(f"pool must be a tinyloop.PrefixPool, not {type(pool).__name__}")
    if pool._model is not model:
        raise InvalidArgumentError("the prefix pool belongs to another model")
    return pool._require_open()
