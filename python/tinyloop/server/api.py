"""OpenAI-style request bodies: checked field by field into generation options, and the
response bodies built from what a generation produced (docs/server.md).

A bad request raises RequestError, which the server turns into an HTTP 4xx with
OpenAI's error body naming the field (`param`); nothing is generated for it.
"""

from __future__ import annotations

import json
import math
import numbers
import secrets
import time
from dataclasses import dataclass, field, replace

from ..chat_template import ChatTemplateError, ChatTemplateUnavailable
from ..errors import InvalidArgumentError
from ..exit_rule import ExitRule, ExitRuleError
from ..grammar import SchemaError, json_object_grammar, json_schema_to_gbnf, request_grammar
from . import tools
from .errors import RequestError

# what both endpoints accept; each maps to a check below
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                  "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias",
                  "user",
                  # TinyLoop extensions (docs/server.md)
                  "top_k", "min_p", "repetition_penalty", "depth", "draft_depth", "n_draft",
                  "draft_p_min", "tree", "tree_budget", "response_format", "grammar", "exit"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                "tools", "tool_choice", "parallel_tool_calls"}
#: OpenAI's fields that change nothing here (storage, billing, other modalities): accepted
#: and ignored, named in the response's Warning header; a 400 with `strict`
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "reasoning_effort", "modalities",
                            "audio", "prediction", "web_search_options", "safety_identifier",
                            "prompt_cache_key", "verbosity"})
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_STOPS = 4
_MAX_TOP_LOGPROBS = 20   # the library's limit (TL_MAX_TOP_LOGPROBS), OpenAI's for chat
MAX_CHOICES = 16         # n
MAX_PROMPTS = 32         # prompts in one completions request
# tree speculation's limits (tl_generate_options: tree_widths, tree_budget)
_MAX_TREE_LEVELS, _MAX_TREE_WIDTH, _MAX_TREE_BUDGET = 8, 8, 63


@dataclass
class GenerationRequest:
    prompt_ids: list
    options: dict                  # keyword arguments of Model.stream
    stops: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    #: alternatives per token when log-probabilities are asked for (0: the token's own
    #: only); None = not asked for
    top_logprobs: int | None = None
    #: completions: the prompt is returned before the completion (with its logprobs)
    echo: bool = False
    prompt_text: str = ""
    #: choices per prompt
    n: int = 1
    #: completions: the prompts after the first, as (prompt_ids, prompt_text)
    more_prompts: list = field(default_factory=list)
    #: whether the request gave its seed (choice i then uses seed + i)
    seeded: bool = True
    #: this choice's place in the response (choices[].index), and its prompt's
    index: int = 0
    prompt_index: int = 0
    #: chat: the request's tools (tools.ToolCalling), None without
    tool_calling: object = None
    #: OpenAI fields accepted and ignored (IGNORED_FIELDS)
    ignored: list = field(default_factory=list)

    @property
    def prompts(self) -> list:
        return [(self.prompt_ids, self.prompt_text)] + self.more_prompts

    def choices(self) -> list:
        """One request per choice, prompt-major as OpenAI orders them (index = prompt
        index * n + i): choice i of a prompt samples with seed + i, or without a given
        seed with a random seed of its own."""
        out = []
        for p, (ids, text) in enumerate(self.prompts):
            for i in range(self.n):
                seed = self.options["seed"] + i if self.seeded or i == 0 else secrets.randbits(63)
                out.append(replace(self, prompt_ids=ids, prompt_text=text, more_prompts=[],
                                   n=1, index=p * self.n + i, prompt_index=p,
                                   options=dict(self.options, seed=seed)))
        return out


# -- field checks ----------------------------------------------------------------------
def _number(body, name, default, *, lo=None, hi=None, integer=False, below=None):
    """A numeric field in [lo, hi], or with `below` in [lo, below)."""
    value = body.get(name, default)
    if value is None:
        return default
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got "
                           f"{type(value).__name__}", name)
    if not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", name)
    if below is not None and value >= below:
        raise RequestError(f"{name} must be in [{lo}, {below}), got {value}", name)
    return int(value) if integer else float(value)


