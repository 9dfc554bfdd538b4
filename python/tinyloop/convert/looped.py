"""The looped families' importers by model_type (docs/convert.md): Huginn, Ouro, Nanbeige."""

from __future__ import annotations

from pathlib import Path

from .from_huginn import MODEL_TYPE as HUGINN, convert_huginn
from .from_nanbeige import MODEL_TYPE as NANBEIGE, convert_nanbeige
from .from_ouro import MODEL_TYPE as OURO, convert_ouro
from .hf_checkpoint import ImportOptions, read_json

FAMILIES = {HUGINN: convert_huginn, OURO: convert_ouro, NANBEIGE: convert_nanbeige}


def model_type(directory) -> str | None:
    """config.json's model_type of a checkpoint directory (None without one)."""
    return read_json(Path(directory) / "config.json", required=True).get("model_type")


def is_looped(directory) -> bool:
    return model_type(directory) in FAMILIES


def convert_looped(src, dst, *, state_init: str = "zeros", noise_seed: int = 0, **options) -> dict:
    """Convert a Huginn / Ouro / Nanbeige checkpoint directory into `dst`. `options` are the
    fields of ImportOptions (dtype keep | f32 | f16 | bf16 | q8 | q4 | q2, group_size,
    method, embed_dtype, max_depth, max_seq_len, ignore_config_keys, show_progress);
    state_init and noise_seed are Huginn's."""
    kind = model_type(src)
    opts = ImportOptions(**options)
    if kind == HUGINN:
        return convert_huginn(src, dst, opts, state_init=state_init, noise_seed=noise_seed)
    if state_init != "zeros" or noise_seed:
        raise ValueError(f"state_init and noise_seed are Huginn's options; {src} is model_type {kind!r}")
    if kind not in FAMILIES:
        raise ValueError(f"{src}: model_type {kind!r} is not a looped family ({sorted(FAMILIES)})")
    return FAMILIES[kind](src, dst, opts)
