"""The `tinyloop` command line: a thin layer over the Python API.

Every command takes --json; it then prints one JSON object as the last line of stdout
(also on failure: {"error": ..., "error_type": ...}). Progress and notes go to stderr.
docs/cli.md is the user documentation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .errors import TinyLoopError

# exit codes: 0 ok, 1 runtime error, 2 usage error (argparse), 130 interrupted
_EXIT_ERROR = 1
_EXIT_INTERRUPTED = 130


class CommandError(TinyLoopError):
    """A command cannot run as asked (e.g. no model given)."""


class _CountProgress:
    """`label: 3/10` on one stderr line, refreshed at most every 0.2 s."""

    def __init__(self, label: str):
        self.label = label
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.2:
            return
        self._last = now
        sys.stderr.write(f"\r{self.label}: {done}/{total}")
        sys.stderr.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load_config(args):
    from .config import Config, load_config
    return load_config(args.config) if getattr(args, "config", None) else Config()


def _open_model(args, config=None):
    """Load the model with the config's [model] settings and modes (Model.from_config),
    overridden by command-line flags.

    The model is MODEL (or -m), else the config's [model] path, else the default model;
    `args.default_model` is set to the DefaultModel used, or None."""
    from .default_model import resolve_model
    from .model import Model
    config = config if config is not None else _load_config(args)
    path = args.model or config.load_options().get("path")
    args.default_model = None
    if path:
        path = resolve_model(path)
    else:
        from .default_model import resolve_default_model
        args.default_model = resolve_default_model()
        path = str(args.default_model.path)
    overrides = {flag: getattr(args, flag)
                 for flag in ("threads", "device", "prefill_chunk", "cache_window", "cache_window_approx",
                              "state_init")
                 if getattr(args, flag, None) is not None}
    if getattr(args, "ctx_size", None) is not None:
        overrides["max_seq_len"] = args.ctx_size
    if getattr(args, "kv_policy", None) is not None:   # a ring's slots do not carry over
        overrides.update(kv_policy=args.kv_policy, kv_ring_slots=0)
    return Model.from_config(config, path=path, **overrides)


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


# -- generate -----------------------------------------------------------------------
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p",
                   "repetition_penalty", "seed", "stop", "draft_depth", "n_draft", "draft_p_min",
                   "tree", "tree_budget")


def _sampling(args, config) -> tuple:
    """(generation options, depth): the config's, overridden by the command-line flags
    (--stop given replaces the config's stop strings)."""
    options = config.generate_options()
    for flag in _SAMPLING_FLAGS:
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    if args.exit is not None:
        options["exit"] = args.exit
    depth = args.depth if args.depth is not None else config.model.depth
    return options, depth


def _exit(args, config):
    """The exit rule: --exit, else the config's [exit], else None (fixed depth)."""
    return args.exit if args.exit is not None else config.exit


def _depth_report(rule, mean_depth: float) -> dict:
    """What --json says of an exit rule's effect: the rule and the mean depth used."""
    return {"exit": None if rule is None else str(rule), "mean_depth": mean_depth}


def _read_grammar(args, model):
    """The Grammar of --grammar (a GBNF file) or --json-schema (a JSON Schema file), or None."""
    from .grammar import Grammar, SchemaError, json_schema_to_gbnf
    path = args.grammar or args.json_schema
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"{path}: cannot read: {e}") from None
    try:
        gbnf = text if args.grammar else json_schema_to_gbnf(text)
    except SchemaError as e:
        raise CommandError(f"{path}: {e}") from None
    return Grammar(model, gbnf)


_NO_PROMPT = "no prompt: give PROMPT, -p TEXT, -f FILE, or text on stdin"


def _read_prompt(args) -> str:
    """The prompt: -p TEXT, else the text of -f FILE, else PROMPT; `-` (or no prompt at
    all with stdin not a terminal) reads it from stdin. A file's or stdin's one final
    newline is dropped (as llama.cpp's -f does): `echo TEXT |` gives TEXT."""
    if args.prompt_file is not None:
        source = args.prompt_file
    elif args.prompt is not None:
        if args.prompt != "-":
            return args.prompt
        source = "-"
    elif sys.stdin is None or sys.stdin.isatty():
        args.command_parser.error(_NO_PROMPT)
    else:
        source = "-"
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"{source}: cannot read the prompt: {e}") from None
    if not text and args.prompt is None and args.prompt_file is None:
        # no prompt asked for and nothing on stdin (e.g. </dev/null in a script)
        args.command_parser.error(_NO_PROMPT + " (stdin was empty)")
    return text[:-1] if text.endswith("\n") else text


def _ran_depth(stream, depth: int, model) -> int:
    """The loop depth a generation ran at (its deepest with an exit rule): the stream's
    after the modes' hooks, else the one asked for, 0 meaning the model's default."""
    options = getattr(stream, "_options", None)
    return options.depth if options is not None else depth or model.info.default_depth


