"""`tinyloop serve --ray`: the server's OpenAI routes on Ray Serve, N replicas of the
engine behind Ray's router (docs/scale-out.md). Needs `pip install 'tinyloop-runtime[ray]'`;
nothing else in the package imports this module or Ray.

Each replica loads the model and serves the same ASGI app as `tinyloop serve`
(app.build_app over an Engine), so routes, errors, the API key and the limits are the
same; Ray's HTTP proxy owns the connections. Two shapes:

- direct (the default): the engine deployment is the HTTP ingress; Ray's proxy picks a
  replica per request (power of two choices on their queue lengths);
- prefix routing: a light ingress deployment reads each request's body and hands it to
  an engine replica through a deployment handle whose router is Ray's
  PrefixCacheAffinityRouter, keyed by the prompt's text (or the chat's messages): a
  prompt that shares its start with an earlier one goes where that one went, where the
  prompt cache holds it. Ray's routers see a handle call's arguments, never an HTTP
  body, hence the second hop.

Every answer carries `X-Tinyloop-Replica`, the replica that made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field, fields

from ray import serve

try:
    from ray.serve.exceptions import RequestCancelledError
except ImportError:   # older Ray: a cancelled call raises CancelledError alone
    RequestCancelledError = asyncio.CancelledError

from .app import ServerOptions, State, build_app, error_response
from .api import RequestError
from .engine import Engine

#: the header naming the replica that answered
REPLICA_HEADER = "x-tinyloop-replica"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Ray's prefix-aware router: public under ray.serve.llm (which needs ray[llm]'s
# packages), defined in a module that imports with ray[serve] alone
PREFIX_ROUTERS = ("ray.serve.llm.request_router.PrefixCacheAffinityRouter",
                  "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
                  "PrefixCacheAffinityRouter")


@dataclass
class ReplicaSpec:
    """What each replica loads and serves (sent to the replicas, so plain values only)."""

    #: a model path or pulled name, resolved on the replica's node; None: the config's
    #: [model] path, else the default model
    model: str | None = None
    #: a tinyloop.toml path (its [model] table and [modes]), read on the replica's node
    config: str | None = None
    threads: int | None = None
    device: str | None = None
    #: load options of the command line (-c, --prefill-chunk) over the config's
    max_seq_len: int | None = None
    prefill_chunk: int | None = None
    verify_checksums: bool = False
    names: list | None = None
    parallel: int = 1
    prompt_cache: int | None = None
    batch_decode: bool | None = None
    options: ServerOptions = field(default_factory=ServerOptions)
    #: the host Ray's proxy listens on (Host checks of a loopback bind)
    host: str = "127.0.0.1"
    #: access log lines to the replica's stderr (Ray gathers them)
    access_log: bool = True


def _open(spec: ReplicaSpec):
    """The replica's model, loaded as `tinyloop serve` loads it, and its names."""
    from dataclasses import replace
    from pathlib import Path

    from ..config import Config, load_config
    from ..default_model import resolve_model
    from ..model import Model
    config = load_config(spec.config) if spec.config else Config()
    if spec.verify_checksums:
        config = replace(config, model=replace(config.model, verify_checksums=True))
    overrides = {k: v for k, v in (("threads", spec.threads), ("device", spec.device),
                                   ("max_seq_len", spec.max_seq_len), ("prefill_chunk", spec.prefill_chunk))
                 if v is not None}
    path = spec.model or config.load_options().get("path")
    if path:   # else Model.from_config loads the default model
        overrides["path"] = resolve_model(path)
    model = Model.from_config(config, **overrides)
    return model, spec.names or [Path(model.path).stem]


def _with_replica_header(app, replica: str):
    header = (REPLICA_HEADER.encode(), replica.encode())

    async def tagged(scope, receive, send):
        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + [header])
            await send(message)
        await app(scope, receive, send_tagged)
    return tagged


class _Replica:
    """One replica: the model, its engine and the server's ASGI app."""

    def __init__(self, spec: ReplicaSpec):
        self.model, names = _open(spec)
        options = spec.options
        try:
            self.engine = Engine(self.model, names=names, parallel=spec.parallel,
                                 prompt_cache=spec.prompt_cache, batch_decode=spec.batch_decode,
                                 max_tokens_cap=options.max_tokens)
        except BaseException:
            self.model.close()
            raise
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if spec.access_log else None
        self.state = State(self.engine, options, log, spec.host)
        self.replica = _replica_name()
        self.asgi = _with_replica_header(build_app(self.state), self.replica)
        self._tasks: set = set()

    async def relay(self, routed: "RoutedRequest | None" = None, request: "RelayedRequest | None" = None):
        """Serve one HTTP request the ingress read (prefix routing): its ASGI messages.
        The request comes as the first argument when it has a routing key, else by name
        (Ray's prefix router reads the first argument's `prompt`)."""
        request = routed.request if routed is not None else request
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run():
            try:
                await self.asgi(request.scope(), receive, messages.put)
            finally:
                messages.put_nowait(None)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task   # its failure, if any, is Ray's to report
        finally:
            gone.set()   # a cancelled call (the client left) ends the generation

    def __del__(self):
        # Ray calls this once its graceful shutdown has waited for the running requests
        # (graceful_shutdown_timeout_s = the drain timeout): end what is left, free the model
        state = getattr(self, "state", None)
        if state is None:   # not made, or freed already (Ray's call, then the collector's)
            return
        self.state = None
        state.draining = True
        self.engine.ending.set()
        self.engine.close()
        state.executor.shutdown(wait=True)
        self.model.close()


