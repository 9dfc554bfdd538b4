"""The Python API over libtinyloop: Model, Context, streams and results.

Token arrays cross into C without copies (`ffi.from_buffer` on int32 numpy arrays) and
results come back in numpy arrays that C writes into directly. cffi releases the GIL
during every C call, so several threads make progress at once when each uses its own
`Context`; the model-level calls share one internal context under a lock in C.
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NamedTuple, Sequence, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _args, _native
from . import prefix as _prefix
from ._handle import ModelChild, NativeHandle
from .errors import InvalidArgumentError, TinyLoopError, UnsupportedError, error_for_status
from .exit_gate import ExitGate
from .exit_rule import ExitRule, exit_rule
from .kv_policy import kv_policy_name, kv_policy_values
from .plugins import apply_generate_hooks, strategy_mode
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .chat_template import ChatTemplate
    from .config import Config
    from .plugins import ActiveMode

#: token ids: a sequence of ints or a 1-D numpy integer array
Tokens: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"
#: a prompt: text (encoded with the model's tokenizer) or token ids
Prompt: TypeAlias = "str | Tokens"
#: an exit rule (adaptive depth): an ExitRule, its string ("kl:1e-3") or dict form, or None
ExitSpec: TypeAlias = "ExitRule | str | Mapping[str, Any] | None"
FloatArray: TypeAlias = "npt.NDArray[np.float32]"
IntArray: TypeAlias = "npt.NDArray[np.int32]"

STOP_REASONS = {0: "none", 1: "max_tokens", 2: "eos", 3: "stop_sequence", 4: "grammar",
                5: "aborted", 6: "context_full"}

#: Model(body_dtype=...) -> the tl_body_dtype value of tinyloop.h
BODY_DTYPES = {"as_stored": 0, "f16": 1, "f32": 2}
#: Model(kv_dtype=...) -> the tl_kv_dtype value of tinyloop.h ("default": the backend's)
KV_DTYPES = {"default": 0, "f32": 1, "f16": 2}
#: Model(state_init=...) / Context(state_init=...) -> the tl_state_init_choice value of
#: tinyloop.h ("file": the file's loop.state_init; "warm": warm start)
STATE_INITS = {"file": 1, "warm": 2}

# C's eos_token field: -1 = the model's EOS, -2 = never stop on EOS
_EOS_MODEL = -1
_EOS_NEVER = -2


@dataclass(frozen=True)
class ModelInfo:
    """Dimensions and runtime facts of a loaded model (mirrors tl_model_info)."""

    path: str
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
    bos_token: int
    eos_token: int
    n_threads: int
    device_index: int
    device_name: str
    name: str
    #: tokens speculative drafts score (the draft vocabulary); 0 = the whole vocabulary
    draft_vocab: int
    #: how the loop body's matrices are held: "as_stored", "f16" or "f32" (Model body_dtype)
    body_dtype: str
    #: the KV cache's element type as loaded: "f32" or "f16" (Model kv_dtype)
    kv_dtype: str
    #: the contexts' state init: "file" (the file's loop.state_init) or "warm" (Model state_init)
    state_init: str
    #: the contexts' cache window in positions (Model cache_window); 0 = a full cache
    cache_window: int = 0
    #: 1 when that window is approximate for this model (attention sees fewer positions)
    cache_window_approx: int = 0
    #: the file's metadata (architecture options, provenance, ...) without tokenizer.json
    metadata: dict[str, int | float | str] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: load options a tinyloop.toml sets -> their [model] key, for the library's errors
_CONFIG_KEYS = {"default_depth": "model.depth", "max_seq_len": "model.max_seq_len",
                "prefill_chunk": "model.prefill_chunk", "threads": "model.threads"}


def _config_load_error(config: "Config", error: InvalidArgumentError, from_file: dict[str, Any],
                       overrides: dict[str, Any]) -> Exception:
    """The library's refusal of a load option as the config's error over the key that set
    it (its file and line), when the option came from the file; else the error itself."""
    message = str(error)
    for option, key in _CONFIG_KEYS.items():
        if message.startswith(f"{option} ") and option in from_file and option not in overrides:
            return config.error(key, message[len(option) + 1:])
    return error


def _metadata_int(native: Any, handle: Any, key: Any) -> int:
    value = native.ffi.new("int64_t *")
    native.check(native.lib.tl_model_get_metadata_int(handle, key, value))
    return int(value[0])


def _metadata_float(native: Any, handle: Any, key: Any) -> float:
    value = native.ffi.new("double *")
    native.check(native.lib.tl_model_get_metadata_float(handle, key, value))
    return float(value[0])


def _metadata_str(native: Any, handle: Any, key: Any) -> str:
    value, length = native.ffi.new("const char **"), native.ffi.new("size_t *")
    native.check(native.lib.tl_model_get_metadata_string(handle, key, value, length))
    return bytes(native.ffi.buffer(value[0], length[0])).decode("utf-8")


#: tl_metadata_type (tinyloop.h, the file's type codes) -> its getter
_METADATA_GETTERS: dict[int, Callable[[Any, Any, Any], int | float | str]] = {
    1: _metadata_int, 2: _metadata_float, 3: _metadata_str}


class _IdLogprob(NamedTuple):
    id: int
    logprob: float


class TopLogprob(_IdLogprob):
    """One of a step's most likely tokens: the pair (id, logprob), as it unpacks and
    compares, with the token's `text` beside it (None for a model without a tokenizer)."""

    text: str | None

    def __new__(cls, id: int, logprob: float, text: str | None = None) -> "TopLogprob":
        self = super().__new__(cls, id, logprob)
        self.text = text
        return self

    def __repr__(self) -> str:
        return f"TopLogprob(id={self.id}, logprob={self.logprob!r}, text={self.text!r})"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution at that step
    (log_softmax of the logits at the generation's depth, before temperature, filters
    and penalty), and the step's most likely tokens (TopLogprob: id, logprob and text),
    best first. `text` is the token's text (Tokenizer.token_text; None without a
    tokenizer)."""

    token: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    text: str | None = None


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]
    text: str | None
    stop_reason: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    #: speculative decoding: draft tokens verified, and how many of them were kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: prompt tokens loaded from a prefix pool instead of computed
    cached_tokens: int = 0
    #: with logprobs=True: one TokenLogprob per token of `tokens`; else None
    logprobs: list[TokenLogprob] | None = None
    #: the loop depth of the pass that chose each token of `tokens` (adaptive depth: where
    #: the `exit` rule stopped it); None where not reported (generate_batch, a mode's loop)
    depths: list[int] | None = None
    #: the mean loop depth of the passes that chose the tokens (0 without tokens)
    mean_depth: float = 0.0
    #: where resume() continues from (a _ResumePoint), or why it cannot (a str)
    _resume: "_ResumePoint | str | None" = field(default=None, repr=False, compare=False)

    def resume(self, depth: int, *, keep_text: bool = False, **options: Any) -> "GenerateResult":
        """The same request at a deeper loop depth without a new prefill: the prompt's loop
        continues from the states the generation left (docs/python.md, "Resume"), and the
        result is what a fresh generation at `depth` gives (the same greedy tokens).
        keep_text=True continues after the prompt and the tokens generated so far instead.
        The generation's options apply, overridden by `options`. Needs the result of
        Context.generate on a context made with keep_loop_states=True, still open and unused
        since; the new result can be resumed in turn."""
        point = self._resume
        if not isinstance(point, _ResumePoint):
            raise (UnsupportedError if point and point.startswith("the model has no loop") else InvalidArgumentError)(
                f"resume: {point or 'this result does not come from a generation'}")
        return point.resume(self, depth, _args.boolean("keep_text", keep_text), options)

    @property
    def acceptance_rate(self) -> float:
        """Share of the verified draft tokens that were kept (0 without drafts)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps per second. The first new token comes from the prompt's logits,
        so n tokens take n-1 steps of the model on one token each."""
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class _ResumePoint:
    """What GenerateResult.resume needs of a generation on a context that keeps its loop
    states: the context, its length before the prompt and after the generation, the
    prompt's length and ids (None when unknown: no text then), the options, and the
    context's use count when the generation ended."""

    context: "weakref.ref[Context]"
    start: int
    n_prompt: int
    prompt: tuple[int, ...] | None
    length: int
    options: dict[str, Any]
    uses: int

    def resume(self, result: "GenerateResult", depth: int, keep_text: bool,
               overrides: dict[str, Any]) -> "GenerateResult":
        ctx = self.context()
        if ctx is None or ctx.closed:
            raise InvalidArgumentError("resume: the context this result was generated on has been closed "
                                       "(freed); keep it open to resume")
        if ctx._uses != self.uses:
            raise InvalidArgumentError("resume: the context was used after this generation, so it may no "
                                       "longer hold its sequence; resume right after generating, or keep "
                                       "a Context.resume_handle() taken then")
        ran = self.options.get("depth") or ctx._model.info.default_depth
        if isinstance(depth, int) and 0 < depth < ran:   # refused here, before the context is touched
            raise InvalidArgumentError(f"resume: depth {depth} is shallower than the handle's depth {ran}: a "
                                       "resume continues the loop deeper (or at the same depth)")
        held = self.length - self.start - self.n_prompt   # generated tokens the context holds
        n_keep = self.length if keep_text else self.start + self.n_prompt
        extra = list(result.tokens[held:]) if keep_text else []
        n_prompt = self.n_prompt + (len(result.tokens) if keep_text else 0)
        prompt = self.prompt
        if prompt is not None and keep_text:
            prompt = prompt + tuple(result.tokens)
        with ctx.resume_handle(n_keep) as handle:
            return ctx._model._resume(handle, extra, depth, ctx, {**self.options, **overrides},
                                      (self.start, n_prompt, prompt if result.text is not None else None))