def cmd_generate(args) -> dict:
    from .plugins import generation_mode
    from .text_generation import TextGeneration, TextPipe
    config = _load_config(args)
    options, depth = _sampling(args, config)
    prompt = _read_prompt(args)
    with _open_model(args, config) as model:
        grammar = _read_grammar(args, model)
        if grammar is not None:
            options["grammar"] = grammar
        tokenizer = model.tokenizer
        prompt_ids = tokenizer.encode(prompt)
        mode = generation_mode(model.modes)
        # stop strings end the text where they start, however the tokens split them
        record = TextGeneration(prompt_tokens=len(prompt_ids))
        pipe = TextPipe(tokenizer, list(options.get("stop") or ()), record, prompt_ids)
        started = time.perf_counter()
        # the model applies its modes; a strategy's stream has no result of its own
        stream = model.stream(prompt_ids, depth=depth, **options)
        generated, pieces, stopped = [], [], False
        try:
            for token in stream:
                generated.append(token)
                piece, stopped = pipe.push(token)
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
                if stopped:
                    break
            if not stopped:
                pieces.append(pipe.end(stream.result))
                sys.stdout.write(pieces[-1])
        finally:
            stream.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        elapsed = time.perf_counter() - started
        text = ("".join(pieces) if options.get("stop")   # the text before the first stop string
                else tokenizer.decode_continuation(prompt_ids, generated))
        payload = {"model": model.path, "text": text,
                   "tokens": generated, "n_tokens": len(generated),
                   "prompt_tokens": len(prompt_ids),
                   "depth": _ran_depth(stream, depth, model), "mode": mode.name if mode else None,
                   "seconds": elapsed, "depths": stream.depths}
        if stopped:   # a stop string ended it before the library's stream did
            payload.update(stop_reason="stop_sequence", **_depth_report(
                options.get("exit"), float(np.mean(stream.depths)) if stream.depths else 0.0))
            _note(f"[{len(generated)} tokens, stop: stop_sequence]")
        elif stream.result is not None:
            r = stream.result
            payload.update(stop_reason=r.stop_reason, prefill_seconds=r.prefill_seconds,
                           decode_seconds=r.decode_seconds,
                           prefill_tokens_per_s=r.prefill_tokens_per_s,
                           decode_tokens_per_s=r.decode_tokens_per_s,
                           **_depth_report(options.get("exit"), r.mean_depth))
            drafts = ""
            if r.drafted_tokens:
                payload.update(drafted_tokens=r.drafted_tokens, accepted_tokens=r.accepted_tokens)
                drafts = f", drafts kept {r.accepted_tokens}/{r.drafted_tokens}"
            if options.get("exit") is not None:
                drafts += f", mean depth {r.mean_depth:.2f}"
            _note(f"[{len(generated)} tokens, stop: {r.stop_reason}, prefill "
                  f"{r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s"
                  f"{drafts}]")
        return payload


# -- score ---------------------------------------------------------------------------
def cmd_score(args) -> dict:
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"{args.file}: cannot read text: {e}") from None
    config = _load_config(args)
    rule = _exit(args, config)
    with _open_model(args, config) as model:
        ids = model.tokenizer.encode(text)
        if args.logit_lens:
            return _logit_lens(args, model, ids)
        if len(ids) < 2:
            raise CommandError(f"{args.file}: needs at least 2 tokens to score, has {len(ids)}")
        ctx = args.ctx if args.ctx is not None else model.info.max_seq_len
        progress = _CountProgress("scoring windows")
        started = time.perf_counter()
        try:
            *scored, depths = model.score_windows(ids, depth=args.depth, ctx=ctx, progress=progress,
                                                  uncertainty=args.uncertainty, exit=rule,
                                                  with_depths=True)
        finally:
            progress.finish()
        elapsed = time.perf_counter() - started
        model_path, default_depth = model.path, model.info.default_depth
    logprobs, entropies = scored if args.uncertainty else (scored[0], None)
    perplexity = float(np.exp(-np.mean(logprobs, dtype=np.float64)))
    payload = {"model": model_path, "perplexity": perplexity, "tokens": len(ids),
               "scored_tokens": len(logprobs),
               "tokens_per_s": len(ids) / elapsed if elapsed > 0 else 0.0,
               "ctx": ctx, "depth": args.depth or default_depth, "seconds": elapsed,
               **_depth_report(rule, float(np.mean(depths, dtype=np.float64)))}
    shown = ["perplexity", "tokens", "tokens_per_s"]
    if rule is not None:
        shown.append("mean_depth")
    if args.uncertainty:
        payload["mean_entropy"] = float(np.mean(entropies, dtype=np.float64))
        shown.append("mean_entropy")
    if not args.json:
        for key in shown:
            print(f"{key}: {payload[key]:.4f}" if isinstance(payload[key], float)
                  else f"{key}: {payload[key]}")
    return payload


def _logit_lens(args, model, ids: list) -> dict:
    """score --logit-lens: the next token after the whole text at every loop depth
    1..--depth (0 = the model's max_depth), each depth's most likely tokens."""
    from .logit_lens import lens_rows
    if len(ids) > model.info.max_seq_len:
        raise CommandError(f"{args.file}: {len(ids)} tokens do not fit the context of "
                           f"{model.info.max_seq_len} (--logit-lens reads the whole text at once)")
    logits = model.score_logit_lens(ids, max_depth=args.depth)
    rows = lens_rows(logits, args.top, lambda t: model.tokenizer.decode([t]))
    if not args.json:
        for row in rows:
            best = ", ".join(f"{item['text']!r} {np.exp(item['logprob']):.3f}" for item in row["top_logprobs"])
            print(f"depth {row['depth']:2d}: entropy {row['entropy']:.3f}  {best}")
    return {"model": model.path, "tokens": len(ids), "max_depth": len(rows), "logit_lens": rows}