def flag_field(body, name, default=False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {type(value).__name__}", name)
    return value


def _only(body, name, allowed, what):
    """A field TinyLoop accepts only at its neutral value (e.g. n = 1)."""
    value = body.get(name)
    if value is not None and value not in allowed:
        raise RequestError(f"{name} = {value!r} is not supported: {what}", name)


def _stops(body) -> list:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stops) > _MAX_STOPS:
        raise RequestError(f"stop takes at most {_MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty", "stop")
    return stops


def check_fields(body, allowed: set, strict: bool = True) -> list:
    """A JSON object with none but the `allowed` fields; unless `strict`, OpenAI's
    IGNORED_FIELDS pass too, and are returned (sorted)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    extra = set(body) - allowed
    ignored = [] if strict else sorted(extra & IGNORED_FIELDS)
    unknown = sorted(extra - set(ignored))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (accepted: {', '.join(sorted(allowed))})",
                           unknown[0])
    return ignored


def _names(served) -> list:
    return [served] if isinstance(served, str) else list(served)


def check_model(body: dict, served) -> str:
    """The request's `model`, when given, is one of the served names (else a 404); the
    name the answer carries (the request's, else the first served name)."""
    names = _names(served)
    name = body.get("model")
    if name is not None and name not in names:
        raise RequestError(f"model {name!r} is not served here (this server runs "
                           f"{', '.join(map(repr, names))})", "model", status=404, code="model_not_found")
    return names[0] if name is None else name


def _common(body, model, served, allowed: set, max_tokens_name="max_tokens",
            min_tokens=1, strict=True, max_tokens_cap=None, default_exit=None) -> dict:
    ignored = check_fields(body, allowed, strict)
    name = check_model(body, served)
    n = _number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
    best_of = _number(body, "best_of", None, lo=1, hi=MAX_CHOICES, integer=True)
    if best_of is not None and best_of != n:
        raise RequestError(f"best_of = {best_of} with n = {n}: only best_of = n is supported "
                           f"(best_of above n would rank the choices by their log-probability, "
                           f"which this server does not do)", "best_of")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user must be a string", "user")
    info = model.info
    seed = body.get("seed")
    options = dict(
        max_tokens=_number(body, max_tokens_name, None, lo=min_tokens, hi=max_tokens_cap or 2**31 - 1,
                           integer=True),
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0),
        top_k=_number(body, "top_k", 0, lo=0, hi=info.vocab_size, integer=True),
        min_p=_number(body, "min_p", 0.0, lo=0.0, below=1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0.01, hi=100.0),
        seed=(secrets.randbits(63) if seed is None
              else _number(body, "seed", 0, lo=0, hi=2**63 - 1, integer=True)),
        depth=_number(body, "depth", 0, lo=0, hi=max(info.max_depth, 0), integer=True),
        draft_depth=_number(body, "draft_depth", 0, lo=-1, hi=max(info.max_depth, 0), integer=True),
        n_draft=_number(body, "n_draft", 0, lo=0, hi=32, integer=True),
        draft_p_min=_number(body, "draft_p_min", 0.0, lo=0.0, hi=1.0),
        tree=_tree(body),
        tree_budget=_number(body, "tree_budget", 0, lo=0, hi=_MAX_TREE_BUDGET, integer=True),
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        logit_bias=_logit_bias(body, info.vocab_size),
        grammar=_grammar(body, model),
        exit=_exit_rule(body, info, default_exit),
    )
    if options["tree"] and not options["draft_depth"]:
        raise RequestError("tree needs draft_depth (tree speculation drafts at that depth)", "tree")
    if options["top_p"] == 0.0:
        raise RequestError("top_p must be > 0", "top_p")
    if options["exit"] is not None and options["exit"].active and options["draft_depth"]:
        given = "" if "exit" in body else " (the server's default exit rule; send \"exit\": \"fixed\" to draft)"
        raise RequestError(f"exit {options['exit']}{given} does not combine with draft_depth", "exit")
    return options, n, seed is not None, name, ignored


