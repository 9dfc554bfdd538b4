"""Built-in runtime modes of TinyLoop.

Each built-in is a `tinyloop.plugins.Plugin` (the module's PLUGIN) registered exactly
like a third-party plugin (docs/plugins.md): as an entry point of the
`tinyloop.plugins` group, declared in tinyloop's pyproject.toml.

Shipped: `speculative` (self-speculative decoding), `tree_speculative` (tree
speculation, greedy and sampled), `kv_share` (loop iterations share K/V slots,
approximate), `paged_kv` (KV caches in shared pages of a pool) and `fp16_body` (the loop
body's weights held as fp16). A new one is a module of this package with a PLUGIN and
a line in pyproject.toml's [project.entry-points."tinyloop.plugins"].
"""


def builtin_plugins() -> list:
    """The Plugin values this package provides, in the order of their entry points."""
    from tinyloop.plugins import builtin_entry_points
    return [ep.load() for ep in builtin_entry_points()]