# -- bench ---------------------------------------------------------------------------
def cmd_bench(args) -> dict:
    config = _load_config(args)
    rule = _exit(args, config)
    with _open_model(args, config) as model:
        info = model.info
        needed = args.prompt_tokens + args.new_tokens
        if needed > info.max_seq_len:
            raise CommandError(f"--prompt-tokens + --new-tokens = {needed} exceeds the model's "
                               f"max_seq_len {info.max_seq_len}")
        rng = np.random.default_rng(args.seed)
        prompt = rng.integers(0, info.vocab_size, size=args.prompt_tokens, dtype=np.int32)
        # greedy and never stopping on EOS, so every run does the same amount of work
        run = dict(max_tokens=args.new_tokens, depth=args.depth, temperature=0.0, eos=False, exit=rule)
        model.generate(prompt[:8], **dict(run, max_tokens=min(8, args.new_tokens)))  # warm-up
        prefill, decode, depths = [], [], []
        progress = _CountProgress("bench runs")
        try:
            for i in range(args.repeat):
                result = model.generate(prompt, **run)
                prefill.append(result.prefill_tokens_per_s)
                decode.append(result.decode_tokens_per_s)
                depths.append(result.mean_depth)
                progress(i + 1, args.repeat)
        finally:
            progress.finish()
        payload = {
            "model": model.path,
            "prefill_tokens_per_s": statistics.median(prefill),
            "decode_tokens_per_s": statistics.median(decode),
            "peak_rss_mb": _peak_rss_mb(),
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "repeat": args.repeat, "threads": info.n_threads, "depth": args.depth or info.default_depth,
            "device": info.device_name, "memory": model.memory_report(),
            "runs": {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "mean_depth": depths},
            **_depth_report(rule, statistics.median(depths)),
        }
    if not args.json:
        shown = ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb") + (("mean_depth",) if rule else ())
        for key in shown:
            print(f"{key}: {payload[key]:.2f}")
    return payload


# -- info ----------------------------------------------------------------------------
_DIM_KEYS = ("vocab_size", "d_model", "n_head", "n_kv_head", "head_dim", "ffn_dim", "n_pre",
             "n_core", "n_post", "default_depth", "max_depth", "max_seq_len")


def _tensor_summary(path: str) -> tuple[dict, int]:
    from .fileformat.tinyloop_file import read_file
    dtypes: dict = {}
    parameters = 0
    with read_file(path) as f:
        for name, entry in f.tensors.items():
            row = dtypes.setdefault(entry.dtype, {"tensors": 0, "bytes": 0, "parameters": 0})
            count = int(np.prod(entry.shape, dtype=np.int64))
            row["tensors"] += 1
            row["bytes"] += entry.size
            row["parameters"] += count
            if name != "vocab.frequency":   # token statistics, not a weight
                parameters += count
    return dtypes, parameters


def _print_card(payload: dict) -> None:
    """The lines `tinyloop info` adds for the default model: where it came from, its card."""
    origin = ("shipped in the package" if payload["default_model"] == "package"
              else f"from ${payload['default_model']}")
    print(f"default:      yes ({origin})")
    if payload["card"] is None:
        card_name = Path(payload["path"]).with_suffix(".md").name
        print(f"card:         none (no {card_name} next to the model)")
        return
    print(f"card:         {payload['card_path']}")
    print()
    print(payload["card"].rstrip("\n"))


def _memory_line(memory: dict) -> str:
    """memory_report() for `tinyloop info`: the byte counts in MiB, named without their
    `_bytes`; paged KV's page size and pages in use are counts, shown as such."""
    mib = 2**20
    parts = [f"{k.removesuffix('_bytes')} {v / mib:.1f} MiB"
             for k, v in memory.items() if k.endswith("_bytes")]
    if memory.get("kv_page_size"):
        parts.append(f"kv pages {memory['kv_pages_in_use']} in use of "
                     f"{memory['kv_page_size']} tokens each")
    return ", ".join(parts)


def _cache_window_cost(model) -> dict | None:
    """With a cache window: the KV bytes of one context (measured on the memory report)
    against a context without it."""
    info = model.info
    if not info.cache_window:
        return None

    def context_bytes(**options):
        before = model.memory_report()["kv_cache_bytes"]
        with model.context(**options):
            return model.memory_report()["kv_cache_bytes"] - before
    return {"positions": info.cache_window, "approximate": bool(info.cache_window_approx),
            "context_kv_bytes": context_bytes(), "full_kv_bytes": context_bytes(cache_window=0)}