def _tree(body) -> tuple:
    """TinyLoop's `tree` (tree speculation): the drafts' branching per level, a list of
    1..8 integers each 1..8 such as [3, 1, 1]; () without it."""
    value = body.get("tree")
    if value is None:
        return ()
    if not isinstance(value, list) or not 1 <= len(value) <= _MAX_TREE_LEVELS:
        raise RequestError(f"tree must be a list of 1..{_MAX_TREE_LEVELS} integers (the branching "
                           "per level)", "tree")
    return tuple(_number({"tree": width}, "tree", 1, lo=1, hi=_MAX_TREE_WIDTH, integer=True)
                 for width in value)


def _exit_rule(body, info, default):
    """TinyLoop's `exit` (adaptive depth): a string such as "kl:1e-3" or an object {"rule",
    "threshold", "min_depth", "patience"}; without it the server's default (None: fixed
    depth, no depths reported). A rule the model cannot run is refused here, by name."""
    value = body.get("exit")
    if value is None:
        return default
    try:
        rule = ExitRule.parse(value, field="exit")
    except ExitRuleError as e:
        raise RequestError(str(e), "exit") from None
    if rule.active and info.n_core == 0:
        raise RequestError(f"exit {rule}: this model has no loop, so no depth to exit early from", "exit")
    if rule.kind == "gate" and not info.metadata.get("loop.exit_gate"):
        raise RequestError(f"exit {rule}: this model has no exit gate (loop.exit_gate); use another rule",
                           "exit")
    return rule


