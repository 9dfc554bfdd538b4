"""The server's ASGI application (Starlette): routes, body reading, the generation slots
and their bounded queue, and a front middleware for what every request goes through:
its request id, Host and Origin checks, the API key, response metrics and the access
log (docs/server.md). The generations run in worker threads (engine.py); what they give
comes back to the event loop through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import api, embeddings, scoring, tokens
from .api import RequestError
from .engine import ClientGone, Engine, Job

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# the routes responses are counted under; others count as "other" (bounded labels)
ROUTES = ("/v1/models", "/v1/models/{model}", "/health", "/metrics", "/v1/completions",
          "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/tinyloop/score")
_LOOPBACK_NAMES = ("localhost", "localhost.")


@dataclass
class ServerOptions:
    """What `tinyloop serve` sets beyond the model (docs/server.md, "Limits", "Security")."""

    #: the secret clients send as `Authorization: Bearer KEY`; None: no key asked
    api_key: str | None = None
    #: whether GET /metrics needs the key too (when one is set)
    metrics_need_key: bool = True
    #: origins a browser page may call from (CORS), e.g. "http://localhost:3000"; "*" any
    cors_origins: tuple = ()
    #: Host header values accepted; None: for a loopback bind the loopback names only,
    #: else any ("*")
    allowed_hosts: tuple | None = None
    #: requests waiting for a slot at most; more are answered 429 with Retry-After
    max_waiting: int = 64
    #: max_tokens above this is refused, and a missing one is at most this; None: none
    max_tokens: int | None = None
    #: seconds from arrival a generation request may take (waiting included); None: none
    request_timeout: float | None = None
    #: an unknown-to-TinyLoop OpenAI field (api.IGNORED_FIELDS) is a 400 rather than ignored
    strict: bool = False
    max_body_bytes: int = 1 << 20
    #: seconds to receive a request's headers, and then its body
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_header_bytes: int = 32 * 1024
    #: an idle kept-alive connection is closed after this
    keep_alive_timeout: float = 15.0
    max_connections: int = 1024
    backlog: int = 2048
    #: SIGTERM: seconds running requests get to finish before their streams are ended
    drain_timeout: float = 30.0
    #: access log lines as JSON objects
    json_logs: bool = False
    #: the exit rule (tinyloop.ExitRule) of generation requests that give none; None:
    #: fixed depth, and no depths reported unless a request asks
    exit: object = None


@dataclass
class RequestInfo:
    """What the access log says of one request (filled in as it goes)."""

    id: str
    method: str
    path: str
    route: str
    client: str
    started: float
    status: int = 0
    queue: int | None = None
    usage: dict | None = None
    depth: int | None = None
    headers: list = field(default_factory=list)   # extra response headers (Warning)


class State:
    """The app's shared state: the engine, options, the slots and the drain flag."""

    def __init__(self, engine: Engine, options: ServerOptions, log, bound_host: str):
        self.engine, self.options, self.log = engine, options, log or (lambda line: None)
        self.slots = Slots(engine, options.max_waiting)
        self.draining = False
        self.executor = ThreadPoolExecutor(engine.parallel + 2, thread_name_prefix="tinyloop-gen")
        hosts = options.allowed_hosts
        if hosts is None:
            hosts = loopback_hosts(bound_host) if is_loopback(bound_host) else ("*",)
        self.allowed_hosts = frozenset(h.lower() for h in hosts)
        self.cors = tuple(options.cors_origins)


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_hosts(bound: str) -> tuple:
    return ("localhost", "127.0.0.1", "::1", bound.lower().strip("[]"))


