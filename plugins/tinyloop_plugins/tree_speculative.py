"""The `tree_speculative` mode: tree speculation (docs/plugins.md, docs/api.md).

Each round drafts a small token tree at the shallow loop depth `draft_depth` (the top
`widths[0]` tokens after the pending one, then `widths[1]` under each of those, ...,
at most `budget` nodes) and verifies every node in one tree-masked pass at the
generation's depth; the longest path the verification agrees with is kept, plus the
verification's own next token. Greedy, the tokens are plain greedy decoding's; sampling,
the candidates are drawn from the draft's distribution and judged by multi-candidate
speculative sampling, so the tokens follow plain sampling's distribution. The library
does the work (tl_generate_options.tree_widths / tree_budget); this mode switches it on
for every generation of the model that can draft (add_drafts, as `speculative`):

    [modes.tree_speculative]
    draft_depth = -1       # the model file's draft.depth (2 for the shipped model), else 1
    widths = "3, 1, 1"     # branching per level, each 1..8, at most 8 levels
    budget = 0             # drafted nodes per round at most, 1..63; 0 = the shape's size
    draft_p_min = 0.0      # candidates less likely than this are not drafted; 0 = all
    draft_vocab = -1       # drafts score the file's N most frequent tokens; 0 = all
"""

from dataclasses import dataclass

from tinyloop.plugins import ErrorFactory, Option, Plugin, plain_error
from tinyloop_plugins import add_drafts

MAX_LEVELS = 8
MAX_WIDTH = 8


@dataclass(frozen=True)
class _Widths(Option):
    """Branching widths as a string of 1..MAX_LEVELS comma-separated ints, each
    1..MAX_WIDTH ("3, 1, 1"; config options are scalars); checked into a tuple."""

    def check(self, value, key: str, error: ErrorFactory = plain_error):
        value = super().check(value, key, error)
        parts = [part.strip() for part in value.split(",")] if value.strip() else []
        if not 1 <= len(parts) <= MAX_LEVELS:
            raise error(key, f"needs 1..{MAX_LEVELS} levels, got {len(parts)} in {value!r}")
        for level, part in enumerate(parts):
            # isascii and isdecimal: "²" is a digit to isdigit(), and no number to int()
            if not (part.isascii() and part.isdecimal()) or not 1 <= int(part) <= MAX_WIDTH:
                raise error(key, f"level {level}: expected an int in 1..{MAX_WIDTH}, got {part!r}")
        return tuple(int(part) for part in parts)


def _configure_generate(config, generate_options):
    add_drafts(generate_options, draft_depth=config["draft_depth"], tree=config["widths"],
               tree_budget=config["budget"], draft_p_min=config["draft_p_min"])


def _configure_load(config, load_options):
    load_options["draft_vocab"] = config["draft_vocab"]


PLUGIN = Plugin(
    name="tree_speculative",
    description="token trees drafted at a shallow loop depth, verified in one pass",
    options=(
        Option("draft_depth", int, -1, "loop depth of the drafts (at most the generation's); "
               "-1 = the model file's draft.depth, else 1", minimum=-1),
        _Widths("widths", str, "3, 1, 1", "branching per level of the drafted tree, comma "
                f"separated, each 1..{MAX_WIDTH}, at most {MAX_LEVELS} levels"),
        Option("budget", int, 0, "drafted nodes per round at most; 0 = the shape's size (at "
               "most 63)", minimum=0, maximum=63),
        Option("draft_p_min", float, 0.0, "a candidate less likely than this (by the draft's "
               "distribution) is not drafted; 0 = every candidate of the shape", minimum=0.0, maximum=1.0),
        Option("draft_vocab", int, -1, "drafts score only this many of the most frequent tokens "
               "(the file's vocab.frequency); -1 = the file's draft.vocab_size, 0 = every token",
               minimum=-1),
    ),
    configure_load=_configure_load,
    conflicts=frozenset({"speculative"}),
    configure_generate=_configure_generate,
)