def _result_from_c(c_result: Any, tokens: list[int], text: str | None, options: "_GenerateOptions",
                   logprobs: list[TokenLogprob] | None = None,
                   depths: list[int] | None = None) -> GenerateResult:
    mean_depth = float(c_result.mean_depth) if options.reports_depths else float(options.depth if tokens else 0)
    return GenerateResult(tokens=tokens, text=text, logprobs=logprobs, depths=depths, mean_depth=mean_depth,
                          stop_reason=STOP_REASONS.get(int(c_result.stop_reason), "unknown"),
                          prompt_tokens=int(c_result.n_prompt_tokens),
                          prefill_seconds=float(c_result.prefill_seconds),
                          decode_seconds=float(c_result.decode_seconds),
                          drafted_tokens=int(c_result.n_drafted),
                          accepted_tokens=int(c_result.n_accepted),
                          cached_tokens=int(c_result.n_cached_tokens))


class _GenerateOptions:
    """A checked tl_generate_options plus the buffers its pointers refer to."""

    _FIELDS = ("max_tokens", "depth", "temperature", "top_k", "top_p", "min_p",
               "repetition_penalty", "repetition_window", "seed", "eos", "stop", "draft_depth",
               "n_draft", "draft_p_min", "tree", "tree_budget", "logprobs", "top_logprobs",
               "presence_penalty", "frequency_penalty", "logit_bias", "grammar", "exit")

    def __init__(self, model: "Model", *, max_tokens: int = 128, depth: int = 0,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repetition_penalty: float = 1.0, repetition_window: int = 64, seed: int = 0,
                 eos: int | bool | None = None, stop: Sequence[str | Tokens] | None = None,
                 draft_depth: int = 0, n_draft: int = 0, draft_p_min: float = 0.0,
                 tree: Sequence[int] = (), tree_budget: int = 0, logprobs: bool = False,
                 top_logprobs: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None, grammar: Any = None,
                 exit: ExitSpec = None):
        native = model._native
        ffi = native.ffi
        self.max_tokens = _args.integer("max_tokens", max_tokens, minimum=1, maximum=2**31 - 1)
        opts = ffi.new("tl_generate_options *")
        native.lib.tl_generate_options_default(opts)
        opts.max_tokens = self.max_tokens
        opts.depth = model._check_depth(depth)
        opts.temperature = _args.real("temperature", temperature, minimum=0.0)
        opts.top_k = _args.integer("top_k", top_k, minimum=0, maximum=2**31 - 1)
        opts.top_p = _args.real("top_p", top_p, minimum=0.0, maximum=1.0, exclusive_minimum=True)
        # the library's range [0, 1): min_p = 1 would keep only tokens as likely as the top one
        opts.min_p = _args.real("min_p", min_p, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        opts.repetition_penalty = _args.real("repetition_penalty", repetition_penalty,
                                             minimum=0.0, exclusive_minimum=True)
        opts.repetition_window = _args.integer("repetition_window", repetition_window,
                                               minimum=0, maximum=2**31 - 1)
        opts.seed = _args.integer("seed", seed, minimum=0, maximum=2**64 - 1)
        opts.eos_token = self._eos(model, eos)
        opts.draft_depth = _args.integer("draft_depth", draft_depth, minimum=-1, maximum=2**31 - 1)
        opts.n_draft = _args.integer("n_draft", n_draft, minimum=0, maximum=32)
        opts.draft_p_min = _args.real("draft_p_min", draft_p_min, minimum=0.0, maximum=1.0)
        # tree speculation: the drafts' branching per level (the library checks the shape)
        tree = tuple(tree or ())
        if len(tree) > len(opts.tree_widths):
            raise ValueError(f"tree has {len(tree)} levels, at most {len(opts.tree_widths)}")
        for level, width in enumerate(tree):
            opts.tree_widths[level] = _args.integer(f"tree[{level}]", width, minimum=1, maximum=8)
        opts.tree_budget = _args.integer("tree_budget", tree_budget, minimum=0, maximum=63)
        opts.logprobs = int(_args.boolean("logprobs", logprobs))
        opts.top_logprobs = _args.integer("top_logprobs", top_logprobs, minimum=0, maximum=20)
        self.logprobs, self.top_logprobs = logprobs, opts.top_logprobs
        opts.presence_penalty = _args.real("presence_penalty", presence_penalty, minimum=-2.0, maximum=2.0)
        opts.frequency_penalty = _args.real("frequency_penalty", frequency_penalty, minimum=-2.0,
                                            maximum=2.0)
        self._keepalive = self._set_stop(model, opts, stop) + self._set_bias(model, opts, logit_bias)
        if grammar is not None:   # a tinyloop.Grammar of this model (kept alive with the options)
            if getattr(grammar, "_model", None) is not model:
                raise TypeError("grammar must be a tinyloop.Grammar of this model")
            opts.grammar = grammar._require_open()
            self._keepalive.append(grammar)
        self.exit = exit_rule(exit)   # an ExitRule, its string or dict form (exit_rule.py)
        if self.exit is not None:
            if self.exit.active and opts.draft_depth != 0:
                raise InvalidArgumentError("exit: an exit rule does not combine with draft_depth "
                                           "(speculative decoding)")
            self.exit.fill(opts.exit)
        # a library from before adaptive depth reports no depths: every pass then ran at
        # the generation's depth
        self.reports_depths = hasattr(native.lib, "tl_stream_token_depth")
        self.depth = opts.depth or model.info.default_depth
        self.c = opts

    def token_depths(self, ffi: Any) -> IntArray:
        """The array tl_generate writes each generated token's depth into (opts.token_depths)."""
        depths = np.full(self.max_tokens, self.depth, dtype=np.int32)
        c_depths = ffi.from_buffer("int32_t[]", depths, require_writable=True)
        self.c.token_depths = c_depths
        self._keepalive += [depths, c_depths]
        return depths

    @staticmethod
    def _eos(model: "Model", eos: int | bool | None) -> int:
        if eos is None:
            return _EOS_MODEL
        if eos is False:
            return _EOS_NEVER
        return _args.integer("eos", eos, minimum=0, maximum=model.info.vocab_size - 1)

    @staticmethod
    def _set_bias(model: "Model", opts: Any, logit_bias: Mapping[int, float] | None) -> list[Any]:
        """logit_bias: a mapping of token id -> bias added to its logit (-100..100)."""
        if not logit_bias:
            return []
        if not isinstance(logit_bias, Mapping):
            raise TypeError(f"logit_bias must be a mapping of token id to bias, got {type(logit_bias).__name__}")
        ids = np.array([_args.integer("logit_bias token", t, minimum=0, maximum=model.info.vocab_size - 1)
                        for t in logit_bias], dtype=np.int32)
        values = np.array([_args.real(f"logit_bias[{t}]", b, minimum=-100.0, maximum=100.0)
                           for t, b in logit_bias.items()], dtype=np.float32)
        ffi = model._native.ffi
        ids_c, values_c = ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", values)
        opts.logit_bias_ids, opts.logit_bias_values, opts.n_logit_bias = ids_c, values_c, len(ids)
        return [ids, values, ids_c, values_c]

    @staticmethod
    def _set_stop(model: "Model", opts: Any, stop: Sequence[str | Tokens] | None) -> list[Any]:
        if stop is None:
            return []
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
            raise TypeError("stop must be a list of strings or of token lists, "
                            f"got {type(stop).__name__}")
        sequences = []
        for item in stop:
            if isinstance(item, str):
                if not item:
                    raise ValueError("stop strings must not be empty")
                item = model.tokenizer.encode(item, add_bos=False)
            sequences.append(_args.token_array(item, model.info.vocab_size, name="stop sequence"))
        if not sequences:
            return []
        ffi = model._native.ffi
        tokens = np.ascontiguousarray(np.concatenate(sequences), dtype=np.int32)
        lengths = np.array([len(s) for s in sequences], dtype=np.uint32)
        tokens_c = ffi.from_buffer("int32_t[]", tokens)
        lengths_c = ffi.from_buffer("uint32_t[]", lengths)
        opts.stop_tokens = tokens_c
        opts.stop_lengths = lengths_c
        opts.n_stop_sequences = len(sequences)
        return [tokens, lengths, tokens_c, lengths_c]


def _token_text_of(model: "Model") -> Callable[[int], str] | None:
    """The model's Tokenizer.token_text, or None when the file has no tokenizer."""
    try:
        return model.tokenizer.token_text
    except TinyLoopError:
        return None


class TokenStream(ModelChild):
    """Iterator over generated token ids (the C pull iterator, no callbacks).

    After the last token, `.result` holds the GenerateResult. Breaking out early is
    fine: close() (or garbage collection, or the with-statement) frees the stream."""

    def __init__(self, model: "Model", context: "Context | None", prompt: IntArray,
                 options: _GenerateOptions, pool: "_prefix.PrefixPool | None" = None,
                 resume: "tuple[_prefix.ResumeHandle, int] | None" = None):
        native = model._native
        self._native = native
        self._model = model
        self._prompt = prompt          # C reads the prompt during the stream: keep it alive
        self._options = options
        self.tokens: list[int] = []
        #: with logprobs=True: a TokenLogprob per token returned so far; else None
        self.logprobs: list[TokenLogprob] | None = [] if options.logprobs else None
        #: the loop depth of the pass that chose each token returned so far
        self.depths: list[int] = []
        self.result: GenerateResult | None = None
        out = native.ffi.new("tl_stream **")
        ctx_handle = context._require_open() if context is not None else native.ffi.NULL
        args = (native.ffi.from_buffer("int32_t[]", prompt), len(prompt), options.c, out)
        if pool is not None:
            native.check(native.lib.tl_stream_start_with_pool(
                model._require_open(), _prefix.pool_handle(model, pool), *args))
        elif resume is not None:   # (a ResumeHandle, the depth): tl_resume_stream_start
            native.check(native.lib.tl_resume_stream_start(resume[0]._require_open(), ctx_handle,
                                                           resume[1], *args))
        else:
            native.check(native.lib.tl_stream_start(model._require_open(), ctx_handle, *args))
        self._adopt(out[0])
        self._token = native.ffi.new("int32_t *")
        self._reason = native.ffi.new("tl_stop_reason *")
        self._depth = native.ffi.new("int32_t *")
        self._token_text = _token_text_of(model) if options.logprobs else None

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> int:
        if self._handle is None:
            raise StopIteration
        self._model._require_open()
        self._native.check(self._native.lib.tl_stream_next(self._handle, self._token,
                                                           self._reason))
        token = self._took(int(self._token[0]))
        if token is None:
            raise StopIteration
        return token

    def _took(self, token: int) -> int | None:
        """Record a token the C stream returned: the token, or None (and .result) at the end."""
        if token < 0:
            self._finish()
            return None
        self.tokens.append(token)
        if self.logprobs is not None:
            self.logprobs.append(self._token_logprob(token))
        self.depths.append(self._token_depth())
        return token

    def _token_depth(self) -> int:
        if not self._options.reports_depths:
            return self._options.depth
        self._native.check(self._native.lib.tl_stream_token_depth(self._handle, self._depth))
        return int(self._depth[0])

    def _token_logprob(self, token: int) -> TokenLogprob:
        native, ffi = self._native, self._native.ffi
        k = self._options.top_logprobs
        lp, ids, lps = ffi.new("float *"), ffi.new("int32_t[]", max(k, 1)), ffi.new("float[]", max(k, 1))
        native.check(native.lib.tl_stream_logprobs(self._handle, lp, ids if k else ffi.NULL,
                                                   lps if k else ffi.NULL))
        text = self._token_text
        top = tuple(TopLogprob(int(ids[j]), float(lps[j]), text and text(int(ids[j]))) for j in range(k))
        return TokenLogprob(token, float(lp[0]), top, text and text(token))

    def _finish(self) -> None:
        c_result = self._native.ffi.new("tl_generate_result *")
        self._native.lib.tl_generate_result_default(c_result)
        self._native.check(self._native.lib.tl_stream_result(self._handle, c_result))
        self.result = _result_from_c(c_result, list(self.tokens), None, self._options,
                                     None if self.logprobs is None else list(self.logprobs),
                                     list(self.depths))
        self.close()

    def _free(self, handle: Any) -> None:
        self._native.lib.tl_stream_free(handle)


class _StrategyThread(threading.local):
    running = False


_strategy_thread = _StrategyThread()


@contextmanager
def _inside_strategy() -> Iterator[None]:
    """While a mode's strategy runs on this thread, the generations it starts are the
    library's own: no mode applies to them (the strategy has had the options)."""
    outer, _strategy_thread.running = _strategy_thread.running, True
    try:
        yield
    finally:
        _strategy_thread.running = outer


class StrategyStream:
    """The tokens a mode's strategy generates (Plugin.strategy), as a stream: iterate it,
    close() it (or the with-statement); Model.next_batch steps it on its own. `result` stays
    None: a strategy reports no GenerateResult."""

    logprobs = None
    depths = None
    result = None

    def __init__(self, model: "Model", tokens: Any):
        self._model = model
        self.tokens: list[int] = []
        with _inside_strategy():
            self._tokens = iter(tokens)

    def __iter__(self) -> "StrategyStream":
        return self

    def __next__(self) -> int:
        if self._tokens is None:
            raise StopIteration
        with _inside_strategy():
            try:
                token = int(next(self._tokens))
            except StopIteration:
                self.close()
                raise
        self.tokens.append(token)
        return token

    def _step(self) -> int | None | TinyLoopError:
        """next(): the token, None at the end, or the TinyLoopError it failed with."""
        try:
            return next(self)
        except StopIteration:
            return None
        except TinyLoopError as e:
            self.close()
            return e

    def close(self) -> None:
        tokens, self._tokens = self._tokens, None
        if tokens is not None and hasattr(tokens, "close"):
            with _inside_strategy():
                tokens.close()

    def __enter__(self) -> "StrategyStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffered(model: "Model", opts: _GenerateOptions, ids: IntArray, text_ids: IntArray | None,
              run: Callable[..., None]) -> GenerateResult:
    """A generation into a buffer: run(prompt, n, opts, out, capacity, result) makes the C
    call; the text continues text_ids (None: no text)."""
    ffi = model._native.ffi
    out = np.empty(opts.max_tokens, dtype=np.int32)
    depths = opts.token_depths(ffi)
    c_result = ffi.new("tl_generate_result *")
    model._native.lib.tl_generate_result_default(c_result)
    run(ffi.from_buffer("int32_t[]", ids), len(ids), opts.c,
        ffi.from_buffer("int32_t[]", out, require_writable=True), len(out), c_result)
    n = int(c_result.n_tokens)
    tokens = out[:n].tolist()
    text = model.tokenizer.decode_continuation(text_ids, tokens) if text_ids is not None else None
    return _result_from_c(c_result, tokens, text, opts, depths=depths[:n].tolist())


