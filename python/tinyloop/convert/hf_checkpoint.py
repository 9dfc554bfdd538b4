"""A Hugging Face checkpoint directory as the looped-family importers read it.

config.json (required), the weights as one model.safetensors or shards listed by
model.safetensors.index.json, tokenizer.json / tokenizer_config.json / generation_config.json.
Tensors are memory-mapped views (a row range of one is a view too), so an importer holds one
tensor at a time and only while the output file is written (`TensorEmitter`, through the
writer's lazy tensors). Every problem is a FormatError naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import FormatError
from ..fileformat.tinyloop_file import TinyLoopWriter
from ..fileformat.quantize import concat_rows, quantize
from .from_safetensors import _add_bos, _first_id
from .progress import Progress, note

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ITEM = {"F32": ("f32", "<f4", 4), "F16": ("f16", "<f2", 2), "BF16": ("bf16", "<u2", 2)}
_HEADER_LIMIT = 100 << 20          # a safetensors JSON header beyond this is not a real one
# Keys of config.json that only describe training, loading or the file, never the function.
GENERIC_HARMLESS = frozenset({
    "_name_or_path", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "attention_dropout", "hidden_dropout", "return_dict", "output_attentions",
    "output_hidden_states", "torchscript", "is_encoder_decoder", "model_type", "name",
    "chunk_size_feed_forward", "tie_encoder_decoder", "pruned_heads", "id2label", "label2id",
    "problem_type", "tokenizer_class", "quantization_config",
})
QUANT_TARGETS = ("q8", "q4", "q2")
FLOAT_TARGETS = ("f32", "f16", "bf16")
TARGETS = ("keep",) + FLOAT_TARGETS + QUANT_TARGETS
_BLOCK_ELEMENTS = 1 << 22          # rows quantized at once: a bound on the import's memory


def read_json(path: Path, required: bool) -> dict:
    if not path.exists():
        if required:
            raise FormatError(f"{path} is missing")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- tensors

@dataclass(frozen=True)
class SourceTensor:
    """A tensor's bytes in one safetensors file: [offset, offset + nbytes) holds `shape`
    row-major in `dtype` (f32 / f16 / bf16)."""

    name: str
    path: Path
    dtype: str
    shape: tuple
    offset: int

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "f32" else 2

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def reshaped(self, *shape: int) -> "SourceTensor":
        if math.prod(shape) != math.prod(self.shape):
            raise FormatError(f"{self.path.name}: tensor {self.name!r} {list(self.shape)} cannot be "
                              f"viewed as {list(shape)}")
        return replace(self, shape=tuple(shape))

    def rows(self, start: int, stop: int) -> "SourceTensor":
        """Rows [start, stop) of a 2-D tensor (contiguous: a view of the same bytes)."""
        rows, cols = self.shape
        if not 0 <= start < stop <= rows:
            raise FormatError(f"tensor {self.name!r}: rows {start}..{stop} outside its {rows}")
        return replace(self, name=f"{self.name}[{start}:{stop}]", shape=(stop - start, cols),
                       offset=self.offset + start * cols * self.itemsize)

    def raw(self) -> memoryview:
        """The bytes, mapped read-only (nothing is read until used)."""
        return memoryview(np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                                    shape=(self.nbytes,)))

    def values(self) -> np.ndarray:
        """float32 values (bf16 and f16 widen exactly)."""
        item = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[self.dtype]
        data = np.memmap(self.path, dtype=item, mode="r", offset=self.offset, shape=self.shape)
        if self.dtype == "bf16":
            return (np.asarray(data, dtype=np.uint32) << 16).view(np.float32)
        return np.asarray(data, dtype=np.float32)


def _read_header(path: Path) -> tuple[dict, int]:
    """(the JSON header, the offset of the data) of a safetensors file, checked."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(_HEADER_LIMIT, size - 8):
                raise FormatError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e})") from None
    except ValueError as e:
        raise FormatError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    return header, 8 + n


