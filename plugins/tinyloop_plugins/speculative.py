"""The `speculative` mode: self-speculative decoding (docs/plugins.md).

Drafts of `n_draft` tokens come from the model itself at the shallow loop depth
`draft_depth`, sharing the context's cache, and one pass at the generation's depth
verifies them all: greedy, the tokens are those of plain greedy decoding; sampling
(temperature > 0 or a penalty), they follow plain sampling's distribution (speculative
sampling). The library does the work (tl_generate_options.draft_depth / n_draft); this
mode only switches it on from TOML, for every generation of the model (add_drafts: not
for one that sets its own draft_depth, or uses logprobs, a grammar, logit_bias or
presence / frequency penalties, which drafts do not support):

    [modes.speculative]
    draft_depth = -1    # the model file's draft.depth (2 for the shipped model), else 1
    n_draft = 0         # the model file's draft.n_draft (2 for the shipped model), else 4
    draft_p_min = 0.0   # stop drafting at a draft less sure than this; 0 = never
    draft_vocab = -1    # drafts score the file's N most frequent tokens; 0 = all of them

draft_vocab is a load option (tl_load_options.draft_vocab): the drafts' rows of the
output head are copied once when the model loads.
"""

from tinyloop.plugins import Option, Plugin
from tinyloop_plugins import add_drafts


def _configure_generate(config, generate_options):
    add_drafts(generate_options, draft_depth=config["draft_depth"], n_draft=config["n_draft"],
               draft_p_min=config["draft_p_min"])


def _configure_load(config, load_options):
    load_options["draft_vocab"] = config["draft_vocab"]


PLUGIN = Plugin(
    name="speculative",
    description="drafts at a shallow loop depth, verified at the full depth",
    options=(
        Option("draft_depth", int, -1, "loop depth of the drafts (at most the generation's); "
               "-1 = the model file's draft.depth, else 1", minimum=-1),
        Option("n_draft", int, 0, "tokens drafted per verification; 0 = the model file's "
               "draft.n_draft, else 4", minimum=0, maximum=32),
        Option("draft_p_min", float, 0.0, "a round stops drafting at a draft whose most likely "
               "token is less likely than this (0 = never)", minimum=0.0, maximum=1.0),
        Option("draft_vocab", int, -1, "drafts score only this many of the most frequent tokens "
               "(the file's vocab.frequency); -1 = the file's draft.vocab_size, 0 = every token",
               minimum=-1),
    ),
    configure_load=_configure_load,
    conflicts=frozenset({"tree_speculative"}),
    configure_generate=_configure_generate,
)