def _drained(stream: "TokenStream | StrategyStream", prompt: Prompt | None, ids: IntArray,
             model: "Model") -> GenerateResult:
    """generate()'s result from a stream run to its end (its text when the prompt was a
    str); a strategy's stream, which has no result of its own, gets stop reason "none"."""
    with stream:
        for _ in stream:
            pass
    result = stream.result
    if result is None:
        result = GenerateResult(tokens=list(stream.tokens), text=None, stop_reason="none",
                                prompt_tokens=len(ids), prefill_seconds=0.0, decode_seconds=0.0)
    if isinstance(prompt, str):
        result = replace(result, text=model.tokenizer.decode_continuation(ids, result.tokens))
    return result


def _text_stream(stream: "TokenStream | StrategyStream", tokenizer: Tokenizer,
                 context: IntArray) -> Iterator[str]:
    """The stream's text pieces; `context`: its prompt's ids."""
    decoder = tokenizer.incremental_decoder(context.tolist())
    with stream:
        for token in stream:
            piece = decoder.push(token)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail


class _Scoring:
    """score / generate / stream shared by Model (internal context) and Context."""

    _model: "Model"

    def _ctx_handle(self) -> Any:
        return None

    def score(self, tokens: Tokens, depth: int = 0) -> FloatArray:
        """log p(tokens[i+1] | tokens[..i]) for every i, as float32 of length n-1."""
        logprobs: FloatArray = self._score(tokens, depth, uncertainty=False)[0]
        return logprobs

    def score_with_uncertainty(self, tokens: Tokens, depth: int = 0) -> tuple[FloatArray, FloatArray]:
        """(logprobs, entropies), float32 of length n-1 each: score's log-probabilities and
        the entropy (nats) of each predicted distribution, from the same pass."""
        return self._score(tokens, depth, uncertainty=True)

    def score_with_depths(self, tokens: Tokens, depth: int = 0, exit: ExitSpec = None,
                          given_depths: Tokens | None = None) -> tuple[FloatArray, IntArray]:
        """(logprobs, depths) with adaptive depth (docs/model.md, "Adaptive depth"): each
        position's loop stopped by the `exit` rule (an ExitRule, or its string or dict
        form: "kl:1e-3") or run to its depth in `given_depths` (n ints in 1..depth, e.g. a
        generation's depths; not with an exit rule), at most `depth` (0 = the default)
        iterations. logprobs: score's (float32, n-1); depths: int32, n, the depth each
        position ran (logprobs[i] is of position i's pass). With neither, every position
        runs at `depth` and logprobs equal score()'s."""
        return self._score(tokens, depth, uncertainty=False, exit=exit, given_depths=given_depths,
                           with_depths=True)

    def _score(self, tokens: Tokens, depth: int, uncertainty: bool, exit: ExitSpec = None,
               given_depths: Tokens | None = None, with_depths: bool = False) -> tuple[Any, ...]:
        """score / score_with_uncertainty's arrays, and with `with_depths` each position's
        depth (int32, n) after them."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size, min_length=2)
        native, ffi = model._native, model._native.ffi
        opts = model._score_options(depth, exit)
        outs: tuple[Any, ...] = tuple(np.empty(len(ids) - 1, dtype=np.float32) for _ in range(1 + uncertainty))
        keep = []   # what opts points into, alive until the call has returned
        if given_depths is not None:
            given = model._given_depths(given_depths, len(ids), opts)
            opts.given_depths = ffi.from_buffer("int32_t[]", given)
            keep += [given, opts.given_depths]
        if with_depths:   # a library from before adaptive depth leaves the fixed depth here
            depths = np.full(len(ids), opts.depth or model.info.default_depth, dtype=np.int32)
            opts.depths = ffi.from_buffer("int32_t[]", depths, require_writable=True)
            keep += [opts.depths]
            outs += (depths,)
        args = (ffi.from_buffer("int32_t[]", ids), len(ids), opts,
                *(ffi.from_buffer("float[]", out, require_writable=True) for out in outs[:1 + uncertainty]))
        name = "score_with_uncertainty" if uncertainty else "score"
        ctx = self._ctx_handle()
        if ctx is None:
            native.check(getattr(native.lib, f"tl_{name}")(model._require_open(), *args))
        else:
            native.check(getattr(native.lib, f"tl_context_{name}")(ctx, *args))
        return outs

    def score_top_logprobs(self, tokens: Tokens, top_k: int,
                           depth: int = 0) -> tuple[FloatArray, IntArray, FloatArray]:
        """(logprobs, top_ids, top_logprobs): score's log-probabilities (length n-1) and,
        at every position, the top_k (1..20) most likely next tokens, int32 and float32
        arrays of shape (n-1, top_k), best first (the lower id first on ties)."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size, min_length=2)
        k = _args.integer("top_k", top_k, minimum=1, maximum=20)
        native, ffi = model._native, model._native.ffi
        logprobs = np.empty(len(ids) - 1, dtype=np.float32)
        top_ids = np.empty((len(ids) - 1, k), dtype=np.int32)
        top_lps = np.empty((len(ids) - 1, k), dtype=np.float32)
        args = (ffi.from_buffer("int32_t[]", ids), len(ids), model._score_options(depth), k,
                ffi.from_buffer("float[]", logprobs, require_writable=True),
                ffi.from_buffer("int32_t[]", top_ids, require_writable=True),
                ffi.from_buffer("float[]", top_lps, require_writable=True))
        ctx = self._ctx_handle()
        if ctx is None:
            native.check(native.lib.tl_score_top_logprobs(model._require_open(), *args))
        else:
            native.check(native.lib.tl_context_score_top_logprobs(ctx, *args))
        return logprobs, top_ids, top_lps

    def score_exit_gate(self, tokens: Tokens, depth: int = 0) -> "ExitGate":
        """The exit gate of a model whose file has one (Ouro; docs/model.md, "Exit gate") for
        the tokens as a fresh sequence at `depth` (0 = the default): an ExitGate whose `lam`
        is float32 [n, depth], with `p`, `cdf` and `exit_steps()` of the file's exit rule."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size)
        native, ffi = model._native, model._native.ffi
        opts = model._score_options(depth)
        resolved = opts.depth or model.info.default_depth
        lam = np.empty((len(ids), max(resolved, 1)), dtype=np.float32)
        args = (ffi.from_buffer("int32_t[]", ids), len(ids), opts,
                ffi.from_buffer("float[]", lam, require_writable=True))
        ctx = self._ctx_handle()
        if ctx is None:
            native.check(native.lib.tl_score_exit_gate(model._require_open(), *args))
        else:
            native.check(native.lib.tl_context_score_exit_gate(ctx, *args))
        meta = model.info.metadata
        return ExitGate(lam, str(meta.get("loop.exit_rule", "none")),
                        float(meta.get("loop.exit_threshold", 1.0)))

    def score_last_token(self, tokens: Tokens, depth: int = 0) -> FloatArray:
        """Logits (float32, vocab) of the position after the last token."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size)
        native, ffi = model._native, model._native.ffi
        opts = model._score_options(depth)
        out = np.empty(model.info.vocab_size, dtype=np.float32)
        args = (ffi.from_buffer("int32_t[]", ids), len(ids), opts,
                ffi.from_buffer("float[]", out, require_writable=True))
        ctx = self._ctx_handle()
        if ctx is None:
            native.check(native.lib.tl_score_last_token(model._require_open(), *args))
        else:
            native.check(native.lib.tl_context_score_last_token(ctx, *args))
        return out

    def generate(self, prompt: Prompt, **options: Any) -> GenerateResult:
        """Generate up to max_tokens tokens after `prompt` (a str or token ids).

        Options: max_tokens, depth, temperature (0 = greedy), top_k, top_p, min_p,
        repetition_penalty, repetition_window, seed, eos (None: the model's, an id, or
        False: never stop on EOS), stop (strings or token lists), draft_depth and
        n_draft (self-speculative decoding: drafts of n_draft tokens at loop depth
        draft_depth, verified at `depth`; draft_depth 0 = off, -1 = the model file's
        recommendation (else 1); n_draft 0 = the file's, else 4; greedy or sampled), draft_p_min
        (a round stops drafting at a draft whose most likely token is less likely than
        this; 0 = never), tree and tree_budget (tree speculation with draft_depth: the
        drafts' branching per level, e.g. (4, 2, 1), and the most drafted nodes per round,
        0 = the shape's size), pool (a PrefixPool to start from its longest prefix of the
        prompt; Model only), logprobs (True: `logprobs` holds each token's TokenLogprob; not
        with drafts) and top_logprobs (with it, the N <= 20 most likely tokens of each
        step), presence_penalty, frequency_penalty and logit_bias (OpenAI's,
        docs/sampling.md), grammar (a tinyloop.Grammar the text must follow), exit (adaptive
        depth: an ExitRule, or its string or dict form such as "kl:1e-3", that stops each
        token's loop, the prompt's too, once it has converged; docs/python.md, "Adaptive
        depth"; not with draft_depth). `text` is set when the prompt was a str; `depths`
        holds each token's loop depth and `mean_depth` their mean.
        The model's modes (Model.modes) adjust the options first."""
        model = self._model
        pool = self._pool_option(options)
        ids = model._prompt_ids(prompt)
        return self._generate(prompt, ids, model._generation_options(options), pool)

    def _generate(self, prompt: Prompt, ids: IntArray, options: dict[str, Any],
                  pool: "_prefix.PrefixPool | None") -> GenerateResult:
        model = self._model
        mode = model._strategy_now()
        if mode is not None:
            result = _drained(self._strategy_stream(mode, ids, options, pool), prompt, ids, model)
            return replace(result, _resume=f"mode {mode.name!r} replaced the generation loop")
        opts = _GenerateOptions(model, **options)
        context = self if isinstance(self, Context) else None
        start = context._length() if context is not None else 0
        if opts.logprobs:   # kept per step by the pull iterator
            result = _drained(TokenStream(model, context, ids, opts, pool), prompt, ids, model)
        else:
            native = model._native
            ctx = self._ctx_handle()

            def run(*args: Any) -> None:
                if pool is not None:
                    native.check(native.lib.tl_generate_with_pool(
                        model._require_open(), _prefix.pool_handle(model, pool), *args))
                elif ctx is None:
                    native.check(native.lib.tl_generate(model._require_open(), *args))
                else:
                    native.check(native.lib.tl_context_generate(ctx, *args))
            text_ids = ids if isinstance(prompt, str) else None
            result = _buffered(model, opts, ids, text_ids, run)
        if context is None:
            return replace(result, _resume=model._not_resumable("Model.generate runs on an internal context "
                                                                "that keeps no loop states"))
        return replace(result, _resume=context._resume_point(start, len(ids), tuple(ids.tolist()), options))

    def stream(self, prompt: Prompt, **options: Any) -> "TokenStream | StrategyStream":
        """Like generate(), yielding token ids as they are produced (a StrategyStream when a
        mode of the model replaces the generation loop)."""
        model = self._model
        pool = self._pool_option(options)
        ids = model._prompt_ids(prompt)
        options = model._generation_options(options)
        mode = model._strategy_now()
        if mode is not None:
            return self._strategy_stream(mode, ids, options, pool)
        opts = _GenerateOptions(model, **options)
        return TokenStream(model, self if isinstance(self, Context) else None, ids, opts, pool)

    def _strategy_stream(self, mode: "ActiveMode", ids: IntArray, options: dict[str, Any],
                         pool: "_prefix.PrefixPool | None") -> "TokenStream | StrategyStream":
        """The generation of a mode's strategy: its own TokenStream when it returns one."""
        if pool is not None:
            raise UnsupportedError(f"mode {mode.name!r} replaces the generation loop: pool= is "
                                   "not supported with it")
        with _inside_strategy():
            strategy = mode.plugin.strategy
            assert strategy is not None   # strategy_mode() picks a mode that has one
            tokens = strategy(self, ids, options, mode.config)
        return tokens if isinstance(tokens, TokenStream) else StrategyStream(self._model, tokens)

    def _pool_option(self, options: dict[str, Any]) -> "_prefix.PrefixPool | None":
        pool: _prefix.PrefixPool | None = options.pop("pool", None)
        if pool is not None and self._ctx_handle() is not None:
            raise InvalidArgumentError("pool= starts a generation on a context of its own: use it "
                                       "on the Model (a Context loads a prefix with load_prefix)")
        return pool

    def stream_text(self, prompt: Prompt, **options: Any) -> Iterator[str]:
        """Like stream(), yielding decoded text pieces (whole UTF-8 characters only)."""
        ids = self._model._prompt_ids(prompt)
        return _text_stream(self.stream(ids, **options), self._model.tokenizer, ids)


