"""The `paged_kv` mode: KV caches in pages from a pool of the model's (docs/plugins.md).

Every context of the model (tl_generate, streams, scoring, the server) holds its K/V in
pages of `page_size` positions, taken as its sequence grows and given back when it is
truncated, reset or freed, so KV memory follows the tokens held rather than max_seq_len x
max_depth per context; forks, prefix caches and prefix-pool entries share pages instead of
copying rows (a shared page is copied before it is written). Results are those of the
contiguous cache (docs/api.md, "Paged KV"):

    [modes.paged_kv]
    page_size = 16    # positions per page, a power of two in [1, 4096]
    pool_mb = 0       # cap on the pool in MiB (0 = none): past it an append fails with
                      # TinyLoopError out of memory and the sequence is kept as it was

It sets the load options kv_page_size / kv_pool_bytes (tl_load_options). It works with
every other mode (speculative and tree speculative decoding, kv_share).
"""

from tinyloop.errors import ConfigError
from tinyloop.plugins import Option, Plugin

PAGE_MAX = 4096


def _configure_load(config, load_options):
    size = config["page_size"]
    if size & (size - 1):
        key = "modes.paged_kv.page_size"
        raise ConfigError(f"{key}: {size} is not a power of two in [1, {PAGE_MAX}]", key=key)
    load_options["kv_page_size"] = size
    load_options["kv_pool_bytes"] = config["pool_mb"] << 20


PLUGIN = Plugin(
    name="paged_kv",
    description="KV caches in shared, reference-counted pages (memory follows the tokens held)",
    options=(
        Option("page_size", int, 16, "positions per KV page, a power of two in [1, 4096]",
               minimum=1, maximum=PAGE_MAX),
        Option("pool_mb", int, 0, "cap on the page pool in MiB; 0 = no cap",
               minimum=0, maximum=2**43 - 1),
    ),
    configure_load=_configure_load,
)