def _replica_name() -> str:
    try:
        context = serve.get_replica_context()
    except Exception:   # made outside a replica (a test of the class itself)
        return "local"
    replica_id = getattr(context, "replica_id", None)
    return replica_id.unique_id if replica_id is not None else str(context.replica_tag)


class _Dispatch:
    """The ASGI app given to @serve.ingress: the replica's own app (its `asgi`), found
    at each request, since Ray makes the app before the replica's object. (An object
    rather than a function: Ray takes a function for a builder of the app.)"""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":   # nothing starts or stops with the app
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await serve.get_replica_context().servable_object.asgi(scope, receive, send)


#: the engine deployment's class in the direct shape, where it is the HTTP ingress (in
#: the prefix-routing one the relay is, and an application has one ingress at most)
TinyLoopReplica = serve.ingress(_Dispatch())(_Replica)


@dataclass
class RelayedRequest:
    """An HTTP request the ingress read whole, as the engine replica replays it."""

    scope_items: dict
    body: bytes

    def scope(self) -> dict:
        return dict(self.scope_items, type="http")


@dataclass
class RoutedRequest:
    """A generation request with its routing key (`prompt`, what the prefix router reads)."""

    prompt: str
    request: RelayedRequest


_SCOPE_KEYS = ("asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
               "root_path", "headers", "client", "server")


def routing_text(path: str, body: bytes) -> str:
    """The text a generation request is routed by: the prompt (the first of a list; token
    ids as their decimal text), or the chat's messages one after another; "" for none."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(data, dict):
        return ""
    if path == "/v1/completions":
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt)
        return prompt if isinstance(prompt, str) else ""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        parts.append(f"{message.get('role')}: {content if isinstance(content, str) else ''}\n")
    return "".join(parts)


class _Relay:
    """The ingress of the prefix-routing shape: reads a request whole (bounded as the
    server bounds it) and relays it to an engine replica, streaming its answer back; a
    client that leaves cancels the call."""

    def __init__(self, engine, options: ServerOptions):
        self.engine = engine.options(stream=True, method_name="relay")
        self.options = options

    async def asgi(self, scope, receive, send):
        if scope["type"] != "http":
            return
        try:
            body = await asyncio.wait_for(self._body(scope, receive), self.options.body_timeout)
        except asyncio.TimeoutError:
            error = RequestError(f"the body did not arrive within {self.options.body_timeout:g} s",
                                 status=408, code="timeout", headers={"Connection": "close"})
            return await error_response(error)(scope, receive, send)
        if body is None:
            return   # the client left
        request = RelayedRequest({k: scope[k] for k in _SCOPE_KEYS if k in scope}, body)
        key = routing_text(scope["path"], body) if scope["path"] in GENERATION_PATHS else ""
        answer = (self.engine.remote(RoutedRequest(key, request)) if key
                  else self.engine.remote(request=request))

        async def pump():
            async for message in answer:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    return   # answered: a disconnect from now on is the client closing

        async def left():
            while (await receive())["type"] != "http.disconnect":
                pass

        relayed, watch = asyncio.ensure_future(pump()), asyncio.ensure_future(left())
        try:
            await asyncio.wait({relayed, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not relayed.done():   # the client left: the engine replica's call ends
                answer.cancel()
                relayed.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestCancelledError):
            await relayed

    async def _body(self, scope, receive) -> bytes | None:
        """The body, or its first max_body_bytes + 1 bytes (the engine then answers 413);
        nothing when its Content-Length is over the limit already; None if the client left."""
        limit = self.options.max_body_bytes
        for name, value in scope["headers"]:
            if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
                return b""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if not message.get("more_body") or len(body) > limit:
                return bytes(body)


Relay = serve.ingress(_Dispatch())(_Relay)


def prefix_router() -> str:
    """The import path of Ray's prefix-aware router in this Ray."""
    import importlib
    for path in PREFIX_ROUTERS:
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
            return path
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("this Ray has no PrefixCacheAffinityRouter: prefix routing needs a Ray Serve "
                       "with request routers (docs/scale-out.md)")