def _file_tensors(path: Path) -> dict:
    header, base = _read_header(path)
    data_size = path.stat().st_size - base
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype not in _ITEM:
            raise FormatError(f"{path}: tensor {name!r} has dtype {dtype}; the importers read "
                              f"{sorted(_ITEM)}")
        want = math.prod(shape) * _ITEM[dtype][2]
        if not 0 <= start <= end <= data_size or end - start != want:
            raise FormatError(f"{path}: tensor {name!r} {dtype} {list(shape)} needs {want} bytes, "
                              f"its data_offsets {start}..{end} (file data {data_size} bytes) do not hold them")
        out[name] = SourceTensor(name, path, _ITEM[dtype][0], shape, base + start)
    return out


def _weight_files(directory: Path) -> dict:
    """name -> SourceTensor over the checkpoint's safetensors file(s)."""
    index_path = directory / INDEX_NAME
    if index_path.exists():
        index = read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FormatError(f"{index_path}: no weight_map")
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / str(shard)
            if not shard_path.exists():
                held = sorted(n for n, f in weight_map.items() if f == shard)
                raise FormatError(f"{shard_path} is missing ({index_path.name} lists it for "
                                  f"{len(held)} tensors, e.g. {held[0]!r})")
            for name, t in _file_tensors(shard_path).items():
                if weight_map.get(name) != shard:
                    raise FormatError(f"{shard_path}: holds tensor {name!r}, which {index_path.name} "
                                      f"places in {weight_map.get(name)!r}")
                tensors[name] = t
        for name, shard in weight_map.items():
            if name not in tensors:
                raise FormatError(f"{directory / str(shard)}: tensor {name!r} listed in "
                                  f"{index_path.name} is not in the file")
        return tensors
    single = directory / SINGLE_NAME
    if single.exists():
        return _file_tensors(single)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FormatError(f"{directory}: no {SINGLE_NAME}, no {INDEX_NAME} and no *.safetensors files")
    raise FormatError(f"{directory}: {len(shards)} safetensors files but no {INDEX_NAME} to say "
                      f"which tensors each holds")


# ---------------------------------------------------------------- the directory