def _choice_value(name: str, value: Any, choices: dict[str, int]) -> int:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return choices[value]


def _default_model_path() -> str:
    from .default_model import default_model_path
    return os.fspath(default_model_path())


class Model(_Scoring, NativeHandle):
    """A loaded .tinyloop model. Weights are mmapped and shared by all contexts.

    path: a .tinyloop file; a .gguf file (converted into the model cache on first use, with
    a note on stderr, and again when the file changes); tinyloop-smollm2-looped (the
    package's model); or a name `tinyloop pull` cached: smollm2-135m, hf:ORG/NAME (with
    /FILE and @REVISION as pulled). The CLI's MODEL argument resolves the same way;
    Model.from_pretrained also pulls (docs/convert.md, "Pull and the cache").

    draft_vocab: speculative drafts score only the N most frequent tokens of the file's
    vocab.frequency (N > 0), every token (0), or the file's draft.vocab_size (-1, the
    default; every token when the file has no frequencies). Output is unaffected.

    kv_policy: the KV cache of the model's contexts, "exact" (default), "share_last" or
    "ring" with kv_ring_slots slots per core block, the last two approximate
    (docs/model.md, "Approximate KV policies"), or "store_h": exact, each core block's
    input kept per iteration instead of its K/V, which are recomputed when attended
    (docs/model.md, "The store_h KV policy"; CPU, not with paged KV or tree speculation).

    kv_page_size: paged KV caches, pages of that many positions (a power of two up to
    4096) from a pool of the model's, taken as sequences grow and shared by forks and
    prefix caches (copied when a shared page is written); 0 = one contiguous cache per
    context (default). kv_pool_bytes caps the pool (0 = no cap): an append that needs a
    page past the cap raises OutOfMemoryError and leaves the sequence as it was
    (docs/api.md, "Paged KV").

    body_dtype: how the loop body's weight matrices (the core blocks', and a concat
    injection's) are held in memory: "as_stored" (the file's encoding, default), "f16"
    (decoded at load and rounded to fp16: float matmuls with no per-read decoding, more
    memory) or "f32" (the decoded values exactly). Not for a model without a loop body
    (docs/api.md, "Body dtype").

    kv_dtype: the KV cache's element type, "f32", "f16" (half the memory and the bytes
    decode attention reads; keys and values rounded to fp16) or "default" (f16 on CUDA,
    f32 on the CPU, which refuses f16 with UnsupportedError; docs/api.md, "KV dtype").

    state_init: where each position's loop starts in the model's contexts: "file" (the
    file's loop.state_init, default) or "warm" (from the previous position's final loop
    state, position 0 as the file says; any looped model, docs/model.md, "Warm start").

    cache_window: keep only the last W positions' K/V per virtual layer, in a ring, so KV
    memory no longer grows with max_seq_len and a sequence goes on past it (positions keep
    counting); 0 = off (default). Exact for a model whose arch.sliding_window <= W; any
    other model needs cache_window_approx=True, and then attention sees only the last W
    positions, an approximate mode that info.cache_window_approx reports (docs/api.md,
    "Cache window")."""

    _chat_template: "ChatTemplate | None" = None
    _chat_template_loaded = False

    def __init__(self, path: str | os.PathLike[str], *, device: str = "cpu", threads: int = 0, max_seq_len: int = 0,
                 default_depth: int = 0, verify_checksums: bool = False,
                 prefill_chunk: int = 0, draft_vocab: int = -1, kv_policy: str = "exact",
                 kv_ring_slots: int = 0, kv_page_size: int = 0, kv_pool_bytes: int = 0,
                 body_dtype: str = "as_stored", kv_dtype: str = "default", cache_window: int = 0,
                 cache_window_approx: bool = False, state_init: str = "file"):
        self._native = _native.get()
        native, ffi = self._native, self._native.ffi
        from .default_model import resolve_model
        self.path = resolve_model(path, strict=False)
        if not isinstance(device, str):
            raise TypeError(f"device must be a str, got {type(device).__name__}")
        opts = ffi.new("tl_load_options *")
        native.lib.tl_load_options_default(opts)
        device_c = ffi.new("char[]", device.encode())
        opts.device = device_c
        opts.n_threads = _args.max_int32("threads", threads)
        opts.max_seq_len = _args.max_int32("max_seq_len", max_seq_len)
        opts.default_depth = _args.max_int32("default_depth", default_depth)
        opts.prefill_chunk = _args.max_int32("prefill_chunk", prefill_chunk)
        opts.verify_checksums = 1 if verify_checksums else 0
        opts.draft_vocab = _args.integer("draft_vocab", draft_vocab, minimum=-1, maximum=2**31 - 1)
        opts.kv_policy, opts.kv_ring_slots = kv_policy_values(kv_policy, kv_ring_slots)
        opts.kv_page_size = _args.max_int32("kv_page_size", kv_page_size)
        opts.kv_pool_bytes = _args.integer("kv_pool_bytes", kv_pool_bytes, minimum=0, maximum=2**63 - 1)
        opts.body_dtype = _choice_value("body_dtype", body_dtype, BODY_DTYPES)
        opts.kv_dtype = _choice_value("kv_dtype", kv_dtype, KV_DTYPES)
        opts.cache_window = _args.max_int32("cache_window", cache_window)
        opts.cache_window_approx = int(_args.boolean("cache_window_approx", cache_window_approx))
        opts.state_init = _choice_value("state_init", state_init, STATE_INITS)
        out = ffi.new("tl_model **")
        self._lock = threading.Lock()
        self._children: weakref.WeakSet[ModelChild] = weakref.WeakSet()
        native.check(native.lib.tl_load_model(self.path.encode(), opts, out))
        self._handle = out[0]
        self._tokenizer: Tokenizer | None = None
        #: the active modes of the config the model was loaded from (Model.from_config):
        #: their configure_generate hooks and strategy apply to every generation
        self.modes: tuple[ActiveMode, ...] = ()
        self._strategy: ActiveMode | None = None
        self.info = self._read_info()

    @classmethod
    def from_config(cls, config: "Config | str | os.PathLike[str]", **overrides: Any) -> "Model":
        """Load the model a tinyloop.toml (path or tinyloop.config.Config) describes.

        Active modes adjust the load options; keyword overrides win over both. The model
        keeps the modes (`modes`): they adjust every generation's options and may replace
        its loop, on the model and on its contexts. Without [model] path it loads the
        default model, as the CLI does."""
        from .config import Config, load_config
        if not isinstance(config, Config):
            config = load_config(config)
        kwargs = config.load_options()
        from_file = dict(kwargs)
        kwargs.update(overrides)
        path = kwargs.pop("path") or _default_model_path()
        try:
            model = cls(path, **kwargs)
        except InvalidArgumentError as e:
            raise _config_load_error(config, e, from_file, overrides) from e
        model.modes = tuple(config.modes)
        model._strategy = strategy_mode(model.modes)
        return model

    @classmethod
    def default(cls, **options: Any) -> "Model":
        """Load the default model: $TINYLOOP_DEFAULT_MODEL when set, else the model shipped
        in the package (tinyloop-smollm2-looped). Options are those of Model()."""
        return cls(_default_model_path(), **options)

    @classmethod
    def from_pretrained(cls, name: str | os.PathLike[str], *, revision: str | None = None,
                        file: str | None = None, force: bool = False, show_progress: bool = True,
                        **options: Any) -> "Model":
        """`tinyloop pull NAME` and then Model(NAME): a Hugging Face model
        (hf:ORG/NAME[/FILE][@REVISION]; `revision`, `file` as --revision, --file) or a known
        name is downloaded and converted into the cache unless it is there already (Hub
        names are checked against the Hub for a newer commit, and offline the cached copy
        is used); a file path or another name loads as Model() loads it. Options are those
        of Model()."""
        from .convert.hub import is_hub_name
        from .convert.pull import KNOWN_MODELS, pull
        name = os.fspath(name)
        if is_hub_name(name) or name in KNOWN_MODELS:
            name = pull(name, revision=revision, file=file, force=force, show_progress=show_progress)
        elif revision is not None or file is not None:
            raise ValueError(f"revision and file are for hf:ORG/NAME models, not {name!r}")
        return cls(name, **options)

    # -- lifetime ---------------------------------------------------------------
    @property
    def _model(self) -> "Model":  # type: ignore[override]  # _Scoring's attribute, read-only here
        return self

    def _require_open(self) -> Any:
        handle = self._handle
        if handle is None:
            raise TinyLoopError(f"model {self.path} is closed")
        return handle

    def close(self) -> None:
        """Free the model, and first every context and stream still open on it.

        Idempotent. Other threads must be done with the model before it is closed."""
        with self._lock:
            super().close()

    def _free(self, handle: Any) -> None:
        for child in list(self._children):
            child.close()
        self._native.lib.tl_free_model(handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.info.device_name
        return f"<tinyloop.Model {self.path!r} ({state})>"

    # -- facts ------------------------------------------------------------------
    def _read_info(self) -> ModelInfo:
        ffi = self._native.ffi
        c_info = ffi.new("tl_model_info *")
        self._native.lib.tl_model_info_default(c_info)
        self._native.check(self._native.lib.tl_model_get_info(self._handle, c_info))
        values: dict[str, Any] = {}
        for f in fields(ModelInfo):
            if f.name in ("path", "metadata"):
                continue
            value = getattr(c_info, f.name)
            if f.name in ("device_name", "name"):
                value = ffi.string(value).decode("utf-8", "replace")
            elif f.name == "body_dtype":
                value = {v: k for k, v in BODY_DTYPES.items()}[int(value)]
            elif f.name == "kv_dtype":
                value = {v: k for k, v in KV_DTYPES.items()}[int(value)]
            elif f.name == "state_init":
                value = {v: k for k, v in STATE_INITS.items()}[int(value)]
            values[f.name] = value if isinstance(value, str) else int(value)
        return ModelInfo(path=self.path, metadata=self._file_metadata(), **values)

    def _file_metadata(self) -> dict[str, int | float | str]:
        return {k: v for k, v in self.metadata().items() if k != "tokenizer.json"}

    def metadata(self) -> dict[str, int | float | str]:
        """Every metadata entry of the file, key -> int, float or str, in key order
        (docs/format.md lists the keys; unknown ones are included)."""
        native, ffi = self._native, self._native.ffi
        lib, handle = native.lib, self._require_open()
        if not hasattr(lib, "tl_model_metadata_count"):
            # a library older than the metadata calls (tools/gpu/ab.py runs old builds)
            from .fileformat.tinyloop_file import read_file
            with read_file(self.path) as f:
                return dict(sorted(f.metadata.items()))
        count, key, kind = ffi.new("size_t *"), ffi.new("const char **"), ffi.new("tl_metadata_type *")
        native.check(lib.tl_model_metadata_count(handle, count))
        out: dict[str, int | float | str] = {}
        for i in range(count[0]):
            native.check(lib.tl_model_metadata_key(handle, i, key, kind))
            name = ffi.string(key[0]).decode("utf-8")
            value = _METADATA_GETTERS.get(int(kind[0]))
            if value is not None:   # a type code of a later format: skipped
                out[name] = value(native, handle, key[0])
        return out

    def metadata_string(self, key: str) -> str | None:
        """A string metadata value of the file, or None when the key is absent."""
        native, ffi = self._native, self._native.ffi
        value = ffi.new("const char **")
        length = ffi.new("size_t *")
        status = native.lib.tl_model_get_metadata_string(self._require_open(), key.encode(),
                                                         value, length)
        if status != 0:
            return None
        return bytes(ffi.buffer(value[0], length[0])).decode("utf-8", "replace")

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer stored in the file (built on first use)."""
        if self._tokenizer is None:
            tokenizer_json = self.metadata_string("tokenizer.json")
            if tokenizer_json is None:
                raise TinyLoopError(f"{self.path} has no tokenizer (tokenizer.json metadata); "
                                    "pass token ids instead of text")
            self._tokenizer = Tokenizer(tokenizer_json, bos_id=self.info.bos_token,
                                        eos_id=self.info.eos_token,
                                        add_bos=bool(self.info.metadata.get("tokenizer.add_bos", 0)))
        return self._tokenizer

    def memory_report(self) -> dict[str, int]:
        """Bytes used: weights, repacked weights, buffers, KV caches, total, device, prefix
        caches; with paged KV also kv_page_size, kv_pages_in_use, kv_pool_bytes (in
        kv_cache_bytes too) and kv_pool_cap_bytes (0 otherwise); the loop body's matrices as
        held (body_bytes, part of weights). The KV bytes are of info.kv_dtype's elements.
        kv_policy_report() adds the KV policy's cost per token."""
        c_report = self._native.ffi.new("tl_memory_report *")
        self._native.lib.tl_memory_report_default(c_report)
        self._native.check(self._native.lib.tl_memory_report_get(self._require_open(), c_report))
        return {name: int(getattr(c_report, name)) for name in (
            "weights_bytes", "repacked_bytes", "buffers_bytes", "kv_cache_bytes",
            "total_bytes", "device_bytes", "prefix_cache_bytes", "kv_page_size", "kv_pages_in_use",
            "kv_pool_bytes", "kv_pool_cap_bytes", "body_bytes")}

    def kv_policy_report(self) -> dict[str, str | int]:
        """The memory report's KV policy: kv_policy (the contexts' policy, a name as Model
        takes it) and kv_bytes_per_token, what a context caching the model's max depth
        holds per position under it (store_h: its K/V slots and the core blocks' kept
        inputs; docs/model.md, "The store_h KV policy")."""
        c_report = self._native.ffi.new("tl_memory_report *")
        self._native.lib.tl_memory_report_default(c_report)
        self._native.check(self._native.lib.tl_memory_report_get(self._require_open(), c_report))
        return {"kv_policy": kv_policy_name(int(c_report.kv_policy)),
                "kv_bytes_per_token": int(c_report.kv_bytes_per_token)}

    def vram_usage_bytes(self) -> int:
        out = self._native.ffi.new("uint64_t *")
        self._native.check(self._native.lib.tl_vram_usage_bytes(self._require_open(), out))
        return int(out[0])

    # -- calls --------------------------------------------------------------------
    def _check_depth(self, depth: Any) -> int:
        checked = _args.integer("depth", depth, minimum=0)
        if self.info.max_depth > 0 and checked > self.info.max_depth:
            raise ValueError(f"depth {checked} exceeds the model's max_depth {self.info.max_depth}")
        return checked

    def _score_options(self, depth: Any, exit: ExitSpec = None) -> Any:
        opts = self._native.ffi.new("tl_score_options *")
        self._native.lib.tl_score_options_default(opts)
        opts.depth = self._check_depth(depth)
        rule = exit_rule(exit)
        if rule is not None:
            rule.fill(opts.exit)
        return opts

    def _given_depths(self, given: Tokens, n_tokens: int, opts: Any) -> IntArray:
        """given_depths checked: n_tokens ints in 1..depth, and no exit rule beside them."""
        if opts.exit.kind != 0:
            raise InvalidArgumentError("given_depths: not with an exit rule (exit); give one or the other")
        array = np.asarray(given)
        if array.dtype.kind not in "iu":
            raise TypeError(f"given_depths must hold ints, got dtype {array.dtype}")
        if array.shape != (n_tokens,):
            raise InvalidArgumentError(f"given_depths: {n_tokens} values (one per token), got shape {array.shape}")
        deepest = opts.depth or self.info.default_depth
        if n_tokens and not (array.min() >= 1 and array.max() <= deepest):
            raise InvalidArgumentError(f"given_depths: each in 1..{deepest} (the depth), got "
                                       f"{int(array.min())}..{int(array.max())}")
        return np.ascontiguousarray(array, dtype=np.int32)

    def _generation_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """One generation's keyword arguments after the modes' configure_generate hooks
        (inside a strategy none apply)."""
        if not self.modes or _strategy_thread.running:
            return options
        return apply_generate_hooks(self.modes, dict(options))

    def _strategy_now(self) -> "ActiveMode | None":
        """The mode whose strategy runs a generation started now, if any."""
        return None if _strategy_thread.running else self._strategy

    def _prompt_ids(self, prompt: Prompt) -> IntArray:
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        return _args.token_array(prompt, self.info.vocab_size, name="prompt")

    def score_windows(self, tokens: Tokens, depth: int = 0, ctx: int = 0,
                      progress: Callable[[int, int], object] | None = None, uncertainty: bool = False,
                      exit: ExitSpec = None, with_depths: bool = False) -> Any:
        """Log-probs of tokens[1:], scoring windows of at most `ctx` tokens; with
        uncertainty=True, (log-probs, entropies) as score_with_uncertainty gives them.
        `exit`: an exit rule the windows are scored with (score_with_depths); with_depths=True
        adds, last, the depth of the pass that predicted each of tokens[1:] (int32).

        Window k covers tokens [k*(ctx-1), k*(ctx-1)+ctx): consecutive windows share one
        token, so every token after the first is predicted exactly once, each window
        from a fresh context. ctx=0 scores the whole sequence at once. `progress`, when
        given, is called as progress(done_windows, total_windows)."""
        ids = _args.token_array(tokens, self.info.vocab_size, min_length=2)
        ctx = _args.integer("ctx", ctx, minimum=0)
        if ctx == 1:
            raise ValueError("ctx must be 0 (whole sequence) or at least 2")
        stride = ctx - 1 if 0 < ctx < len(ids) else len(ids)
        starts = range(0, len(ids) - 1, stride)
        pieces = []
        for done, start in enumerate(starts, 1):
            piece = self._score(ids[start:start + stride + 1], depth, uncertainty, exit=exit,
                                with_depths=with_depths)
            # a window's last position predicts nothing scored here
            pieces.append(piece[:-1] + (piece[-1][:-1],) if with_depths else piece)
            if progress:
                progress(done, len(starts))
        outs = tuple(np.concatenate(parts) for parts in zip(*pieces))
        return outs if uncertainty or with_depths else outs[0]

    def perplexity(self, tokens: Tokens, depth: int = 0, ctx: int = 0, exit: ExitSpec = None) -> float:
        """exp(-mean log p) over tokens[1:], windowed as in score_windows() (with `exit`,
        an exit rule the windows are scored with)."""
        logprobs = self.score_windows(tokens, depth, ctx, exit=exit)
        return float(np.exp(-np.mean(logprobs, dtype=np.float64)))

    def score_logit_lens(self, tokens: Tokens, max_depth: int = 0) -> FloatArray:
        """Logits (float32, [max_depth, vocab]) of the position after the last token at
        every loop depth 1..max_depth (0 = the model's max_depth): row d-1 is depth d."""
        ids = _args.token_array(tokens, self.info.vocab_size)
        max_depth = _args.integer("max_depth", max_depth, minimum=0, maximum=2**31 - 1)
        max_depth = max_depth or self.info.max_depth
        native, ffi = self._native, self._native.ffi
        out = np.empty((max(max_depth, 1), self.info.vocab_size), dtype=np.float32)
        native.check(native.lib.tl_score_logit_lens(
            self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), ffi.NULL, max_depth,
            ffi.from_buffer("float[]", out, require_writable=True)))
        return out

    def embed(self, tokens: Tokens, depth: int = 0) -> FloatArray:
        """An embedding of the tokens (float32, [d_model]): the mean over the positions of
        the head's input (the final norm's output) at loop depth `depth` (0 = the
        default), the tokens run as a fresh sequence (C: tl_embed)."""
        ids = _args.token_array(tokens, self.info.vocab_size)
        native, ffi = self._native, self._native.ffi
        opts = self._score_options(depth)
        out = np.empty(self.info.d_model, dtype=np.float32)
        native.check(native.lib.tl_embed(self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids),
                                         opts, ffi.from_buffer("float[]", out, require_writable=True)))
        return out

    def score_with_consistency_escalation(self, tokens: Tokens, min_depth: int = 1, max_depth: int = 0,
                                          max_changed: float = 0.05) -> tuple[FloatArray, FloatArray, int]:
        """(logprobs, entropies, depth): the tokens scored at min_depth, then at twice the
        depth (at most max_depth, 0 = the model's default depth) and so on, until at most
        max_changed (a share) of the greedy predictions changed from the depth scored
        before. logprobs and entropies are score_with_uncertainty's at `depth`, the depth
        it stopped at (two depths are scored at least, unless min_depth == max_depth)."""
        ids = _args.token_array(tokens, self.info.vocab_size, min_length=2)
        native, ffi = self._native, self._native.ffi
        opts = ffi.new("tl_escalation_options *")
        native.lib.tl_escalation_options_default(opts)
        opts.min_depth = _args.integer("min_depth", min_depth, minimum=1, maximum=2**31 - 1)
        opts.max_depth = _args.integer("max_depth", max_depth, minimum=0, maximum=2**31 - 1)
        opts.max_changed = _args.real("max_changed", max_changed, minimum=0.0, maximum=1.0)
        logprobs, entropies = (np.empty(len(ids) - 1, dtype=np.float32) for _ in range(2))
        depth = ffi.new("int32_t *")
        native.check(native.lib.tl_score_with_consistency_escalation(
            self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids), opts,
            ffi.from_buffer("float[]", logprobs, require_writable=True),
            ffi.from_buffer("float[]", entropies, require_writable=True), depth))
        return logprobs, entropies, int(depth[0])

    def generate_batch(self, prompts: Sequence[Prompt], **options: Any) -> list[GenerateResult]:
        """generate() for several prompts at once, with the same options: one GenerateResult
        per prompt, in order. Each prompt is its own sequence; after their prefills, the
        decode steps of all sequences still going run as one forward pass (docs/api.md,
        "Batched decoding"), which raises the tokens per second of the whole batch."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise TypeError("prompts must be a list of prompts (str or token ids)")
        if len(prompts) == 0:
            return []
        ids = [self._prompt_ids(p) for p in prompts]
        options = self._generation_options(options)
        if self._strategy_now() is not None:   # a mode's own loop: one prompt after another
            return [self._generate(p, i, options, None) for p, i in zip(prompts, ids)]
        opts = _GenerateOptions(self, **options)
        native, ffi = self._native, self._native.ffi
        n = len(ids)
        outs = [np.empty(opts.max_tokens, dtype=np.int32) for _ in range(n)]
        c_prompts = [ffi.from_buffer("int32_t[]", a) for a in ids]
        c_outs = [ffi.from_buffer("int32_t[]", o, require_writable=True) for o in outs]
        c_results = ffi.new("tl_generate_result[]", n)
        for i in range(n):
            native.lib.tl_generate_result_default(c_results + i)
        lengths = ffi.new("size_t[]", [len(a) for a in ids])
        native.check(native.lib.tl_generate_batch(
            self._require_open(), ffi.new("int32_t *[]", c_prompts), lengths, n, opts.c,
            ffi.new("int32_t *[]", c_outs), opts.max_tokens, c_results))
        results = []
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            tokens = out[:int(c_results[i].n_tokens)].tolist()
            text = self.tokenizer.decode_continuation(ids[i], tokens) if isinstance(prompt, str) else None
            # one token_depths array would serve every prompt: per-token depths are not asked
            results.append(_result_from_c(c_results[i], tokens, text, opts))
        return results

    def append_batch(self, contexts: Sequence["Context"], tokens: Tokens) -> FloatArray:
        """One decode step of several sequences at once: tokens[i] is appended to
        contexts[i] (distinct contexts of this model) at its sequence's depth. Returns the
        logits after each, float32 [len(contexts), vocab]. The steps share one forward pass;
        on an error no context changes."""
        contexts = list(contexts)
        ids = _args.token_array(tokens, self.info.vocab_size, min_length=0)
        if len(ids) != len(contexts):
            raise InvalidArgumentError(f"{len(contexts)} contexts but {len(ids)} tokens: one token each")
        for i, ctx in enumerate(contexts):
            if not isinstance(ctx, Context) or ctx._model is not self:
                raise InvalidArgumentError(f"contexts[{i}] is not a context of this model")
        native, ffi = self._native, self._native.ffi
        logits = np.empty((len(contexts), self.info.vocab_size), dtype=np.float32)
        if contexts:
            handles = ffi.new("tl_context *[]", [ctx._require_open() for ctx in contexts])
            native.check(native.lib.tl_context_append_batch(
                handles, ffi.from_buffer("int32_t[]", ids), len(ids),
                ffi.from_buffer("float[]", logits, require_writable=True)))
        return logits

    def next_batch(self, streams: Sequence["TokenStream | StrategyStream"]) -> list[int | None | TinyLoopError]:
        """One next() of several streams of this model at once (distinct streams over
        distinct contexts): the streams whose next token takes one plain decode step share
        one forward pass (docs/api.md, "Batched decoding"). Returns, per stream, its next
        token, None when it has ended (its .result is then set), or the TinyLoopError it
        failed with (the stream is then closed); the other streams go on either way. A
        mode's StrategyStream is stepped on its own."""
        streams = list(streams)
        for i, stream in enumerate(streams):
            if not isinstance(stream, (TokenStream, StrategyStream)) or stream._model is not self:
                raise InvalidArgumentError(f"streams[{i}] is not a stream of this model")
        if len({id(stream) for stream in streams}) != len(streams):
            raise InvalidArgumentError("a stream appears twice in the batch")
        out: list[int | None | TinyLoopError] = [None] * len(streams)
        for i, stream in enumerate(streams):
            if isinstance(stream, StrategyStream):
                out[i] = stream._step()
        live = [(i, stream) for i, stream in enumerate(streams)
                if isinstance(stream, TokenStream) and stream._handle is not None]
        if not live:
            return out
        native, ffi = self._native, self._native.ffi
        n = len(live)
        tokens, reasons, statuses = ffi.new("int32_t[]", n), ffi.new("tl_stop_reason[]", n), ffi.new("tl_status[]", n)
        native.check(native.lib.tl_stream_next_batch(
            ffi.new("tl_stream *[]", [stream._handle for _, stream in live]), n, tokens, reasons, statuses))
        message = native.last_error()
        for j, (i, stream) in enumerate(live):
            if int(statuses[j]) != 0:
                out[i] = error_for_status(int(statuses[j]), message)
                stream.close()
            else:
                out[i] = stream._took(int(tokens[j]))
        return out

    def context(self, max_seq_len: int = 0, max_depth: int = 0,
                keep_loop_states: bool = False, kv_policy: str | None = None,
                kv_ring_slots: int = 0, prefix: "_prefix.PrefixCache | None" = None,
                cache_window: int | None = None, cache_window_approx: bool = False,
                state_init: str | None = None) -> "Context":
        """A new sequence state (KV cache + buffers): one per thread for parallel use.
        keep_loop_states=True lets Context.deepen continue the sequence at a deeper depth;
        kv_policy (None = the model's) and kv_ring_slots as for Model; prefix (a
        PrefixCache) starts the sequence from it; cache_window (None = the model's, 0 =
        none, W), cache_window_approx and state_init (None = the model's, "file" or
        "warm") as for Model."""
        ctx = Context(self, max_seq_len=max_seq_len, max_depth=max_depth,
                      keep_loop_states=keep_loop_states, kv_policy=kv_policy,
                      kv_ring_slots=kv_ring_slots, cache_window=cache_window,
                      cache_window_approx=cache_window_approx, state_init=state_init)
        if prefix is not None:
            try:
                ctx.load_prefix(prefix)
            except BaseException:
                ctx.close()
                raise
        return ctx

    def prefix_cache(self, tokens: Tokens, depth: int = 0) -> "_prefix.PrefixCache":
        """A read-only snapshot of `tokens` computed at `depth` (0 = the default), for
        contexts to start from (context(prefix=...), Context.load_prefix)."""
        return _prefix.PrefixCache.compute(self, tokens, depth)

    # -- chat -------------------------------------------------------------------
    @property
    def chat_template(self) -> "ChatTemplate | None":
        """The file's chat template (tokenizer.chat_template), compiled once: the renderer
        `tinyloop chat` and the server use. None when the file has none."""
        if not self._chat_template_loaded:
            from .chat_template import load_chat_template
            self._chat_template = load_chat_template(self)
            self._chat_template_loaded = True
        return self._chat_template

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
             documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None, **options: Any) -> GenerateResult:
        """The assistant's reply to `messages` (dicts with role and content, as Hugging Face
        takes them): the conversation rendered through the file's chat template, then
        generate() with `options`; `text` is the reply. `tools`, `documents` and
        `chat_template_kwargs` (any other variables) go to the template."""
        ids = self._chat_ids(messages, tools, documents, add_generation_prompt, chat_template_kwargs)
        result = self.generate(ids, **options)
        return replace(result, text=self.tokenizer.decode_continuation(ids, result.tokens))

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                    documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> Iterator[str]:
        """chat() as text pieces while they are generated (stream_text of the rendered
        conversation)."""
        ids = self._chat_ids(messages, tools, documents, add_generation_prompt, chat_template_kwargs)
        return self.stream_text(ids, **options)

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None,
                  documents: Sequence[Any] | None, add_generation_prompt: bool,
                  variables: Mapping[str, Any] | None) -> list[int]:
        from .chat_template import ChatTemplateError
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(f"{self.path} has no chat template (tokenizer.chat_template): "
                                    "use generate() with a prompt")
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a list of dicts with role and content")
        extra = dict(variables or {})
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None:
                extra[name] = value
        text = template(messages, add_generation_prompt, **extra)
        # the template writes the BOS it wants
        return self.tokenizer.encode(text, add_bos=False)

    # -- resume (docs/python.md, "Resume") ---------------------------------------------
    def resume_generate(self, handle: "_prefix.ResumeHandle", prompt: Prompt | None = None, *, depth: int,
                        context: "Context | None" = None, **options: Any) -> GenerateResult:
        """generate() of the handle's tokens followed by `prompt` (token ids, a str encoded
        without BOS, or None: the first new token follows the handle's last one) at loop
        depth `depth` (>= the handle's), without a new prefill: the handle's loop goes on
        from its kept states (Context.resume_handle). On `context` (which must keep its loop
        states; its sequence is replaced, and the result can be resumed again) or on a
        context of its own. Options as generate()'s, but not exit (every position runs one
        depth) nor pool."""
        if not isinstance(handle, _prefix.ResumeHandle) or handle._model is not self:
            raise TypeError("handle must be a ResumeHandle of this model (Context.resume_handle)")
        if context is not None and (not isinstance(context, Context) or context._model is not self):
            raise TypeError("context must be a Context of this model")
        if isinstance(prompt, str):
            extra = self.tokenizer.encode(prompt, add_bos=False)
        else:
            extra = [] if prompt is None else list(prompt)
        return self._resume(handle, extra, depth, context, self._generation_options(options),
                            (0, handle.n_tokens + len(extra), None))

    def _not_resumable(self, why: str) -> str:
        if self.info.n_core == 0:
            return "the model has no loop (n_core = 0): there is no deeper depth to resume at"
        return f"{why}: generate on model.context(keep_loop_states=True) to resume"

    def _resume(self, handle: "_prefix.ResumeHandle", extra: Tokens, depth: int, context: "Context | None",
                options: dict[str, Any], where: tuple[int, int, Any]) -> GenerateResult:
        """The resumed generation; `where` = (the context's length before the equivalent
        fresh prompt, that prompt's length, its ids or None) for the result's own resume."""
        mode = self._strategy_now()
        if mode is not None:
            raise UnsupportedError(f"resume: mode {mode.name!r} replaces the generation loop")
        if options.pop("pool", None) is not None:
            raise InvalidArgumentError("resume: pool= is not supported (the handle is the prefix)")
        options["depth"] = _args.integer("depth", depth, minimum=0, maximum=2**31 - 1)
        opts = _GenerateOptions(self, **options)
        if opts.exit is not None and opts.exit.active:
            raise UnsupportedError("resume: an exit rule is not supported: a resumed sequence runs every "
                                   "position at one depth")
        ids = _args.token_array(extra, self.info.vocab_size, name="prompt", min_length=0)
        start, n_prompt, prompt = where
        text_ids = None if prompt is None else np.asarray(prompt, dtype=np.int32)
        if opts.logprobs:
            stream = TokenStream(self, context, ids, opts, resume=(handle, opts.c.depth))
            result = _drained(stream, None, ids, self)
            if text_ids is not None:
                result = replace(result, text=self.tokenizer.decode_continuation(text_ids, result.tokens))
        else:
            native, ffi = self._native, self._native.ffi
            ctx = context._require_open() if context is not None else ffi.NULL

            def run(*args: Any) -> None:
                native.check(native.lib.tl_resume_generate(handle._require_open(), ctx, opts.c.depth, *args))
            result = _buffered(self, opts, ids, text_ids, run)
        if context is None:
            return replace(result, _resume=self._not_resumable("resume_generate ran on a context of its own"))
        return replace(result, _resume=context._resume_point(start, n_prompt, prompt, options))


