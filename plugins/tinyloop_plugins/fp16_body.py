"""The `fp16_body` mode: the loop body's weights held as fp16 (docs/plugins.md).

A looped model reads its loop body (the core blocks, and a concat injection's W_a) L
times per token. This mode decodes those matrices once at load (q8/q4/q2:
w = scale * q + min; bf16/f32 values) and keeps them as fp16, so the body's matmuls run
on float weights with no per-read decoding, at the price of memory (2 bytes a weight
instead of the file's 0.25..1.06). The prelude, coda, norms, biases and embedding stay
as stored. Whether it is faster depends on the backend and the batch: see
docs/benchmarks.md ("fp16 body").

    [modes.fp16_body]
    dtype = "f16"   # or "f32": the decoded values exactly, for exactness studies

It sets the load option body_dtype (tl_load_options). It changes weights, not the
schedule, so it combines with every other mode. A model without a loop body
(n_core = 0) is refused at load.
"""

from tinyloop.plugins import Option, Plugin


def _configure_load(config, load_options):
    load_options["body_dtype"] = config["dtype"]


PLUGIN = Plugin(
    name="fp16_body",
    description="the loop body's weight matrices decoded at load and held as fp16 (or f32)",
    options=(
        Option("dtype", str, "f16", "f16: rounded to fp16 (the mode); f32: the decoded values "
               "exactly (twice the memory of f16, for exactness studies)",
               choices=("f16", "f32")),
    ),
    configure_load=_configure_load,
    conflicts=frozenset(),
)