def cmd_info(args) -> dict:
    from .kv_cost import kv_cost_rows
    with _open_model(args) as model:
        info = model.info
        dtypes, parameters = _tensor_summary(model.path)
        memory = model.memory_report()
        window = _cache_window_cost(model)
        kv_policy = model.kv_policy_report()
        has_tokenizer = model.metadata_string("tokenizer.json") is not None
    architecture = {k: v for k, v in info.metadata.items() if k.startswith(("arch.", "loop."))}
    other = {k: v for k, v in info.metadata.items() if k not in architecture}
    payload = {"path": info.path, "name": info.name, "file_bytes": Path(info.path).stat().st_size,
               "parameters": parameters, "dims": {k: getattr(info, k) for k in _DIM_KEYS},
               "architecture": architecture, "metadata": other, "dtypes": dtypes,
               "tokenizer": has_tokenizer, "bos_token": info.bos_token,
               "eos_token": info.eos_token, "device": info.device_name,
               "threads": info.n_threads, "memory": memory, "draft_vocab": info.draft_vocab,
               "body_dtype": info.body_dtype, "kv_dtype": info.kv_dtype, "kv_per_token": kv_cost_rows(info),
               "cache_window": window, "kv_policy": kv_policy}
    default = args.default_model
    if default is not None:
        # no model named: show which model that is, and its card
        payload.update(default_model=default.source,
                       card_path=str(default.card_path) if default.card_path else None,
                       card=default.card())
    if not args.json:
        mib = 2**20
        print(f"model:        {info.path}")
        print(f"name:         {info.name or '-'}")
        print(f"parameters:   {parameters:,} ({payload['file_bytes'] / mib:.1f} MiB on disk)")
        print("dims:         " + ", ".join(f"{k}={v}" for k, v in payload["dims"].items()))
        print("architecture: " + (", ".join(f"{k}={v}" for k, v in sorted(architecture.items()))
                                  or "defaults (docs/format.md)"))
        for dtype, row in sorted(dtypes.items()):
            print(f"dtype {dtype:5s}   {row['tensors']} tensors, {row['parameters']:,} values, "
                  f"{row['bytes'] / mib:.1f} MiB")
        print(f"tokenizer:    {'yes' if has_tokenizer else 'no'} (bos {info.bos_token}, "
              f"eos {info.eos_token})")
        print(f"device:       {info.device_name}, {info.n_threads} threads")
        print("drafts:       " + (f"score the {info.draft_vocab} most frequent tokens (draft_vocab)"
                                   if info.draft_vocab else "score every token"))
        print(f"loop body:    {info.body_dtype} ({memory['body_bytes'] / mib:.1f} MiB)")
        print(f"kv dtype:     {info.kv_dtype}")
        for row in payload["kv_per_token"]:
            print(f"kv cache:     depth {row['depth']}: {row['slots']} slots, "
                  f"{row['bytes_per_token'] / 1024:.1f} KiB per token (kv_share share_last: "
                  f"{row['share_last_bytes_per_token'] / 1024:.1f} KiB, store_h: "
                  f"{row['store_h_bytes_per_token'] / 1024:.1f} KiB)")
        policy = payload["kv_policy"]
        print(f"kv policy:    {policy['kv_policy']}, {policy['kv_bytes_per_token'] / 1024:.1f} KiB per token "
              f"at max depth {info.max_depth}")
        if window:
            print(f"cache window: {window['positions']} positions "
                  f"({'approximate' if window['approximate'] else 'exact'}): a context's KV "
                  f"{window['context_kv_bytes'] / mib:.2f} MiB, without the window "
                  f"{window['full_kv_bytes'] / mib:.2f} MiB (max_seq_len {info.max_seq_len})")
        print("memory:       " + _memory_line(memory))
        if default is not None:
            _print_card(payload)
    return payload


# -- modes ---------------------------------------------------------------------------
def _option_row(option) -> dict:
    from .plugins import REQUIRED
    return {"name": option.name, "type": option.type.__name__,
            "default": None if option.default is REQUIRED else option.default,
            "required": option.default is REQUIRED, "help": option.help,
            "choices": list(option.choices) if option.choices is not None else None,
            "minimum": option.minimum, "maximum": option.maximum}


def cmd_modes(args) -> dict:
    from .plugins import default_registry
    registry = default_registry()
    modes = []
    for name in registry.names():
        plugin = registry.get(name)
        modes.append({"name": name, "description": plugin.description, "origin": registry.origin(name),
                      "conflicts": sorted(plugin.conflicts), "requires": sorted(plugin.requires),
                      "options": [_option_row(o) for o in plugin.options]})
    if not args.json:
        for mode in modes:
            print(f"[modes.{mode['name']}]  {mode['description']}")
            for relation in ("conflicts", "requires"):
                if mode[relation]:
                    print(f"    {relation} with: {', '.join(mode[relation])}" if relation == "conflicts"
                          else f"    requires: {', '.join(mode[relation])}")
            for o in mode["options"]:
                default = "required" if o["required"] else f"default {o['default']!r}"
                limits = (f", one of {', '.join(map(repr, o['choices']))}" if o["choices"] else "")
                print(f"    {o['name']} ({o['type']}, {default}{limits}): {o['help']}")
            print()
    return {"modes": modes}


# -- convert / quantize / pull ------------------------------------------------------------
def _delegated(name: str):
    """The entry point of a tool command; it parses its own arguments (see --help)."""
    from .convert import cli_entry
    return {"convert": cli_entry.main_convert, "quantize": cli_entry.main_quantize,
            "pull": cli_entry.main_pull, "list": cli_entry.main_list, "rm": cli_entry.main_rm}[name]


_DELEGATED = ("convert", "quantize", "pull", "list", "rm")


