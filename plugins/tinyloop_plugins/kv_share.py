"""The `kv_share` mode: loop iterations share K/V slots (docs/plugins.md).

Every context of the model (tl_generate, streams, scoring, the server) caches one K/V
slot per core block (`share_last`) or a ring of `ring_slots` (`ring`) instead of one per
loop iteration: the KV cache of the loop shrinks by depth / slots. It is approximate by
design (docs/model.md, "Approximate KV policies": a later call sees an earlier position's
K/V as its last iteration with that slot wrote it), so it is only ever on by name:

    [modes.kv_share]
    policy = "share_last"   # or "ring"
    ring_slots = 0          # "ring": slots per core block (>= 1); "share_last": 0

It sets the load options kv_policy / kv_ring_slots (tl_load_options). Speculative
decoding needs the exact cache, so the two modes conflict.

`policy = "store_h"` names the other member of the kv_policy family here: exact, each
core block's input kept per iteration instead of its K/V, which are recomputed when
attended (docs/model.md, "The store_h KV policy"); less KV memory when d_model < 2 x
n_kv_head x head_dim, more compute per token. (Speculative decoding works under it
through the Python kv_policy option; the mode keeps its one conflict list.)
"""

from tinyloop.errors import ConfigError
from tinyloop.plugins import Option, Plugin


def _configure_load(config, load_options):
    ring, slots = config["policy"] == "ring", config["ring_slots"]
    if ring != (slots > 0):
        key = "modes.kv_share.ring_slots"
        raise ConfigError(f"{key}: " + ("policy 'ring' needs ring_slots >= 1" if ring else
                                         f"is {slots}, but only policy 'ring' uses it (leave 0)"),
                          key=key)
    load_options["kv_policy"] = config["policy"]
    load_options["kv_ring_slots"] = config["ring_slots"]


PLUGIN = Plugin(
    name="kv_share",
    description="loop iterations share K/V slots (approximate, less KV memory)",
    options=(
        Option("policy", str, "share_last", "share_last: one K/V slot per core block; ring: "
               "ring_slots of them, iteration i in slot (i - 1) mod ring_slots; store_h: exact, "
               "block inputs kept and K/V recomputed",
               choices=("share_last", "ring", "store_h")),
        Option("ring_slots", int, 0, "ring: slots per core block (>= 1); share_last: 0",
               minimum=0, maximum=2**31 - 1),
    ),
    configure_load=_configure_load,
    conflicts=frozenset({"speculative", "tree_speculative"}),
)