def _grammar(body, model):
    """response_format ({"type": "text"}, {"type": "json_object"}: the built-in JSON
    object grammar, or {"type": "json_schema", "json_schema": {...}}: the schema's
    grammar) and TinyLoop's `grammar` (GBNF text); None when neither asks for one."""
    fmt, gbnf = body.get("response_format"), body.get("grammar")
    schema_gbnf = None
    kind = "text"
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema") or \
                set(fmt) - {"type", "json_schema"} or (fmt["type"] != "json_schema" and len(fmt) != 1):
            raise RequestError('response_format must be {"type": "text"}, {"type": "json_object"} or '
                               '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                               "response_format")
        kind = fmt["type"]
        if kind == "json_schema":
            schema_gbnf = _schema_grammar_text(fmt.get("json_schema"))
    if gbnf is not None and not isinstance(gbnf, str):
        raise RequestError("grammar must be a string of GBNF rules", "grammar")
    if gbnf is not None and kind != "text":
        raise RequestError(f'grammar and response_format {{"type": "{kind}"}} exclude each other', "grammar")
    try:
        if gbnf is not None:
            return request_grammar(model, gbnf)
        if schema_gbnf is not None:
            return request_grammar(model, schema_gbnf)
        return json_object_grammar(model) if kind == "json_object" else None
    except InvalidArgumentError as e:
        raise RequestError(str(e), "grammar" if gbnf is not None else "response_format") from None


def _schema_grammar_text(spec) -> str:
    """The GBNF of response_format's json_schema member (OpenAI's structured outputs:
    name, schema, and the optional description and strict)."""
    if not isinstance(spec, dict):
        raise RequestError('response_format {"type": "json_schema"} needs a json_schema object '
                           'with a name and a schema', "response_format")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise RequestError(f"response_format.json_schema: unknown key {sorted(unknown)[0]!r}", "response_format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("response_format.json_schema needs a name (a non-empty string)", "response_format")
    if "schema" not in spec:
        raise RequestError("response_format.json_schema needs a schema", "response_format")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise RequestError("response_format.json_schema.strict must be a boolean", "response_format")
    try:
        return json_schema_to_gbnf(spec["schema"])
    except SchemaError as e:
        raise RequestError(f"response_format.json_schema.schema{e}" if str(e).startswith("/")
                           else f"response_format.json_schema.schema: {e}", "response_format") from None


def _logit_bias(body, vocab_size: int) -> dict:
    """OpenAI's logit_bias: an object of token ids (as strings, JSON's keys) to -100..100."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError("logit_bias must be an object of token ids to biases", "logit_bias")
    bias = {}
    for key, b in value.items():
        # isdecimal and isascii: "²" is a digit to isdigit(), and no number to int()
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and int(key) < vocab_size):
            raise RequestError(f"logit_bias key {key!r} is not a token id below the vocabulary size "
                               f"{vocab_size}", "logit_bias")
        name = f"logit_bias[{key}]"   # the message names the field, not the bare key
        try:
            bias[int(key)] = _number({name: b}, name, 0.0, lo=-100.0, hi=100.0)
        except RequestError as e:
            raise RequestError(e.message, "logit_bias") from None
    return bias


def _stream_flags(body) -> tuple:
    stream = flag_field(body, "stream")
    usage = False
    extra = body.get("stream_options")
    if extra is not None:
        if not stream:
            raise RequestError("stream_options needs stream = true", "stream_options")
        if not isinstance(extra, dict) or set(extra) - {"include_usage"}:
            raise RequestError("stream_options accepts only include_usage", "stream_options")
        usage = flag_field(extra, "include_usage")
    return stream, usage


def _fit(options: dict, prompt_ids: list, model, param: str, cap=None) -> None:
    """Default max_tokens to what the context holds (at most `cap`); a prompt that does not
    fit is refused."""
    room = model.info.max_seq_len - len(prompt_ids)
    if room < 0:   # a prompt that fills the context still gives one token
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens and the model's context is "
                           f"{model.info.max_seq_len}: nothing can be generated", param,
                           code="context_length_exceeded")
    if options["max_tokens"] is None:
        options["max_tokens"] = min(room + 1, cap or room + 1)   # stops when the context is full


# -- requests ---------------------------------------------------------------------------
def _ask_logprobs(options: dict, top: int | None) -> int | None:
    """Switch the generation's log-probabilities on for `top` alternatives (None: off)."""
    if top is not None:
        options.update(logprobs=True, top_logprobs=top)
    return top


def completion_request(body, model, served, *, strict=True, max_tokens_cap=None,
                       default_exit=None) -> GenerationRequest:
    """A completions request; `served` is the served name or names, `strict` refuses
    IGNORED_FIELDS too, `max_tokens_cap` bounds max_tokens, `default_exit` is the exit
    rule of a request without `exit`."""
    echo = flag_field(body, "echo") if isinstance(body, dict) else False
    # with echo, max_tokens 0 scores the prompt alone (as evaluation harnesses ask)
    options, n, seeded, name, ignored = _common(body, model, served, COMPLETION_FIELDS,
                                                min_tokens=0 if echo else 1, strict=strict,
                                                max_tokens_cap=max_tokens_cap, default_exit=default_exit)
    if options["max_tokens"] is None:
        options["max_tokens"] = min(16, max_tokens_cap or 16)   # OpenAI's default for completions
    top = _ask_logprobs(options, _number(body, "logprobs", None, lo=0, hi=_MAX_TOP_LOGPROBS,
                                         integer=True))
    _only(body, "suffix", ("",), "no insertion")
    prompts = []
    for prompt, param in _prompt_list(body.get("prompt")):
        prompt_ids = prompt_token_ids(prompt, model, param)
        _fit(options, prompt_ids, model, param)
        prompts.append((prompt_ids, prompt if isinstance(prompt, str)
                        else model.tokenizer.decode(prompt_ids)))
    stream, usage = _stream_flags(body)
    (prompt_ids, prompt_text), *more = prompts
    return GenerationRequest(prompt_ids, options, _stops(body), stream, usage, name,
                             top_logprobs=top, echo=echo, prompt_text=prompt_text, n=n,
                             more_prompts=more, seeded=seeded, ignored=ignored)


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


def _prompt_list(prompt) -> list:
    """The request's prompts with the param naming each: one (a string or a list of token
    ids) or a list of several (strings or lists of token ids), named prompt[i]."""
    if isinstance(prompt, str) or (_is_token_list(prompt) and prompt):
        return [(prompt, "prompt")]
    if not (isinstance(prompt, list) and prompt):
        raise RequestError("prompt must be a non-empty string or list of token ids, or a list "
                           "of those", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are "
                           f"accepted in one request", "prompt")
    return [(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def prompt_token_ids(prompt, model, param: str, add_bos=None) -> list:
    """A prompt's ids: a string encoded (add_bos None: as the tokenizer does by default),
    or a list of token ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{param} is empty", param)
        return _encode(model, prompt, param, add_bos=add_bos)
    if _is_token_list(prompt) and prompt:
        bad = [t for t in prompt if not 0 <= t < model.info.vocab_size]
        if bad:
            raise RequestError(f"{param} token {bad[0]} is out of range for vocab size "
                               f"{model.info.vocab_size}", param)
        return list(prompt)
    raise RequestError(f"{param} must be a non-empty string or list of token ids", param)


def _encode(model, text: str, param: str, add_bos) -> list:
    try:
        return model.tokenizer.encode(text, add_bos=add_bos)
    except (TypeError, ValueError) as e:   # e.g. a lone surrogate escaped in the JSON
        raise RequestError(f"{param} is not valid text: {e}", param) from None


def chat_request(body, model, served, template, *, strict=True, max_tokens_cap=None,
                 default_exit=None) -> GenerationRequest:
    """A chat request (as completion_request), its tools checked and rendered (tools.py)."""
    name = "max_tokens"
    if isinstance(body, dict) and "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise RequestError("give max_tokens or max_completion_tokens, not both",
                               "max_completion_tokens")
        name = "max_completion_tokens"
    options, n, seeded, model_name, ignored = _common(body, model, served, CHAT_FIELDS, name, strict=strict,
                                                      max_tokens_cap=max_tokens_cap, default_exit=default_exit)
    calling = tools.parse_tools(body)
    if tools.constrained(calling):
        if options["grammar"] is not None:
            raise RequestError("tool_choice that requires a call excludes response_format and grammar",
                               "tool_choice")
        try:
            options["grammar"] = request_grammar(model, json_schema_to_gbnf(calling.schema()))
        except SchemaError as e:
            raise RequestError(f"tools: a parameter schema the grammar cannot follow: {e}", "tools") from None
        except InvalidArgumentError as e:
            raise RequestError(str(e), "tools") from None
    wanted = flag_field(body, "logprobs")
    top = _number(body, "top_logprobs", None, lo=0, hi=_MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise RequestError("top_logprobs needs logprobs = true", "top_logprobs")
    top = _ask_logprobs(options, (top or 0) if wanted else None)
    prompt_ids = chat_prompt_ids(body, model, template, calling=calling)
    _fit(options, prompt_ids, model, "messages", max_tokens_cap)
    stream, usage = _stream_flags(body)
    return GenerationRequest(prompt_ids, options, _stops(body), stream, usage, model_name,
                             top_logprobs=top, n=n, seeded=seeded, tool_calling=calling, ignored=ignored)


def chat_prompt_ids(body: dict, model, template, add_generation_prompt: bool = True,
                    calling=None) -> list:
    """The token ids of body["messages"] rendered through the model's chat template (no
    BOS beyond what the template writes); with `calling` (tools.ToolCalling) the tools
    too, in the template's `tools` or else in a system message before the others."""
    if template is None:
        raise RequestError("this model has no chat template (tokenizer.chat_template): use "
                           "/v1/completions", "messages")
    messages = _messages(body.get("messages"))
    extra = {}
    if calling is not None:
        if getattr(template, "reads_tools", False):
            extra["tools"] = calling.tools
        else:
            messages = [tools.tools_message(calling)] + messages
    try:
        text = template(messages, add_generation_prompt, **extra)
    except ChatTemplateUnavailable as e:
        raise RequestError(str(e), "messages", status=501, kind="server_error") from None
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from None
    return _encode(model, text, "messages", add_bos=False)


def _messages(messages) -> list:
    """The messages as the template gets them: content parts joined; `developer` (OpenAI's
    newer name of the system role) as `system`; an assistant's `tool_calls` (with null
    content) and a tool message's `tool_call_id` and `name` kept."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(f"{where} must be an object with role one of {', '.join(_ROLES)}",
                               where)
        role = "system" if m["role"] == "developer" else m["role"]
        entry = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(m["tool_calls"], where)
            if m.get("content") is None:
                entry["content"] = ""
                out.append(entry)
                continue
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"{where}: a tool message needs its tool_call_id (a string)", where)
            entry["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                entry["name"] = m["name"]
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{where}.content parts must be text parts", where)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string", where)
        entry["content"] = content
        out.append(entry)
    return out


def _tool_calls(calls, where: str) -> list:
    """An assistant message's tool_calls, their arguments parsed from JSON text into
    objects, as chat templates expect them."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", where)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise RequestError(f"{where}.tool_calls: each needs a function with a name", where)
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise RequestError(f"{where}.tool_calls: arguments are not JSON", where) from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# -- responses --------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _envelope(rid, model_name, obj: str, choices: list) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
            "choices": choices}


def completion_chunk(rid, model_name, text, finish=None, logprobs=None, index=0) -> dict:
    return _envelope(rid, model_name, "text_completion", [
        {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}])


def chat_chunk(rid, model_name, delta: dict, finish=None, logprobs=None, index=0) -> dict:
    return _envelope(rid, model_name, "chat.completion.chunk", [
        {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}])


def completion_body(rid, model_name, choices: list, usage_: dict) -> dict:
    """A whole answer; `choices` holds (text, finish_reason, logprobs) in index order."""
    return dict(_envelope(rid, model_name, "text_completion", [
        {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
        for i, (text, finish, logprobs) in enumerate(choices)]), usage=usage_)


def chat_body(rid, model_name, choices: list, usage_: dict) -> dict:
    """`choices` holds (message, finish_reason, logprobs): the message a dict, or its text."""
    return dict(_envelope(rid, model_name, "chat.completion", [
        {"index": i, "message": message if isinstance(message, dict) else {"role": "assistant", "content": message},
         "finish_reason": finish, "logprobs": logprobs}
        for i, (message, finish, logprobs) in enumerate(choices)]), usage=usage_)


def depth_report(record) -> dict | None:
    """A choice's `tinyloop` extension (docs/server.md, "Adaptive depth"): the loop depth
    of the pass that chose each completion token, and their mean; None when the
    generation reported no depths (a mode's own loop)."""
    if record.depths is None:
        return None
    depths = list(record.depths[:record.completion_tokens])
    return {"depths": depths, "mean_depth": sum(depths) / len(depths) if depths else 0.0}


# -- log-probabilities ----------------------------------------------------------------------
def token_text(tokenizer, token: int) -> tuple:
    """(the string OpenAI shows for a token, its bytes): the token's text, or for a token
    that holds part of a character "bytes:" and its bytes escaped, as OpenAI writes them."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_logprobs(tokenizer, entries) -> dict:
    """choices[].logprobs of a chat completion for these TokenLogprob entries."""
    def item(token, logprob):
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}
    return {"content": [dict(item(e.token, e.logprob),
                             top_logprobs=[item(t, lp) for t, lp in e.top]) for e in entries]}


def completion_logprobs(tokenizer, entries, offsets) -> dict:
    """choices[].logprobs of a (legacy) completion: parallel lists over the tokens, with
    null for the log-probability of a first prompt token (nothing predicts it)."""
    tokens, token_logprobs, tops = [], [], []
    for e in entries:
        tokens.append(token_text(tokenizer, e.token)[0])
        token_logprobs.append(e.logprob)
        top = None
        if e.logprob is not None:
            top = {}
            for t, lp in e.top:   # two ids of one text: the more likely one is kept
                top.setdefault(token_text(tokenizer, t)[0], lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": list(offsets)}