def application(spec: ReplicaSpec, *, replicas: int = 1, autoscaling: dict | None = None,
                num_cpus: float = 1, num_gpus: float = 0, max_ongoing_requests: int | None = None,
                prefix_routing: bool = False, router_options: dict | None = None, relay_replicas: int = 1,
                deployment_options: dict | None = None):
    """The Ray Serve application: `replicas` engine replicas (or, with `autoscaling`, a
    dict of Ray's AutoscalingConfig fields such as min_replicas, max_replicas and
    target_ongoing_requests, as many as it says), each with `num_cpus` / `num_gpus` of
    Ray's resources and at most `max_ongoing_requests` requests at once (default: its
    slots and their queue, so that its own 429s still speak); `prefix_routing` puts the
    relay ingress before them (`relay_replicas` of it, no CPUs), routing by prompt prefix
    (`router_options`: the router's keywords); `deployment_options` goes to the engine
    deployment's Deployment.options as it is."""
    options = spec.options
    settings = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
                "max_ongoing_requests": max_ongoing_requests or spec.parallel + options.max_waiting,
                # Ray waits this long for running requests before it stops a replica
                "graceful_shutdown_timeout_s": options.drain_timeout}
    if autoscaling:
        settings["autoscaling_config"] = dict(autoscaling)
    else:
        settings["num_replicas"] = replicas
    if prefix_routing:
        try:
            from ray.serve.config import RequestRouterConfig
        except ImportError:
            raise RuntimeError("this Ray Serve has no request routers: prefix routing needs a newer "
                               "Ray (docs/scale-out.md)") from None
        settings["request_router_config"] = RequestRouterConfig(
            request_router_class=prefix_router(), request_router_kwargs=dict(router_options or {}))
    settings.update(deployment_options or {})
    engine = serve.deployment(_Replica if prefix_routing else TinyLoopReplica,
                              name="tinyloop-engine").options(**settings).bind(spec)
    if not prefix_routing:
        return engine
    # the relay holds each of its requests while an engine replica runs it: room for all
    most = (autoscaling or {}).get("max_replicas", replicas)
    relay = serve.deployment(Relay, name="tinyloop-ingress").options(
        num_replicas=relay_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings["max_ongoing_requests"] * most // relay_replicas + 1,
        graceful_shutdown_timeout_s=options.drain_timeout)
    return relay.bind(engine, options)


_APP_KEYS = ("replicas", "autoscaling", "num_cpus", "num_gpus", "max_ongoing_requests", "prefix_routing",
             "router_options", "relay_replicas", "deployment_options")
_LISTS = ("cors_origins", "allowed_hosts")   # ServerOptions' tuples, lists in YAML


def parse_args(args: dict) -> tuple:
    """(ReplicaSpec, application()'s keywords) of a config file's `args`: ReplicaSpec's
    fields, application()'s keywords, and `options`, ServerOptions' fields (its api_key,
    when not given, from $TINYLOOP_API_KEY where the application is built)."""
    args = dict(args or {})
    spec_keys = {f.name for f in fields(ReplicaSpec)}
    unknown = sorted(set(args) - spec_keys - set(_APP_KEYS))
    if unknown:
        raise ValueError(f"unknown tinyloop Ray Serve args: {', '.join(unknown)} (docs/scale-out.md)")
    options = dict(args.pop("options", None) or {})
    for key in _LISTS:
        if options.get(key) is not None:
            options[key] = tuple(options[key])
    if options.get("api_key") is None:
        options["api_key"] = os.environ.get("TINYLOOP_API_KEY") or None
    spec = ReplicaSpec(options=ServerOptions(**options),
                       **{k: args.pop(k) for k in list(args) if k in spec_keys})
    return spec, args


def build(args: dict):
    """The application of a Ray Serve config file or a KubeRay RayService
    (`import_path: tinyloop.server.ray_serve:build`, its `args` as parse_args reads them)."""
    spec, app_options = parse_args(args)
    return application(spec, **app_options)


def run(spec: ReplicaSpec, *, port: int = 8000, address: str | None = None, name: str = "tinyloop",
        blocking: bool = True, **app_options):
    """Deploy the application on a Ray cluster (`address`, e.g. "auto" or
    "ray://head:10001"; None: the one RAY_ADDRESS names or a local one started here)
    with Ray's HTTP proxy on spec.host:port; with `blocking`, serve until SIGTERM or
    Ctrl-C, then delete the application (Ray drains its replicas)."""
    import ray
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": spec.host, "port": port})
        serve.run(application(spec, **app_options), name=name, route_prefix="/")
        if not blocking:
            return
        stop = threading.Event()
        taken = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            host = f"[{spec.host}]" if ":" in spec.host else spec.host
            print(f"tinyloop serve: on Ray Serve at http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops)",
                  file=sys.stderr, flush=True)
            stop.wait()
            print("tinyloop serve: stopping the replicas (they finish their requests first)",
                  file=sys.stderr, flush=True)
        finally:
            for sig, previous in taken.items():
                signal.signal(sig, previous)
        serve.delete(name)
    finally:
        if blocking and started:
            serve.shutdown()
            ray.shutdown()

