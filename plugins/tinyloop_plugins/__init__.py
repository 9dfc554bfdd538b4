"""Built-in runtime modes of TinyLoop.

Each built-in is a `tinyloop.plugins.Plugin` and is registered exactly like a
third-party plugin (docs/plugins.md), except that it is listed here instead of in an
entry point. The registry calls `builtin_plugins()` once per process.

Shipped: `speculative` (self-speculative decoding), `tree_speculative` (tree
speculation, greedy and sampled), `kv_share` (loop iterations share K/V slots,
approximate) and `paged_kv` (KV caches in shared pages of a pool) and `fp16_body` (the loop body's
weights held as fp16). More will be
added as a module of this package and listed in `builtin_plugins`.
"""


def builtin_plugins() -> list:
    """The Plugin values this package provides, in registration order."""
    from .fp16_body import PLUGIN as fp16_body
    from .kv_share import PLUGIN as kv_share
    from .speculative import PLUGIN as speculative
    from .paged_kv import PLUGIN as paged_kv
    from .tree_speculative import PLUGIN as tree_speculative
    return [speculative, tree_speculative, kv_share, paged_kv, fp16_body]