def _host_name(value: str) -> str:
    """The host of a Host header or an origin's netloc, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Slots:
    """The `parallel` generation slots and the queue before them (at most `max_waiting`
    waiting: beyond, a 429 with Retry-After). Used from the event loop; release() from
    anywhere."""

    def __init__(self, engine: Engine, max_waiting: int):
        self.engine, self.max_waiting = engine, max_waiting
        self.free = engine.parallel
        self.waiting = 0
        self.running = 0
        self._waiters: list = []   # futures, first come first served
        self._loop = None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue's work at the mean request
        duration, 1 to 60."""
        metrics = self.engine.metrics
        mean = metrics.duration.sum / max(1, sum(metrics.duration.counts)) or 1.0
        return max(1, min(60, math.ceil(mean * (self.waiting + 1) / self.engine.parallel)))

    async def acquire(self, deadline: float | None, gone: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        metrics = self.engine.metrics
        if self.free == 0 and self.waiting >= self.max_waiting:
            metrics.rejected("queue_full")
            raise RequestError(f"{self.waiting} requests are waiting, the limit: retry later", status=429,
                               kind="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(self.retry_after())})
        if self.free > 0 and not self._waiters:
            self.free -= 1
        else:
            future = self._loop.create_future()
            self._waiters.append(future)
            self.waiting += 1
            metrics.queue(waiting=1)
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                gone_task = asyncio.ensure_future(gone.wait())
                try:
                    done, _ = await asyncio.wait({future, gone_task}, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone_task.cancel()
                if future not in done:
                    if future.done():    # handed a slot just now: give it back
                        self._hand_on()
                    else:
                        future.cancel()
                    if gone.is_set():
                        raise ClientGone()
                    metrics.rejected("timeout")
                    raise RequestError("the request's deadline passed while it waited for a slot",
                                       status=504, kind="server_error", code="timeout")
            finally:
                if future in self._waiters:
                    self._waiters.remove(future)
                self.waiting -= 1
                metrics.queue(waiting=-1)
        self.running += 1
        metrics.queue(running=1)

    def _hand_on(self) -> None:
        """A slot came free: to the first waiter, or back to the pool."""
        while self._waiters:
            future = self._waiters.pop(0)
            if not future.done():
                future.set_result(None)
                return
        self.free += 1

    def release(self) -> None:
        def release():
            self.running -= 1
            self.engine.metrics.queue(running=-1)
            self._hand_on()
        if self._loop is None:
            release()
        else:
            self._loop.call_soon_threadsafe(release)


# -- responses ------------------------------------------------------------------------------
def json_response(status: int, body, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(error: RequestError) -> Response:
    return json_response(error.status, error.body(), error.headers)


# -- the routes -------------------------------------------------------------------------------
def _state(request: Request) -> State:
    return request.app.state.tinyloop


async def read_json(request: Request):
    """The request's JSON body: 411 without a length or chunked framing, 413 over the
    limit (refused before it is read), 408 past the body deadline, 400 if not JSON."""
    options = _state(request).options
    close = {"Connection": "close"}   # the unread body must not run as the next request
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if length is None and not chunked:
        raise RequestError("a Content-Length header (or a chunked body) is required", status=411,
                           headers=close)
    if length is not None and int(length) > options.max_body_bytes:
        raise RequestError(f"the body is {int(length)} bytes; at most {options.max_body_bytes} are "
                           f"accepted", status=413, headers=close)
    try:
        raw = await asyncio.wait_for(_body(request, options.max_body_bytes, close), options.body_timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"the body did not arrive within {options.body_timeout:g} s", status=408,
                           code="timeout", headers=close) from None
    try:
        return json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:   # bad JSON or UTF-8, huge ints, deep nesting
        raise RequestError(f"the body is not valid JSON: {e}") from None


async def _body(request: Request, limit: int, close: dict) -> bytearray:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise RequestError(f"the body exceeds {limit} bytes", status=413, headers=close)
    return raw


async def models(request: Request) -> Response:
    engine = _state(request).engine
    return json_response(200, {"object": "list", "data": [engine.model_entry(n) for n in engine.names]})


async def model(request: Request) -> Response:
    engine = _state(request).engine
    name = request.path_params["model"]
    if name not in engine.names:
        raise RequestError(f"model {name!r} is not served here", "model", status=404,
                           code="model_not_found")
    return json_response(200, engine.model_entry(name))


async def health(request: Request) -> Response:
    if _state(request).draining:
        return json_response(503, {"status": "draining"})
    return json_response(200, {"status": "ok"})


async def metrics(request: Request) -> Response:
    state = _state(request)
    text = await run_in_threadpool(state.engine.metrics.render, state.engine.model)
    return Response(text, media_type=METRICS_TYPE)


async def tokenize(request: Request) -> Response:
    body = await read_json(request)
    engine = _state(request).engine
    return json_response(200, await run_in_threadpool(tokens.tokenize, body, engine.model, engine.names,
                                                      engine.template))


async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    engine = _state(request).engine
    return json_response(200, await run_in_threadpool(tokens.detokenize, body, engine.model, engine.names))


async def completions(request: Request) -> Response:
    body = await read_json(request)
    state = _state(request)
    engine, options = state.engine, state.options
    parsed = await run_in_threadpool(api.completion_request, body, engine.model, engine.names,
                                     strict=options.strict, max_tokens_cap=options.max_tokens,
                                     default_exit=options.exit)
    return await _generate(request, parsed, chat=False)


async def chat(request: Request) -> Response:
    body = await read_json(request)
    state = _state(request)
    engine, options = state.engine, state.options
    parsed = await run_in_threadpool(api.chat_request, body, engine.model, engine.names, engine.template,
                                     strict=options.strict, max_tokens_cap=options.max_tokens,
                                     default_exit=options.exit)
    return await _generate(request, parsed, chat=True)


async def embed(request: Request) -> Response:
    body = await read_json(request)
    state = _state(request)
    engine = state.engine
    parsed = await run_in_threadpool(embeddings.embedding_request, body, engine.model, engine.names,
                                     state.options.strict)
    return await _in_slot(request, parsed.depth or engine.model.info.default_depth,
                          lambda: embeddings.embed(engine, parsed, engine.stopping.is_set))


async def score(request: Request) -> Response:
    body = await read_json(request)
    state = _state(request)
    engine = state.engine
    parsed = await run_in_threadpool(scoring.score_request, body, engine.model, engine.names,
                                     state.options.strict)
    return await _in_slot(request, parsed.depth, lambda: scoring.score(engine, parsed))


async def _in_slot(request: Request, depth: int, work) -> Response:
    """A request that computes without generating (embeddings, scoring): it waits for a
    generation slot like a generation, then `work()` runs in the slot's worker thread."""
    state = _state(request)
    request.scope["tinyloop"].depth = depth
    deadline = None if state.options.request_timeout is None else time.monotonic() + state.options.request_timeout
    await _admit(request, state, deadline, asyncio.Event())
    try:
        answer = await asyncio.get_running_loop().run_in_executor(state.executor, _in_worker, state, work)
    finally:
        state.slots.release()
    request.scope["tinyloop"].usage = answer["usage"]
    return json_response(200, answer)


def _in_worker(state: State, work):
    with state.engine.busy():
        return work()


async def _admit(request: Request, state: State, deadline, gone: asyncio.Event) -> None:
    """A slot for the request (503 while draining, 429 when the queue is full)."""
    if state.draining or state.engine.stopping.is_set():
        state.engine.metrics.rejected("draining")
        raise RequestError("the server is shutting down", status=503, kind="server_error",
                           code="server_shutdown", headers={"Retry-After": "5"})
    request.scope["tinyloop"].queue = state.slots.waiting
    await state.slots.acquire(deadline, gone)
    if state.engine.ending.is_set() or state.engine.stopping.is_set():
        state.slots.release()
        raise RequestError("the server is shutting down", status=503, kind="server_error",
                           code="server_shutdown")


async def _generate(request: Request, parsed, chat: bool) -> Response:
    """Run the request's Job in a worker thread once it has a slot, and answer it whole
    or as a stream; the client leaving (watched from here) stops the generation."""
    state = _state(request)
    engine, options, info = state.engine, state.options, request.scope["tinyloop"]
    info.depth = parsed.options.get("depth") or engine.model.info.default_depth
    headers = {}
    if parsed.ignored:
        headers["Warning"] = f'299 tinyloop "ignored fields: {", ".join(parsed.ignored)}"'
    deadline = None if options.request_timeout is None else time.monotonic() + options.request_timeout
    gone, gone_async = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    receive = request.receive

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        gone_async.set()

    watcher = asyncio.ensure_future(watch())
    try:
        await _admit(request, state, deadline, gone_async)
    except BaseException:
        watcher.cancel()
        raise
    job = Job(engine, parsed, chat, gone, deadline)

    def done():
        state.slots.release()
        info.usage = job.usage()

    if not parsed.stream:
        def run():
            try:
                return job.answer()
            finally:
                done()
        try:
            body = await loop.run_in_executor(state.executor, run)
        except ClientGone:
            return Response(status_code=499)   # no one is listening
        except asyncio.CancelledError:   # a server that cancels on a disconnect (Ray Serve's)
            gone.set()
            raise
        finally:
            watcher.cancel()
        return json_response(200, body, headers)

    queue: asyncio.Queue = asyncio.Queue()
    produced = asyncio.Event()   # the worker is done (and the usage known)

    def put(item) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def produce():
        try:
            for event in job.events():
                put(event)
        except (RequestError, ClientGone) as e:
            put(e)
        except Exception as e:   # a bug: said as the last event (or a 500 before the first)
            state.log(f"internal error on {request.url.path}: {e!r}")
            put(RequestError(f"internal error: {e!r}", status=500, kind="server_error"))
        finally:
            done()
            put(None)
            loop.call_soon_threadsafe(produced.set)

    def cut() -> None:
        gone.set()
        gone_async.set()

    loop.run_in_executor(state.executor, produce)
    try:
        first = await queue.get()
    except asyncio.CancelledError:
        cut()
        raise
    if isinstance(first, BaseException) or first is None:
        watcher.cancel()
        if isinstance(first, RequestError):
            raise first
        return Response(status_code=499)   # no one is listening

    async def rest():
        item = await queue.get()
        if isinstance(item, RequestError):   # after the first event: an error event
            return {"error": item.body()["error"]}, True
        if isinstance(item, ClientGone):
            return None, False
        return item, False

    return _Stream(first, rest, headers, watcher, cut, produced)


class _Stream(Response):
    """A generation's server-sent events: `first`, then what `rest()` gives until None.
    Cut short (the task cancelled, a send failing), it stops the generation (`cut`) and
    waits a moment for the worker (`produced`), so that the access log has its usage."""

    media_type = "text/event-stream"

    def __init__(self, first, rest, headers: dict, watcher, cut, produced: asyncio.Event):
        self.first, self._rest, self._watcher = first, rest, watcher
        self._cut, self._produced = cut, produced
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        item = self.first
        ended = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while item is not None:
                data = item if isinstance(item, str) else json.dumps(item)
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                            "more_body": True})
                item, _ = await self._rest()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            ended = True
        finally:
            self._watcher.cancel()
            if not ended:
                self._cut()
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._produced.wait(), 5)


# -- errors -----------------------------------------------------------------------------------
async def _request_error(request: Request, error: RequestError) -> Response:
    return error_response(error)


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's shape."""
    if error.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    elif error.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(error.detail), None
    return error_response(RequestError(message, status=error.status_code, code=code,
                                       headers=dict(error.headers or {})))


async def _internal_error(request: Request, error: Exception) -> Response:
    _state(request).log(f"internal error on {request.method} {request.url.path}: {error!r}")
    return error_response(RequestError(f"internal error: {error!r}", status=500, kind="server_error"))


# -- the front middleware -----------------------------------------------------------------------
class Front:
    """Every HTTP request: its id (the client's X-Request-Id, else a new one, echoed),
    the Host and Origin checks, the API key, the response's metrics and the access log."""

    def __init__(self, app, state: State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        rid = headers.get("x-request-id", "")
        if not (0 < len(rid) <= 128 and rid.isascii() and rid.isprintable()):
            rid = secrets.token_hex(12)
        path = scope["path"]
        route = "/v1/models/{model}" if path.startswith("/v1/models/") else path
        client = scope.get("client")
        info = RequestInfo(rid, scope["method"], path, route if route in ROUTES else "other",
                           f"{client[0]}:{client[1]}" if client else "-", time.monotonic())
        scope["tinyloop"] = info
        metrics = self.state.engine.metrics

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                info.status = message["status"]
                message = dict(message, headers=list(message.get("headers", []))
                               + [(b"x-request-id", rid.encode())])
                metrics.response(info.route, info.status)
            await send(message)

        refusal = self._refusal(scope, headers)
        try:
            if refusal is not None:
                await error_response(refusal)(scope, receive, send_wrapped)
            else:
                await self.app(scope, receive, send_wrapped)
        finally:
            self._log(info)

    def _refusal(self, scope, headers) -> RequestError | None:
        """A 403 for a foreign Host or Origin, a 401 without the API key, else None."""
        state = self.state
        host = headers.get("host")
        if host is not None and "*" not in state.allowed_hosts and _host_name(host) not in state.allowed_hosts:
            state.engine.metrics.rejected("host")
            return RequestError(f"Host {host!r} is not accepted here (a loopback server answers its "
                                f"loopback names; --allowed-host adds others)", status=403,
                                kind="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            state.engine.metrics.rejected("origin")
            return RequestError(f"Origin {origin!r} is not accepted here (--cors-origin allows one)",
                                status=403, kind="permission_error", code="origin_not_allowed")
        key = state.options.api_key
        if key is None or scope["path"] == "/health":
            return None
        if scope["path"] == "/metrics" and not state.options.metrics_need_key:
            return None
        if scope["method"] == "OPTIONS" and origin is not None and state.cors \
                and "access-control-request-method" in headers:
            return None   # a CORS preflight carries no credentials
        given = headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        state.engine.metrics.rejected("auth")
        return RequestError("a valid API key is required (Authorization: Bearer KEY)", status=401,
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        state = self.state
        if origin in state.cors or "*" in state.cors:
            return True
        netloc = urlsplit(origin).netloc
        if not netloc:   # "null" (a sandboxed page, a file)
            return False
        if "*" not in state.allowed_hosts:   # a loopback server: pages of its loopback names
            return _host_name(netloc) in state.allowed_hosts
        return host is not None and netloc.lower() == host.lower()   # the same origin

    def _log(self, info: RequestInfo) -> None:
        state = self.state
        usage = info.usage or {}
        record = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "request_id": info.id, "client": info.client, "method": info.method,
                  "path": info.path, "route": info.route, "status": info.status,
                  "latency_ms": round((time.monotonic() - info.started) * 1000, 1),
                  "prompt_tokens": usage.get("prompt_tokens"),
                  "completion_tokens": usage.get("completion_tokens"),
                  "depth": info.depth, "queue": info.queue}
        if state.options.json_logs:
            state.log(json.dumps(record))
            return
        line = (f'{record["time"]} {info.client} "{info.method} {info.path}" {info.status} '
                f'{record["latency_ms"]}ms id={info.id}')
        for key, label in (("prompt_tokens", "prompt"), ("completion_tokens", "completion"),
                           ("depth", "depth"), ("queue", "queue")):
            if record[key] is not None:
                line += f" {label}={record[key]}"
        state.log(line)


def build_app(state: State):
    """The ASGI app of a server: Front, then CORS when origins are allowed, then routes."""
    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/embeddings", embed, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/detokenize", detokenize, methods=["POST"]),
              Route("/tinyloop/score", score, methods=["POST"])]
    middleware = []
    if state.cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.cors),
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["authorization", "content-type", "x-request-id"],
                                     expose_headers=["x-request-id", "warning", "retry-after"]))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={RequestError: _request_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.tinyloop = state
    return Front(app, state)