class Checkpoint:
    """config.json, the weights and the tokenizer files of a checkpoint directory."""

    def __init__(self, directory):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FormatError(f"{self.directory}: not a checkpoint directory")
        self.config_path = self.directory / "config.json"
        self.config = read_json(self.config_path, required=True)
        self.tensors = _weight_files(self.directory)
        self._claimed: set = set()

    # -- config.json
    def has(self, key: str) -> bool:
        return key in self.config and self.config[key] is not None

    def require(self, key: str, kind: type = int):
        """config[key], which must be present and of `kind` (int accepts integral floats,
        float accepts ints)."""
        if key not in self.config or self.config[key] is None:
            raise FormatError(f"{self.config_path}: required key {key!r} is missing")
        return self._typed(key, self.config[key], kind)

    def get(self, key: str, default, kind: type | None = None):
        value = self.config.get(key)
        if value is None:
            return default
        return self._typed(key, value, kind or type(default))

    def _typed(self, key, value, kind):
        bad = FormatError(f"{self.config_path}: key {key!r} must be {kind.__name__}, got {value!r}")
        if kind is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise bad
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad
            return float(value)
        if not isinstance(value, kind):
            raise bad
        return value

    def refuse(self, key: str, why: str):
        raise FormatError(f"{self.config_path}: {key} = {json.dumps(self.config.get(key))} is not "
                          f"supported: {why}")

    def check_keys(self, family: str, used: Iterable[str], harmless: Iterable[str],
                   neutral: dict, ignore: Iterable[str] = ()) -> None:
        """Refuse config keys that would change the function: each key of `neutral` must be
        absent or pass its check (name -> (predicate, why)); keys neither used, harmless nor
        checked are refused as unknown, unless the caller asked to ignore them."""
        for key, (ok, why) in neutral.items():
            if key in self.config and not ok(self.config[key]):
                self.refuse(key, why)
        known = set(used) | set(harmless) | set(neutral) | GENERIC_HARMLESS | set(ignore)
        unknown = sorted(k for k in self.config if k not in known)
        if unknown:
            raise FormatError(f"{self.config_path}: unknown {family} config keys {unknown}: they may "
                              f"change the model's function, so the importer refuses them; if you know "
                              f"they do not, pass --ignore-config-key for each")

    # -- weights
    def tensor(self, name: str, shape: tuple | None = None) -> SourceTensor:
        """The checkpoint's tensor `name` (claimed: check_all_claimed refuses the others),
        of `shape` when given."""
        t = self.tensors.get(name)
        if t is None:
            raise FormatError(f"{self.directory}: tensor {name!r} is missing")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise FormatError(f"{t.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        self._claimed.add(name)
        return t

    def skip(self, name: str) -> None:
        """A tensor the import reads no weights from (a redundant tied head, a buffer)."""
        self._claimed.add(name)

    def check_all_claimed(self, family: str) -> None:
        left = sorted(set(self.tensors) - self._claimed)
        if left:
            t = self.tensors[left[0]]
            raise FormatError(f"{t.path}: tensor {left[0]!r} has no place in a {family} model "
                              f"({len(left)} unmapped tensors: {left[:6]}{' ...' if len(left) > 6 else ''})")

    def source_dtypes(self) -> str:
        return ",".join(sorted({t.dtype for t in self.tensors.values()}))

    # -- tokenizer files
    def tokenizer_metadata(self) -> list:
        """(key, value) metadata of tokenizer.json (stored unchanged), the chat template of
        tokenizer_config.json and BOS / EOS: generation_config.json's eos first (what
        generation stops on), then tokenizer_config.json's tokens, then config.json's ids."""
        tok_path = self.directory / "tokenizer.json"
        if not tok_path.exists():
            return []
        text = tok_path.read_text(encoding="utf-8")
        try:
            tok = json.loads(text)
        except ValueError as e:
            raise FormatError(f"{tok_path}: not JSON ({e})") from None
        tok_cfg = read_json(self.directory / "tokenizer_config.json", required=False)
        gen_cfg = read_json(self.directory / "generation_config.json", required=False)
        ids = _token_ids(tok)
        bos_token, eos_token = (_token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token"))
        bos = _first_id(self.config.get("bos_token_id"))
        if bos < 0 and bos_token in ids:
            bos = ids[bos_token]
        eos = _first_id(gen_cfg.get("eos_token_id"))
        if eos < 0 and eos_token in ids:
            eos = ids[eos_token]
        if eos < 0:
            eos = _first_id(self.config.get("eos_token_id"))
        meta = [("tokenizer.json", text), ("tokenizer.bos_id", bos), ("tokenizer.eos_id", eos),
                ("tokenizer.add_bos", int(bos >= 0 and _add_bos(tok_cfg, tok, bos_token)))]
        if isinstance(tok_cfg.get("chat_template"), str):
            meta.append(("tokenizer.chat_template", tok_cfg["chat_template"]))
        return meta


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_ids(tok: dict) -> dict:
    """Token text -> id of a tokenizer.json: its vocabulary and added tokens."""
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and "content" in added and "id" in added:
            ids[added["content"]] = int(added["id"])
    return ids


# ---------------------------------------------------------------- output

def group_for(cols: int, group_size: int) -> int:
    """The largest quantization group <= group_size that divides cols (0: none does)."""
    for g in (128, 64, 32):
        if g <= group_size and cols % g == 0:
            return g
    return 0


class TensorEmitter:
    """Adds tensors to a writer as lazy ones, converted as `dtype` asks when written:
    keep (the checkpoint's float dtype), f32 / f16 / bf16, or q8 / q4 / q2 for matrices
    (groups along the input dim; vectors keep their float dtype)."""

    def __init__(self, writer: TinyLoopWriter, dtype: str = "keep", group_size: int = 64,
                 method: str = "rtn", embed_dtype: str | None = None):
        if dtype not in TARGETS:
            raise ValueError(f"dtype must be one of {TARGETS}, got {dtype!r}")
        if embed_dtype not in (None, "keep") + FLOAT_TARGETS + QUANT_TARGETS:
            raise ValueError(f"embed_dtype must be keep, a float or a quantized dtype, got {embed_dtype!r}")
        if group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
        self.writer, self.dtype, self.group_size, self.method = writer, dtype, group_size, method
        self.embed_dtype = embed_dtype
        self.counts: dict = {}
        self.notes: list = []

    def _count(self, dtype: str) -> None:
        self.counts[dtype] = self.counts.get(dtype, 0) + 1

    def matrix(self, name: str, src: SourceTensor, embedding: bool = False) -> None:
        """A 2-D weight: quantized when asked (a group that divides its width, else kept as
        a float with a note)."""
        target = self.embed_dtype if embedding and self.embed_dtype else self.dtype
        if target in QUANT_TARGETS:
            group = group_for(src.shape[1], self.group_size)
            if group:
                if group != self.group_size:
                    self.notes.append(f"{name}: {src.shape[1]} columns, quantized with group {group}")
                self._quantized(name, src, target, group)
                return
            self.notes.append(f"{name}: {src.shape[1]} columns fit no group of 32/64/128; kept {src.dtype}")
            target = "keep"
        self.vector(name, src, target)

    def vector(self, name: str, src: SourceTensor, target: str | None = None) -> None:
        """A tensor stored as a float: the checkpoint's bytes, or cast to a float dtype."""
        target = target or (self.dtype if self.dtype in FLOAT_TARGETS else "keep")
        if target == "keep" or target == src.dtype:
            self.writer.add_lazy_tensor(name, src.dtype, src.shape, src.raw)
            self._count(src.dtype)
        else:
            self.writer.add_lazy_tensor(name, target, src.shape, src.values)
            self._count(target)

    def values(self, name: str, values: np.ndarray, dtype: str = "f32") -> None:
        """A small tensor the importer made itself (a zero bias)."""
        self.writer.add_tensor(name, np.asarray(values, dtype=np.float32), dtype)
        self._count(dtype)

    def _quantized(self, name: str, src: SourceTensor, dtype: str, group: int) -> None:
        rows, cols = src.shape
        block = max(1, _BLOCK_ELEMENTS // cols)
        method = self.method

        def produce():
            return concat_rows([quantize(src.rows(r, min(rows, r + block)).values(), dtype, group, method)
                                for r in range(0, rows, block)])

        self.writer.add_lazy_tensor(name, dtype, src.shape, produce, group)
        self._count(dtype)


def write_model(writer: TinyLoopWriter, dst, show_progress: bool, emitter: TensorEmitter) -> dict:
    """Write the file (every lazy tensor converted as it is reached) and summarise."""
    for message in emitter.notes:
        note(message)
    label = "converting" + (f" to {emitter.dtype}" if emitter.dtype != "keep" else "")
    progress = Progress(f"{label}, writing {Path(dst).name}", show_progress)
    writer.write(dst, progress=progress)
    progress.finish()
    return {"tensors": dict(emitter.counts), "notes": list(emitter.notes)}


@dataclass
class ImportOptions:
    """What every looped-family importer takes (docs/convert.md)."""

    dtype: str = "keep"
    group_size: int = 64
    method: str = "rtn"
    embed_dtype: str | None = None
    max_depth: int = 0            # 0 = the family's default depth
    max_seq_len: int = 4096       # 0 = the checkpoint's positional limit
    ignore_config_keys: tuple = ()
    show_progress: bool = True

    def seq_len(self, limit: int) -> int:
        return limit if self.max_seq_len == 0 else min(self.max_seq_len, limit)

    def depths(self, default_depth: int) -> tuple[int, int]:
        max_depth = self.max_depth or default_depth
        if max_depth < default_depth:
            raise ValueError(f"max_depth {max_depth} is below the checkpoint's default depth {default_depth}")
        return default_depth, max_depth


def provenance(writer: TinyLoopWriter, ckpt: Checkpoint, family: str, converter: str,
               depth_from: str) -> None:
    """The metadata every family writes: tokenizer, name, source, family, dtypes."""
    for key, value in ckpt.tokenizer_metadata():
        writer.add_metadata(key, value)
    writer.add_metadata("general.name", str(ckpt.config.get("_name_or_path") or ckpt.directory.name))
    writer.add_metadata("general.source", f"hf:{ckpt.directory.name}")
    writer.add_metadata("general.converter", converter)
    writer.add_metadata("general.family", family)
    writer.add_metadata("general.default_depth_from", depth_from)
    writer.add_metadata("general.source_dtype", ckpt.source_dtypes())


def open_checkpoint(src, model_type: str, family: str, used, harmless, neutral,
                    options: ImportOptions) -> Checkpoint:
    """The directory, its model_type checked and its config keys vetted (check_keys)."""
    ckpt = Checkpoint(src)
    if ckpt.config.get("model_type") != model_type:
        raise FormatError(f"{ckpt.config_path}: model_type {ckpt.config.get('model_type')!r} is not "
                          f"{model_type!r}")
    ckpt.check_keys(family, used, harmless, neutral, options.ignore_config_keys)
    return ckpt


def tied_head(ckpt: Checkpoint, key: str = "tie_word_embeddings") -> bool:
    """Whether the head is the embedding: the config's flag, else whether lm_head is absent."""
    return ckpt.get(key, "lm_head.weight" not in ckpt.tensors, bool)


def emit_head(emit: TensorEmitter, ckpt: Checkpoint, tied: bool, vocab: int, d: int) -> None:
    """lm_head as output.weight, or nothing for a tied head (a saved copy is redundant)."""
    if tied:
        ckpt.skip("lm_head.weight")
    else:
        emit.matrix("output.weight", ckpt.tensor("lm_head.weight", (vocab, d)), embedding=True)


# ---------------------------------------------------------------- Llama-named layers

def llama_dims(ckpt: Checkpoint) -> dict:
    """Widths of a Llama-style config: head_dim from the config when present (it need not be
    hidden / heads), GQA by num_key_value_heads."""
    d, heads = ckpt.require("hidden_size"), ckpt.require("num_attention_heads")
    kv_heads = ckpt.get("num_key_value_heads", heads, int)
    if kv_heads < 1 or heads % kv_heads:
        ckpt.refuse("num_key_value_heads", f"{heads} heads are not a multiple of it")
    if not ckpt.has("head_dim") and d % heads:
        ckpt.refuse("hidden_size", f"not a multiple of the {heads} heads and no head_dim given")
    head_dim = ckpt.get("head_dim", d // heads, int)
    return {"vocab_size": ckpt.require("vocab_size"), "d_model": d, "n_head": heads,
            "n_kv_head": kv_heads, "head_dim": head_dim, "ffn_dim": ckpt.require("intermediate_size")}


def whole_stack_writer(ckpt: Checkpoint, dims: dict, options: ImportOptions, loops: int,
                       placement: str, loop_meta: list) -> tuple:
    """(writer, tied) of a model whose whole stack of num_hidden_layers Llama-named layers is
    the loop body, run `loops` times from the embedding (Ouro, Nanbeige): no prelude, coda or
    injection, half RoPE, SwiGLU, RMSNorm; loop_meta adds the family's loop norm options."""
    default_depth, max_depth = options.depths(loops)
    tied = tied_head(ckpt)
    dims.update(n_pre=0, n_core=ckpt.require("num_hidden_layers"), n_post=0, default_depth=default_depth,
                max_depth=max_depth, max_seq_len=options.seq_len(ckpt.require("max_position_embeddings")))
    writer = TinyLoopWriter(dims)
    for key, value in [
        ("arch.norm_placement", placement), ("arch.norm_type", "rmsnorm"),
        ("arch.norm_eps", ckpt.require("rms_norm_eps", float)), ("arch.rope_style", "half"),
        ("arch.rope_theta", ckpt.require("rope_theta", float)), ("arch.activation", "silu"),
        ("arch.tied_embeddings", int(tied)), ("loop.injection", "none"), ("loop.state_init", "prelude"),
    ] + loop_meta:
        writer.add_metadata(key, value)
    return writer, tied


def llama_layer_matrices(emit: TensorEmitter, ckpt: Checkpoint, theirs: str, ours: str,
                         dims: dict) -> None:
    """The q/k/v/o and gate/up/down projections of a Llama-named layer (no biases)."""
    d, f = dims["d_model"], dims["ffn_dim"]
    q_rows, kv_rows = dims["n_head"] * dims["head_dim"], dims["n_kv_head"] * dims["head_dim"]
    for proj, shape in (("q", (q_rows, d)), ("k", (kv_rows, d)), ("v", (kv_rows, d)), ("o", (d, q_rows))):
        emit.matrix(f"{ours}attn.{proj}.weight", ckpt.tensor(f"{theirs}self_attn.{proj}_proj.weight", shape))
    for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        emit.matrix(f"{ours}mlp.{proj}.weight", ckpt.tensor(f"{theirs}mlp.{proj}_proj.weight", shape))


def skip_rotary_buffers(ckpt: Checkpoint) -> None:
    """Rotary inv_freq buffers some exports save: recomputed from rope_theta, not read."""
    for name in ckpt.tensors:
        if name.endswith("rotary_emb.inv_freq"):
            ckpt.skip(name)