class Context(_Scoring, ModelChild):
    """Mutable state of one sequence on a model: its KV cache and buffers.

    Not safe to share between threads; give each thread its own."""

    _kind = "context"

    def __init__(self, model: Model, *, max_seq_len: int = 0, max_depth: int = 0,
                 keep_loop_states: bool = False, kv_policy: str | None = None,
                 kv_ring_slots: int = 0, body_dtype: str = "as_stored", cache_window: int | None = None,
                 cache_window_approx: bool = False, state_init: str | None = None):
        self._model = model
        _args.boolean("keep_loop_states", keep_loop_states)
        _args.boolean("cache_window_approx", cache_window_approx)
        native, ffi = model._native, model._native.ffi
        opts = ffi.new("tl_context_options *")
        native.lib.tl_context_options_default(opts)
        opts.max_seq_len = _args.max_int32("max_seq_len", max_seq_len)
        opts.max_depth = _args.max_int32("max_depth", max_depth)
        opts.keep_loop_states = int(keep_loop_states)
        opts.kv_policy, opts.kv_ring_slots = kv_policy_values(kv_policy, kv_ring_slots)
        if cache_window is not None:   # C: 0 = the model's, -1 = none
            window = _args.max_int32("cache_window", cache_window)
            opts.cache_window = window if window else -1
            opts.cache_window_approx = int(cache_window_approx)
        elif cache_window_approx:
            raise ValueError("cache_window_approx=True needs a cache_window")
        if state_init is not None:
            opts.state_init = _choice_value("state_init", state_init, STATE_INITS)
        out = ffi.new("tl_context **")
        native.check(native.lib.tl_context_create(model._require_open(), opts, out))
        self._keeps_states = bool(keep_loop_states)
        self._adopt(out[0])

    #: calls that may change the sequence (every use of the handle but length, forks and
    #: snapshots): a generation's result resumes only while this has not moved
    _uses = 0

    def _require_open(self) -> Any:
        self._uses += 1
        return super()._require_open()

    def _ctx_handle(self) -> Any:
        return self._require_open()

    def _free(self, handle: Any) -> None:
        self._model._native.lib.tl_context_free(handle)

    def _length(self) -> int:
        out = self._model._native.ffi.new("size_t *")
        self._model._native.check(self._model._native.lib.tl_context_length(
            super()._require_open(), out))
        return int(out[0])

    def __len__(self) -> int:
        return self._length()

    def _resume_point(self, start: int, n_prompt: int, prompt: Any, options: dict[str, Any]) -> Any:
        """A generation's resume point on this context (it just ended), or why there is none."""
        if not self._keeps_states:
            return self._model._not_resumable("the context keeps no loop states")
        return _ResumePoint(weakref.ref(self), start, n_prompt, prompt, self._length(), dict(options), self._uses)

    def resume_handle(self, n_tokens: int = 0) -> "_prefix.ResumeHandle":
        """A snapshot of the first n_tokens of the sequence (0 = all) with their kept loop
        states, for Model.resume_generate to take deeper; the context needs
        keep_loop_states=True. Independent of the context afterwards."""
        n_tokens = _args.integer("n_tokens", n_tokens, minimum=0)
        native, ffi = self._model._native, self._model._native.ffi
        out = ffi.new("tl_resume_handle **")
        native.check(native.lib.tl_resume_create(super()._require_open(), n_tokens, out))
        return _prefix.ResumeHandle(self._model, out[0])

    def append(self, tokens: Tokens, depth: int = 0) -> FloatArray:
        """Run `tokens` through the model after the sequence so far; return the logits
        (float32, vocab) of the position after the last one."""
        model = self._model
        ids = _args.token_array(tokens, model.info.vocab_size)
        native, ffi = model._native, model._native.ffi
        logits = np.empty(model.info.vocab_size, dtype=np.float32)
        native.check(native.lib.tl_context_append(
            self._require_open(), ffi.from_buffer("int32_t[]", ids), len(ids),
            model._check_depth(depth), ffi.from_buffer("float[]", logits, require_writable=True)))
        return logits

    def deepen(self, depth: int) -> np.ndarray:
        """Continue the whole sequence at a deeper loop depth from where its loop stopped
        (the context needs keep_loop_states=True); return the logits (float32, vocab)
        after the last token, as a sequence appended at `depth` from the start would give
        them. Later appends run at `depth`."""
        logits = np.empty(self._model.info.vocab_size, dtype=np.float32)
        self._deepen(depth, self._model._native.ffi.from_buffer("float[]", logits, require_writable=True),
                     None)
        return logits

    def score_deeper(self, depth: int) -> np.ndarray:
        """deepen(), returning instead log p(token[i+1] | tokens[..i]) for the whole
        sequence at `depth` (float32, length - 1), as score() gives them at that depth."""
        logprobs = np.empty(max(len(self) - 1, 0), dtype=np.float32)
        self._deepen(depth, None, self._model._native.ffi.from_buffer("float[]", logprobs,
                                                                         require_writable=True))
        return logprobs

    def _deepen(self, depth: int, last_logits: Any, logprobs: Any) -> None:
        model = self._model
        ffi = model._native.ffi
        model._native.check(model._native.lib.tl_context_deepen(
            self._require_open(), model._check_depth(depth),
            ffi.NULL if logprobs is None else logprobs,
            ffi.NULL if last_logits is None else last_logits))

    def load_prefix(self, cache: "_prefix.PrefixCache") -> None:
        """The sequence becomes the cache's prefix (what it held is dropped); appends then
        continue as after appending those tokens."""
        if not isinstance(cache, _prefix.PrefixCache):
            raise TypeError(f"cache must be a PrefixCache, not {type(cache).__name__}")
        self._model._native.check(self._model._native.lib.tl_context_load_prefix(
            self._require_open(), cache._require_open()))

    def prefix_cache(self, n_tokens: int = 0) -> "_prefix.PrefixCache":
        """A snapshot of the first n_tokens of the sequence (0 = all), with its kept loop
        states when the context keeps them."""
        n_tokens = _args.integer("n_tokens", n_tokens, minimum=0)
        native, ffi = self._model._native, self._model._native.ffi
        out = ffi.new("tl_prefix_cache **")
        native.check(native.lib.tl_prefix_cache_from_context(super()._require_open(), n_tokens, out))
        return _prefix.PrefixCache(self._model, out[0])

    def truncate(self, n_keep: int) -> None:
        n_keep = _args.integer("n_keep", n_keep, minimum=0)
        self._model._native.check(self._model._native.lib.tl_context_truncate(
            self._require_open(), n_keep))

    def reset(self) -> None:
        self._model._native.check(self._model._native.lib.tl_context_reset(self._require_open()))

    def fork(self) -> "Context":
        """A new context holding a copy of this sequence (tokens, KV cache, loop states;
        tl_context_fork), with the same options; the two then go on separately. With
        paged KV it shares this one's pages until either writes them."""
        model = self._model
        native, ffi = model._native, model._native.ffi
        out = ffi.new("tl_context **")
        native.check(native.lib.tl_context_fork(super()._require_open(), out))
        ctx = Context.__new__(Context)
        ctx._model = model
        ctx._keeps_states = self._keeps_states
        ctx._adopt(out[0])
        return ctx
