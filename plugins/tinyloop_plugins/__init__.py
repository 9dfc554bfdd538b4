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


#: generation options the library does not combine with drafts (tinyloop.h: "not with
#: draft_depth")
UNDRAFTABLE = ("logprobs", "grammar", "logit_bias", "presence_penalty", "frequency_penalty")


def add_drafts(generate_options: dict, **drafting) -> None:
    """A speculative mode's configure_generate: set its drafting options on a generation,
    unless the generation drafts on its own (draft_depth set) or uses what drafts cannot
    (UNDRAFTABLE, or an exit rule that stops loops early); such a generation runs as asked.
    Drafts change the speed only: greedy, the tokens are plain decoding's, sampled, they
    follow its distribution."""
    if generate_options.get("draft_depth") or any(generate_options.get(k) for k in UNDRAFTABLE):
        return
    if _exits_early(generate_options.get("exit")):
        return
    generate_options.update(drafting)


def _exits_early(value) -> bool:
    from tinyloop.exit_rule import exit_rule
    rule = exit_rule(value)
    return rule is not None and rule.active
