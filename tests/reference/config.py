"""Model configuration as the oracle reads it: the header dims plus the architecture
metadata keys of docs/format.md, with the defaults that page gives for missing keys."""

from dataclasses import dataclass, fields

# metadata key -> (field name, default); None defaults depend on the dims (see below).
_ARCH_KEYS = {
    "arch.norm_placement": ("norm_placement", "pre"),
    "arch.norm_type": ("norm_type", "rmsnorm"),
    "arch.norm_unit_offset": ("norm_unit_offset", 0),
    "arch.norm_eps": ("norm_eps", 1e-5),
    "arch.rope_style": ("rope_style", "half"),
    "arch.rope_theta": ("rope_theta", 10000.0),
    "arch.rope_dims": ("rope_dims", None),           # head_dim
    "arch.activation": ("activation", "silu"),
    "arch.qkv_bias": ("qkv_bias", 0),
    "arch.sliding_window": ("sliding_window", 0),
    "arch.attn_scale": ("attn_scale", None),         # 1 / sqrt(head_dim)
    "arch.embed_scale": ("embed_scale", 1.0),
    "arch.tied_embeddings": ("tied_embeddings", 1),
    "arch.final_norm": ("final_norm", 1),
    "loop.injection": ("injection", "add"),
    "loop.injection_bias": ("injection_bias", 0),
    "loop.state_init": ("state_init", "prelude"),
    "loop.noise_sigma": ("noise_sigma", 1.0),
    "loop.noise_seed": ("noise_seed", 0),
    "loop.norm": ("loop_norm", 0),
    "loop.post_norm": ("post_norm", 0),
    "loop.noise_truncation": ("noise_truncation", 0.0),
    "loop.exit_gate": ("exit_gate", 0),
    "loop.exit_rule": ("exit_rule", "none"),
    "loop.exit_threshold": ("exit_threshold", 1.0),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_dim: int
    n_pre: int
    n_core: int
    n_post: int
    default_depth: int
    max_depth: int
    max_seq_len: int
    norm_placement: str
    norm_type: str
    norm_unit_offset: int
    norm_eps: float
    rope_style: str
    rope_theta: float
    rope_dims: int
    activation: str
    qkv_bias: int
    sliding_window: int
    attn_scale: float
    embed_scale: float
    tied_embeddings: int
    final_norm: int
    injection: str
    injection_bias: int
    state_init: str
    noise_sigma: float
    noise_seed: int
    loop_norm: int
    post_norm: int
    noise_truncation: float
    exit_gate: int
    exit_rule: str
    exit_threshold: float
    #: a warm start's position 0 (no previous state) starts like this init: "prelude" for a
    #: file that declares warm, the file's own init when warm is chosen at run time
    #: (ReferenceModel.with_warm_start)
    warm_first: str = "prelude"

    @classmethod
    def from_header(cls, dims: dict, metadata: dict) -> "ModelConfig":
        values = dict(dims)
        for key, (name, default) in _ARCH_KEYS.items():
            values[name] = metadata.get(key, default)
        if values["rope_dims"] is None:
            values["rope_dims"] = dims["head_dim"]
        if values["attn_scale"] is None:
            values["attn_scale"] = dims["head_dim"] ** -0.5
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def resolve_depth(self, depth: int) -> int:
        """Depth 0 means the default; with no core blocks depth is ignored."""
        if self.n_core == 0:
            return 0
        depth = depth or self.default_depth
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth {depth} outside 1..{self.max_depth}")
        return depth