def _api_key(args) -> str | None:
    """The API key: --api-key, else the first line of --api-key-file, else $TINYLOOP_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise CommandError("give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    if key is None:
        key = os.environ.get("TINYLOOP_API_KEY") or None
    if key is not None and not (key.isascii() and key.isprintable() and key.strip() == key and key):
        raise CommandError("the API key must be printable ASCII without spaces around it")
    return key


def cmd_serve(args) -> dict:
    from .server import ServerOptions, serve
    if args.port > 65535:
        raise CommandError(f"--port {args.port} is out of range (0-65535)")
    options = ServerOptions(api_key=_api_key(args), metrics_need_key=not args.public_metrics,
                            cors_origins=tuple(args.cors_origin or ()),
                            allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
                            max_waiting=args.max_waiting, max_tokens=args.max_tokens_cap,
                            request_timeout=args.request_timeout, strict=args.strict,
                            max_connections=args.max_connections, drain_timeout=args.drain_timeout,
                            json_logs=args.log_json)
    config = _load_config(args)
    options.exit = _exit(args, config)   # the replicas' too, under --ray
    if args.ray and args.kv_policy is not None:   # the replicas load the config, not this flag
        raise CommandError("--kv-policy: not with --ray; name the policy in --config's [modes.kv_share]")
    if args.ray:
        return _serve_on_ray(args, options)
    ray_only = [flag for flag, value in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                                         ("--max-replicas", args.max_replicas),
                                         ("--target-ongoing-requests", args.target_ongoing_requests),
                                         ("--ray-address", args.ray_address),
                                         ("--prefix-routing", args.prefix_routing or None),
                                         ("--replica-cpus", args.replica_cpus),
                                         ("--replica-gpus", args.replica_gpus)) if value is not None]
    if ray_only:
        raise CommandError(f"{', '.join(ray_only)}: only with --ray")
    if args.verify_checksums:
        config = replace(config, model=replace(config.model, verify_checksums=True))
    with _open_model(args, config) as model:
        names = args.names or [Path(model.path).stem]
        serve(model, host=args.host, port=args.port, name=names, parallel=args.parallel,
              prompt_cache=args.prompt_cache, batch_decode=args.batch_decode,
              log=lambda line: print(line, file=sys.stderr, flush=True), options=options)
    return {"model": model.path, "name": names[0], "names": names}


def _serve_on_ray(args, options) -> dict:
    """`serve --ray`: the replicas on Ray Serve (docs/scale-out.md); Ray is imported here only."""
    if args.port == 0:
        raise CommandError("--ray needs a fixed --port (Ray's HTTP proxy takes no port 0)")
    autoscaling = None
    if args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        if low > args.max_replicas:
            raise CommandError(f"--min-replicas {low} is above --max-replicas {args.max_replicas}")
        autoscaling = {"min_replicas": low, "max_replicas": args.max_replicas,
                       "initial_replicas": min(max(args.replicas or low, low), args.max_replicas),
                       "target_ongoing_requests": args.target_ongoing_requests or args.parallel}
    elif args.min_replicas is not None or args.target_ongoing_requests is not None:
        raise CommandError("--min-replicas and --target-ongoing-requests need --max-replicas (autoscaling)")
    from .server.app import is_loopback
    if args.ray_address is None and not os.environ.get("RAY_ADDRESS") and is_loopback(args.host):
        # a loopback server's own local cluster: Ray's processes on the loopback address
        # too (read when Ray is imported; Ray's single-machine mode, docs/scale-out.md)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # the replicas load the model from --config: flags that would only reach this process
    for flag, key in (("state_init", "model.state_init"), ("cache_window", "model.cache_window"),
                      ("cache_window_approx", "model.cache_window_approx")):
        if getattr(args, flag, None) is not None:
            raise CommandError(f"--{flag.replace('_', '-')} with --ray: set {key} in the --config file")
    try:
        from .server import ray_serve
    except ImportError as e:
        raise CommandError(f"--ray needs Ray Serve: pip install 'tinyloop-runtime[ray]' ({e})") from None
    cpus = args.replica_cpus if args.replica_cpus is not None else (args.threads or 1)
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1 if (args.device or "").startswith("cuda") else 0
    # a replica's threads default to its share of CPUs, not every core of its node
    threads = args.threads if args.threads is not None else max(1, int(cpus))
    spec = ray_serve.ReplicaSpec(model=args.model, config=args.config, threads=threads, device=args.device,
                                 max_seq_len=args.ctx_size, prefill_chunk=args.prefill_chunk,
                                 verify_checksums=args.verify_checksums, names=args.names,
                                 parallel=args.parallel, prompt_cache=args.prompt_cache,
                                 batch_decode=args.batch_decode, options=options, host=args.host)
    ray_serve.run(spec, port=args.port, address=args.ray_address, replicas=args.replicas or 1,
                  autoscaling=autoscaling, num_cpus=cpus, num_gpus=gpus, prefix_routing=args.prefix_routing)
    return {"model": args.model, "names": args.names, "ray": True, "replicas": args.replicas or 1,
            "autoscaling": autoscaling, "prefix_routing": args.prefix_routing}


# -- chat --------------------------------------------------------------------------------
def cmd_chat(args) -> dict:
    from .chat_template import load_chat_template
    from .prompt_cache import PromptCache
    from .text_generation import TextGeneration, generate_text
    config = _load_config(args)
    options, depth = _sampling(args, config)
    with _open_model(args, config) as model:
        render = load_chat_template(model)
        if render is None:
            raise CommandError(f"{model.path} has no chat template (tokenizer.chat_template): "
                               "use `tinyloop generate`")
        messages = [{"role": "system", "content": args.system}] if args.system else []
        stops = list(options.get("stop") or ())   # matched on the reply's text
        interactive = sys.stdin.isatty()
        # each turn continues the conversation's sequence: only the new message runs
        cache, depth = PromptCache(model, 1), depth or model.info.default_depth
        prompt_tokens, cached_tokens = [], []
        try:
            while True:
                if interactive:
                    print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                text = line.rstrip("\n")
                if not line or text.strip() in ("/exit", "/quit"):
                    break
                if not text.strip():
                    continue
                messages.append({"role": "user", "content": text})
                ids = _fit_chat(model, render, messages)
                if ids is None:
                    continue
                record = TextGeneration(prompt_tokens=len(ids))
                lease, reply, ok = cache.acquire(ids, depth, options.get("exit")), [], False
                try:
                    for piece in generate_text(model, lease.rest, stops, dict(options, depth=depth),
                                               record, context=lease.context):
                        reply.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    ok = True
                finally:
                    cache.release(lease, ids + record.token_ids, ok)
                sys.stdout.write("\n")
                sys.stdout.flush()
                messages.append({"role": "assistant", "content": "".join(reply)})
                prompt_tokens.append(len(ids))
                cached_tokens.append(lease.cached)
        finally:
            cache.close()
        return {"model": model.path, "turns": len(prompt_tokens), "messages": messages,
                "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}


def _fit_chat(model, render, messages: list):
    """The prompt ids of the conversation, its oldest turns dropped until a reply has
    room in the context; None, with the new message dropped and the history kept, when
    that message does not fit even alone."""
    limit = model.info.max_seq_len

    def prompt_ids(conversation):
        return model.tokenizer.encode(render(conversation), add_bos=False)

    kept = 1 if messages[0]["role"] == "system" else 0   # the system message stays
    alone = len(prompt_ids(messages[:kept] + messages[-1:]))
    if alone >= limit:
        messages.pop()
        _note(f"[the message does not fit the context of {limit} tokens ({alone}): not sent]")
        return None
    dropped = 0
    ids = prompt_ids(messages)
    while len(ids) >= limit:
        messages.pop(kept)
        dropped += 1
        ids = prompt_ids(messages)
    if dropped:
        _note(f"[dropped the {dropped} oldest messages to fit the context of {limit}]")
    return ids


# -- parser ------------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite(minimum_excluded: bool, unit: str = ""):
    def parse(text: str) -> float:
        value = float(text)
        if not value == value or value < 0 or (minimum_excluded and value == 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number{unit} "
                                             f"{'> 0' if minimum_excluded else '>= 0'}, got {text}")
        return value
    return parse


_positive_float, _non_negative_float = _finite(True, " of seconds"), _finite(False, " of seconds")
_positive_number, _non_negative_number = _finite(True), _finite(False)


def _exit_rule(text: str):
    from .exit_rule import ExitRule, ExitRuleError
    try:
        return ExitRule.parse(text)
    except ExitRuleError as e:   # argparse names --exit: the message names the part at fault
        part = e.key.partition(".")[2]
        raise argparse.ArgumentTypeError(f"{part}: {e.problem}" if part else e.problem) from None


def _add_exit_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--exit", type=_exit_rule, metavar="RULE:THRESHOLD",
                   help=f"adaptive depth: the exit rule of {what}, e.g. kl:1e-3, latent_delta:0.05, "
                        "argmax_stable:3, gate:0.9, fixed (docs/cli.md); default: the config's [exit]")


def _tree_shape(text: str) -> tuple:
    """--tree 3,1,1: the drafts' branching per level, 1..8 levels of 1..8 each."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 3,1,1, got {text!r}") from None
    if not 1 <= len(widths) <= 8 or not all(1 <= w <= 8 for w in widths):
        raise argparse.ArgumentTypeError(f"needs 1..8 levels, each 1..8, got {text!r}")
    return widths


def _below_one(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:   # the library's range: 1 would keep only the top tokens' ties
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _stop_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


# the defaults --help shows for the flags whose unset value means "the config's, else
# this": the library's (tl_generate_options_default), as SAMPLING_OPTIONS holds them
def _sampling_default(name: str) -> str:
    from .config import SAMPLING_OPTIONS
    return f"default: the config's, else {next(o.default for o in SAMPLING_OPTIONS if o.name == name)}"


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=_positive, help="new tokens at most; " + _sampling_default("max_tokens"))
    p.add_argument("--depth", type=_non_negative,
                   help="loop depth (0 = the model's default); default: the config's, else 0")
    p.add_argument("--temperature", type=float, help="0 = greedy; " + _sampling_default("temperature"))
    p.add_argument("--top-k", type=_non_negative, help="0 = off; " + _sampling_default("top_k"))
    p.add_argument("--top-p", type=float, help="1 = off; " + _sampling_default("top_p"))
    p.add_argument("--min-p", type=_below_one, help="0 = off, below 1; " + _sampling_default("min_p"))
    p.add_argument("--repetition-penalty", type=float, help="1 = off; " + _sampling_default("repetition_penalty"))
    p.add_argument("--seed", type=_non_negative, help="sampling seed; " + _sampling_default("seed"))
    p.add_argument("--stop", action="append", type=_stop_text, metavar="TEXT",
                   help="end the text before TEXT (repeatable); default: the config's sampling.stop, else none")
    drafts = p.add_argument_group("speculative decoding (docs/api.md, \"Speculative decoding\", \"Tree speculation\")")
    drafts.add_argument("--draft-depth", type=int, metavar="L",
                        help="draft tokens at loop depth L, verified at --depth (-1 = the model file's "
                             "draft.depth, else 1); default: 0 = off")
    drafts.add_argument("--n-draft", type=_non_negative, metavar="N",
                        help="tokens per draft round (at most 32); default: 0 = the file's, else 4")
    drafts.add_argument("--draft-p-min", type=_non_negative_number, metavar="P",
                        help="stop a round at a draft less likely than P; default: 0 = never")
    drafts.add_argument("--tree", type=_tree_shape, metavar="W,W,...",
                        help="tree speculation with --draft-depth: the drafts' branching per level, "
                             "e.g. 3,1,1; default: a chain")
    drafts.add_argument("--tree-budget", type=_non_negative, metavar="N",
                        help="drafted tree nodes per round at most (1..63); default: 0 = the shape's size")
    _add_exit_flag(p, "every token")


def _add_runtime_flags(p: argparse.ArgumentParser, ctx_size: bool = True) -> None:
    p.add_argument("-t", "--threads", type=_non_negative,
                   help="CPU threads (0 = all cores); default: the config's, else 0")
    if ctx_size:
        p.add_argument("-c", "--ctx-size", type=_non_negative, metavar="N",
                       help="context length in tokens (0 = the model's max_seq_len); default: the "
                            "config's model.max_seq_len, else 0")
    p.add_argument("--prefill-chunk", type=_non_negative, metavar="N",
                   help="prompt tokens per forward pass (0 = the library's choice); default: the "
                        "config's model.prefill_chunk, else 0")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto; default: the config's, else cpu")
    p.add_argument("--cache-window", type=_non_negative, metavar="N",
                   help="keep only the last N positions' K/V, in a ring: KV memory stops growing and "
                        "generation goes on past max_seq_len (0 = off); default: the config's "
                        "model.cache_window, else 0")
    p.add_argument("--cache-window-approx", action="store_true", default=None,
                   help="allow --cache-window on a model whose attention sees more than N positions "
                        "(approximate); default: the config's model.cache_window_approx, else off")
    p.add_argument("--state-init", choices=("file", "warm"),
                   help="where each position's loop starts: the file's state init, or warm (the "
                        "previous position's final loop state); default: the config's, else file")
    p.add_argument("--kv-policy", choices=("exact", "share_last", "store_h"),
                   help="the KV cache of the loop (docs/model.md): exact, share_last (approximate) or "
                        "store_h (exact, block inputs kept, K/V recomputed); default: the config's "
                        "[modes.kv_share], else exact")
    p.add_argument("--config", help="a tinyloop.toml with model, sampling and modes; default: none")


_MODEL_HELP = ("model file, pulled name (smollm2-135m) or tinyloop-smollm2-looped; default: "
               "[model] path of --config, else $TINYLOOP_DEFAULT_MODEL, else the model "
               "shipped in the package")


def _add_model_arguments(p: argparse.ArgumentParser, positional_help: str | None = None) -> None:
    """-m/--model, and the MODEL argument (added here, before the other positionals)."""
    p.add_argument("-m", "--model", dest="model_option", metavar="MODEL", help=_MODEL_HELP)
    if positional_help is not None:
        p.add_argument("model", nargs="?", metavar="MODEL", help=positional_help)


def _merge_model_arguments(args) -> None:
    """-m MODEL and the MODEL argument are two spellings of one thing: it is given once."""
    option = getattr(args, "model_option", None)
    if option is None:
        return
    if getattr(args, "model", None) is not None:
        args.command_parser.error(f"the model is given twice ({args.model} and -m {option})")
    args.model = option


class _HelpFormatter(argparse.HelpFormatter):
    """--help names every option's default: the help's own words when they say it,
    else the parser's default value."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default:" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return text
        shown = "off" if action.default is False else action.default
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _merge_prompt_arguments(args) -> None:
    """generate: with -p or -f the one positional argument is the MODEL; without them one
    positional argument is the PROMPT, two are MODEL PROMPT."""
    if getattr(args, "command", None) != "generate":
        return
    given = args.prompt_option is not None or args.prompt_file is not None
    if given:
        if args.prompt is not None:
            if args.model is not None:
                args.command_parser.error(f"the prompt is given twice ({args.prompt!r} and -p/-f)")
            args.model = args.prompt
        args.prompt = args.prompt_option
    elif args.prompt is None and args.model is not None:
        args.prompt, args.model = args.model, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyloop",
                                     description="Inference for weight-shared looped transformers.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, handler, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        p.add_argument("--json", action="store_true",
                       help="print one JSON object as the last line of stdout")
        p.set_defaults(handler=handler, command_parser=p)
        return p

    # one positional argument is the PROMPT; two are MODEL PROMPT (docs/cli.md)
    p = command("generate", cmd_generate, "generate text, streamed as it comes")
    _add_model_arguments(p, "as -m MODEL; a single positional argument is the PROMPT "
                            "(the MODEL with -p or -f)")
    p.add_argument("prompt", nargs="?", metavar="PROMPT",
                   help="the prompt; - reads it from stdin; default: -p, -f, else stdin when it "
                        "is not a terminal")
    source = p.add_mutually_exclusive_group()
    source.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT",
                        help="the prompt, as PROMPT; default: none")
    source.add_argument("-f", "--file", dest="prompt_file", metavar="FILE",
                        help="read the prompt from FILE (- = stdin); default: none")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--grammar", metavar="FILE", help="constrain the text to a GBNF grammar; default: none")
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="constrain the text to JSON that a JSON Schema accepts; default: none")
    _add_sampling_flags(p)
    _add_runtime_flags(p)

    p = command("chat", cmd_chat, "chat on stdin/stdout through the model's chat template "
                                  "(/exit or end of input stops)")
    _add_model_arguments(p, "as -m MODEL")
    p.add_argument("--system", help="a system message that starts the conversation; default: none")
    _add_sampling_flags(p)
    _add_runtime_flags(p)

    p = command("score", cmd_score, "perplexity of a text file")
    _add_model_arguments(p, "as -m MODEL; a single positional argument is the FILE")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--depth", type=_non_negative, default=0,
                   help="loop depth, 0 = the model's default (with --logit-lens: the deepest "
                        "depth shown, 0 = the model's max_depth)")
    p.add_argument("-c", "--ctx", type=_non_negative,
                   help="window length in tokens; default: the model's max_seq_len")
    p.add_argument("--uncertainty", action="store_true",
                   help="also the mean entropy (nats) of the predictions")
    p.add_argument("--logit-lens", action="store_true",
                   help="instead of the perplexity: the next token after the whole text at every "
                        "loop depth 1..--depth (Model.score_logit_lens)")
    p.add_argument("--top", type=_positive, default=5, metavar="K",
                   help="--logit-lens: the K most likely tokens per depth")
    _add_exit_flag(p, "every position (prints the mean depth used)")
    _add_runtime_flags(p, ctx_size=False)

    p = command("bench", cmd_bench, "prefill and decode speed, peak memory")
    _add_model_arguments(p, "as -m MODEL")
    # -p / -n as llama-bench spells them
    p.add_argument("-p", "--prompt-tokens", type=_positive, default=128, help="random prompt tokens")
    p.add_argument("-n", "--new-tokens", type=_positive, default=128, help="new tokens per run")
    p.add_argument("--depth", type=_non_negative, default=0, help="loop depth (0 = the model's default)")
    p.add_argument("--repeat", type=_positive, default=3, help="runs; medians are reported")
    p.add_argument("--seed", type=_non_negative, default=0, help="seed of the random prompt")
    _add_exit_flag(p, "the runs (reports the mean depth used)")
    _add_runtime_flags(p)

    p = command("info", cmd_info, "dimensions, architecture, dtypes and memory of a model "
                                  "(with no model named: the default model and its card)")
    _add_model_arguments(p, "as -m MODEL")
    _add_runtime_flags(p)

    p = command("modes", cmd_modes, "the runtime modes installed (plugins) and their options, "
                                    "as [modes.<name>] of a tinyloop.toml takes them")

    for name, help_text in (("convert", "convert a GGUF file or a HF safetensors checkpoint"),
                            ("quantize", "re-quantize a .tinyloop model to q8, q4 or q2"),
                            ("pull", "download a model (hf:ORG/NAME) and convert it into the cache"),
                            ("list", "the models in the cache"),
                            ("rm", "remove a model from the cache")):
        # listed for --help only: main() hands these argument lists over unparsed
        sub.add_parser(name, help=help_text, add_help=False)

    p = command("serve", cmd_serve, "an OpenAI-compatible HTTP server (docs/server.md)")
    _add_model_arguments(p, "as -m MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_non_negative, default=8080, help="port (0 = any free)")
    p.add_argument("--name", "--served-model-name", dest="names", nargs="+", action="extend",
                   metavar="NAME", help="model name(s) clients send; the first is the main one, the "
                                        "others aliases (default: the file's stem)")
    p.add_argument("--parallel", type=_positive, default=1,
                   help="generations at once; others wait")
    p.add_argument("--max-waiting", type=_non_negative, default=64, metavar="N",
                   help="requests waiting for a slot at most; more get a 429 with Retry-After")
    p.add_argument("--max-tokens-cap", type=_positive, default=None, metavar="N",
                   help="max_tokens above N is refused; a request without max_tokens gets at most N; "
                        "default: no cap")
    p.add_argument("--request-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds a generation request may take, waiting included (default: no limit)")
    p.add_argument("--max-connections", type=_positive, default=1024, metavar="N",
                   help="open connections at most; more get a 503")
    p.add_argument("--drain-timeout", type=_non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish")
    p.add_argument("--api-key", help="the key clients must send (Authorization: Bearer KEY); "
                                     "prefer --api-key-file or $TINYLOOP_API_KEY; default: none")
    p.add_argument("--api-key-file", metavar="PATH", help="a file whose first line is the API key; default: none")
    p.add_argument("--public-metrics", action="store_true",
                   help="GET /metrics answers without the API key")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="an origin browser pages may call from (repeatable; * = any); default: none")
    p.add_argument("--allowed-host", action="append", metavar="HOST",
                   help="a Host header accepted (repeatable; * = any; default: the loopback names "
                        "for a loopback --host, else any)")
    p.add_argument("--strict", action="store_true",
                   help="refuse OpenAI fields TinyLoop ignores (store, metadata, ...) with a 400")
    p.add_argument("--log-json", action="store_true", help="access log lines as JSON objects")
    p.add_argument("--verify-checksums", action="store_true",
                   help="check every tensor's CRC-32 when loading the model")
    p.add_argument("--prompt-cache", type=_non_negative, default=None, metavar="N",
                   help="sequences kept between requests; a request continues the one sharing the "
                        "longest start with its prompt (default: --parallel; 0 = off)")
    p.add_argument("--batch-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="take the decode steps of concurrent generations in one forward pass "
                        "(default: on for the CPU with --parallel above 1)")
    _add_exit_flag(p, "requests that give none")
    ray = p.add_argument_group("Ray Serve (docs/scale-out.md; needs pip install 'tinyloop-runtime[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve N replicas of the model on Ray Serve, behind Ray's HTTP proxy at "
                          "--host:--port")
    ray.add_argument("--replicas", type=_positive, default=None, metavar="N",
                     help="replicas; with --max-replicas, the number to start with; default: 1")
    ray.add_argument("--min-replicas", type=_non_negative, default=None, metavar="N",
                     help="autoscaling: replicas at least; default: 1")
    ray.add_argument("--max-replicas", type=_positive, default=None, metavar="N",
                     help="autoscaling on: replicas at most; default: no autoscaling")
    ray.add_argument("--target-ongoing-requests", type=_positive_number, default=None, metavar="X",
                     help="autoscaling: requests per replica it aims at (default: --parallel)")
    ray.add_argument("--prefix-routing", action="store_true",
                     help="route a prompt to the replica that served its start before (Ray's "
                          "PrefixCacheAffinityRouter)")
    ray.add_argument("--ray-address", metavar="ADDRESS",
                     help="the Ray cluster (auto, HOST:PORT or ray://HOST:10001; default: "
                          "$RAY_ADDRESS, else a local one started here)")
    ray.add_argument("--replica-cpus", type=_positive_number, default=None, metavar="X",
                     help="Ray CPUs per replica (default: --threads, else 1; also the threads "
                          "when --threads is not given)")
    ray.add_argument("--replica-gpus", type=_non_negative_number, default=None, metavar="X",
                     help="Ray GPUs per replica (default: 1 with --device cuda, else 0)")
    _add_runtime_flags(p)

    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _DELEGATED:
        return _delegated(argv[0])(argv[1:])
    args = build_parser().parse_args(argv)
    _merge_prompt_arguments(args)
    _merge_model_arguments(args)
    try:
        payload = args.handler(args)
    except KeyboardInterrupt:
        _note("interrupted")
        return _EXIT_INTERRUPTED
    except (TinyLoopError, ValueError, OSError) as e:
        _note(f"tinyloop {args.command}: error: {e}")
        if args.json:
            print(json.dumps({"error": str(e), "error_type": type(e).__name__}))
        return _EXIT_ERROR
    if args.json:
        print(json.dumps(payload, default=str))
    return 0
