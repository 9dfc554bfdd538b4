"""`tinyloop serve`: an OpenAI-compatible HTTP server over one loaded model (docs/server.md).

Standard library only (http.server): one thread per connection, at most `parallel`
generations at once (each in a context of its own, so they run in parallel in C), the
rest wait their turn. Endpoints: GET /v1/models, GET /health, GET /metrics, POST
/v1/completions and POST /v1/chat/completions, with `stream: true` as server-sent events,
and POST /tokenize and /detokenize. A bad request gets
a 4xx with OpenAI's error body and costs no generation; a client that goes away
mid-stream stops its generation.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..chat_template import load_chat_template
from ..errors import ContextFullError, InvalidArgumentError, TinyLoopError, UnsupportedError
from ..prompt_cache import PromptCache
from ..text_generation import GenerationCancelled, TextGeneration, generate_text
from . import api, choice_batch, tokens
from .api import RequestError
from .decode_batcher import DecodeBatcher
from .logprobs import LogprobReport, joined
from .metrics import ServerMetrics

MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_S = 30          # a client that sends nothing for this long is dropped


class ModelServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, model, *, name: str, parallel: int = 1,
                 prompt_cache: int | None = None, batch_decode: bool | None = None,
                 batch_choices: bool = True, log=None):
        # sequences kept between requests: by default one per slot; 0 = none
        kept = parallel if prompt_cache is None else prompt_cache
        if kept < 0:   # checked before the socket is bound, which a refusal would leave open
            raise ValueError(f"prompt_cache is {kept}: the number of kept sequences, 0 = none")
        super().__init__(address, _Handler)
        self.model = model
        self.cache = PromptCache(model, kept) if kept > 0 else None
        # concurrent generations' decode steps in one forward pass; by default where that
        # pays: on the CPU with more than one slot (docs/server.md)
        if batch_decode is None:
            batch_decode = parallel > 1 and model.info.device_name.startswith("cpu")
        self.batcher = DecodeBatcher(model) if batch_decode else None
        # a request's choices generated together (choice_batch.py); False: one after another
        self.batch_choices = batch_choices
        self.name = name
        self.parallel = parallel
        self.slots = threading.BoundedSemaphore(parallel)
        self.stopping = threading.Event()
        self.template = load_chat_template(model)
        self.created = int(time.time())
        self.log = log or (lambda line: None)
        self.metrics = ServerMetrics()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def server_close(self) -> None:
        """Stop listening, end the running generations at their next token and wait for
        them, so that the model may be closed afterwards (handler threads are daemons:
        nothing else waits for them)."""
        self.stopping.set()
        super().server_close()
        for _ in range(self.parallel):
            self.slots.acquire()
        for _ in range(self.parallel):
            self.slots.release()
        if self.batcher is not None:
            self.batcher.close()
        if self.cache is not None:
            self.cache.close()


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    server: ModelServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S

    # -- plumbing -------------------------------------------------------------------------
    def log_message(self, fmt, *args):  # one line per request, to the server's log
        self.server.log(f"{self.address_string()} {fmt % args}")

    def send_response(self, code, message=None):
        # every response is counted by route, unknown paths together (bounded labels)
        path = getattr(self, "path", "").split("?", 1)[0]
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model}"
        self.server.metrics.response(path if path in _ROUTES else "other", code)
        super().send_response(code, message)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: RequestError) -> None:
        self._send_json(error.status, error.body())

    def _read_body(self):
        # an error before the body is read ends the connection: what follows is unread
        self.close_connection = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise RequestError("chunked request bodies are not supported: send Content-Length",
                               status=411)
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a Content-Length header is required", status=411)
        if not (length.strip().isascii() and length.strip().isdigit()):
            raise RequestError(f"bad Content-Length {length!r}")
        n = int(length)
        if n > MAX_BODY_BYTES:
            raise RequestError(f"the body is {n} bytes; at most {MAX_BODY_BYTES} are accepted",
                               status=413)
        raw = self.rfile.read(n)
        if len(raw) < n:
            raise _ClientGone()
        self.close_connection = False
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:   # bad JSON or UTF-8, huge ints, deep nesting
            raise RequestError(f"the body is not valid JSON: {e}") from None

    def _client_gone(self) -> bool:
        """Whether the client closed its end (checked between tokens, without blocking)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # -- routes ---------------------------------------------------------------------------
    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self._model_entry()]})
        elif path == f"/v1/models/{self.server.name}":
            self._send_json(200, self._model_entry())
        elif path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/metrics":
            self._send_text(200, self.server.metrics.render(self.server.model),
                            "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_error(RequestError(f"no route GET {path}", status=404, code="not_found"))

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        routes = {"/v1/completions": self._completions, "/v1/chat/completions": self._chat,
                  "/tokenize": self._tokenize, "/detokenize": self._detokenize}
        try:
            if path not in routes:
                self.close_connection = True
                raise RequestError(f"no route POST {path}", status=404, code="not_found")
            routes[path](self._read_body())
        except RequestError as e:
            self._send_error(e)
        except (_ClientGone, GenerationCancelled, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:   # a bug: answer it rather than drop the connection
            self.server.log(f"internal error on POST {path}: {e!r}")
            self.close_connection = True
            self._send_error(RequestError(f"internal error: {e!r}", status=500, kind="server_error"))

    def _model_entry(self) -> dict:
        info = self.server.model.info
        return {"id": self.server.name, "object": "model", "created": self.server.created,
                "owned_by": "tinyloop", "max_model_len": info.max_seq_len,
                "default_depth": info.default_depth, "max_depth": info.max_depth}

    def _tokenize(self, body) -> None:
        server = self.server
        self._send_json(200, tokens.tokenize(body, server.model, server.name, server.template))

    def _detokenize(self, body) -> None:
        self._send_json(200, tokens.detokenize(body, self.server.model, self.server.name))

    def _completions(self, body) -> None:
        request = api.completion_request(body, self.server.model, self.server.name)
        name = request.model
        self._generate(request, "cmpl", api.completion_body,
                       lambda rid, i, text, lp: api.completion_chunk(rid, name, text, None, lp, i),
                       lambda rid, i, finish, lp=None: api.completion_chunk(rid, name, "", finish,
                                                                                   lp, i),
                       chat=False)

    def _chat(self, body) -> None:
        request = api.chat_request(body, self.server.model, self.server.name,
                                          self.server.template)
        name = request.model
        self._generate(request, "chatcmpl", api.chat_body,
                       lambda rid, i, text, lp: api.chat_chunk(rid, name, {"content": text},
                                                                      None, lp, i),
                       lambda rid, i, finish, lp=None: api.chat_chunk(rid, name, {}, finish, lp, i),
                       chat=True,
                       first=lambda rid, i: api.chat_chunk(
                           rid, name, {"role": "assistant", "content": ""}, index=i))

    # -- generation -----------------------------------------------------------------------
    def _generate(self, request, prefix, whole_body, piece_chunk, last_chunk, chat, first=None) -> None:
        """Run the request's choices in its slot, together where they can (choice_batch.py)
        and else one after another, and answer them, whole or streamed (each chunk names
        its choice's index; the choices' chunks come one choice after another)."""
        rid = api.new_id(prefix)
        server = self.server
        self._arrived, self._first_seen = time.monotonic(), False
        choices = request.choices()
        # the prompt cache serves single-choice requests; several choices start afresh
        use_cache = server.cache is not None and len(choices) == 1
        echoes = {}   # the echoed prompts' logprobs, scored once per prompt

        def echoed(run):
            p = run.choice.prompt_index
            if p not in echoes:
                echoes[p] = run.report.prompt(server.model, run.choice)
            return (run.choice.prompt_text if run.choice.echo else ""), echoes[p]

        records = []

        def usage():
            return api.usage(sum(len(ids) for ids, _ in request.prompts),
                                    sum(r.completion_tokens for r in records),
                                    sum(r.cached_tokens for r in records))

        with self._slot():
            if server.stopping.is_set():
                raise RequestError("the server is shutting down", status=503, kind="server_error")
            try:
                with ExitStack() as stack:
                    runs = self._runs(stack, choices, chat, use_cache)
                    if request.stream:
                        events = _Events(self)
                        for start in runs:
                            with start() as run:
                                records.append(run.record)
                                if not self._stream(events, rid, run, echoed, piece_chunk, last_chunk,
                                                    first):
                                    return
                                run.ok = True
                        if request.include_usage:
                            events.send(dict(last_chunk(rid, 0, None), choices=[], usage=usage()))
                        events.send("[DONE]")
                        self._answered(records, usage())
                        return
                    answers = []
                    for start in runs:
                        with start() as run:
                            records.append(run.record)
                            echo_text, echo_logprobs = echoed(run)
                            parts = list(self._pieces(run))
                            text = echo_text + "".join(piece for piece, _ in parts)
                            logprobs = joined([echo_logprobs] + [lp for _, lp in parts] + [run.report.take()],
                                              chat)
                            if logprobs is None and run.report.wanted:
                                logprobs = run.report.empty()
                            answers.append((text, run.record.finish_reason, logprobs))
                            run.ok = True
                self._send_json(200, whole_body(rid, request.model, answers, usage()))
                self._answered(records, usage())
            except TinyLoopError as e:
                raise _library_error(e) from None

    @contextmanager
    def _slot(self):
        """One of the server's generation slots, counted as waiting, then running."""
        metrics = self.server.metrics
        metrics.queue(waiting=1)
        try:
            self.server.slots.acquire()
        finally:
            metrics.queue(waiting=-1)
        metrics.queue(running=1)
        try:
            yield
        finally:
            metrics.queue(running=-1)
            self.server.slots.release()

    def _pieces(self, run):
        """The run's (piece, logprobs) chunks, the request's first text piece timed."""
        for piece, logprobs in run.chunks():
            if piece and not self._first_seen:
                self._first_seen = True
                self.server.metrics.first_piece(time.monotonic() - self._arrived)
            yield piece, logprobs

    def _answered(self, records, usage: dict) -> None:
        self.server.metrics.generation(time.monotonic() - self._arrived, usage["prompt_tokens"],
                                       usage["completion_tokens"],
                                       usage["prompt_tokens_details"]["cached_tokens"],
                                       [r.finish_reason for r in records])

    def _cancelled(self) -> bool:
        return self.server.stopping.is_set() or self._client_gone()

    def _runs(self, stack, choices, chat, use_cache) -> list:
        """Per choice, in order, a callable giving the context manager of its run: the
        choices of a ChoiceBatch (freed when `stack` closes), or one generation after
        another (each started when its turn comes)."""
        server = self.server
        if not (server.batch_choices and choice_batch.batchable(choices)):
            return [lambda choice=choice: self._run(choice, chat, use_cache) for choice in choices]
        batch = stack.enter_context(choice_batch.ChoiceBatch(
            server.model, choices, lambda choice, record: LogprobReport(server.model, choice, record, chat),
            batcher=server.batcher, cancelled=self._cancelled))
        return [lambda run=run: nullcontext(run) for run in batch.runs]

    @contextmanager
    def _run(self, choice, chat, use_cache):
        """One choice's generation (its pieces, record and logprob report), continuing a
        kept sequence when `use_cache`; the sequence is kept again afterwards, emptied
        unless the caller set `ok` (the generation went through)."""
        server = self.server
        record = TextGeneration(prompt_tokens=len(choice.prompt_ids))
        run = _ChoiceRun(choice, record, LogprobReport(server.model, choice, record, chat))
        prompt, options, lease = choice.prompt_ids, choice.options, None
        if use_cache:
            # a kept sequence has one depth: name it, so that 0 cannot mean another
            options = dict(options, depth=options.get("depth") or server.model.info.default_depth)
            try:
                lease = server.cache.acquire(prompt, options["depth"])
            except TinyLoopError as e:
                raise _library_error(e) from None
            prompt, record.cached_tokens = lease.rest, lease.cached
        if options["max_tokens"] > 0:
            run.pieces = generate_text(server.model, prompt, choice.stops, options, record,
                                       cancelled=self._cancelled,
                                       context=lease.context if lease else None, batcher=server.batcher)
        else:   # echo with max_tokens 0: the prompt alone
            run.pieces = _nothing_generated(record)
        try:
            yield run
        finally:
            run.pieces.close()
            if lease is not None:
                server.cache.release(lease, choice.prompt_ids + record.token_ids, run.ok)

    def _stream(self, events, rid, run, echoed, piece_chunk, last_chunk, first) -> bool:
        """Send one choice as server-sent events; False when the library failed after the
        stream had started (the error went out as the last event)."""
        index, report = run.choice.index, run.report
        try:
            # the first piece starts the library's stream: before the 200 went out, its
            # refusals are still a 4xx
            echo_text, echo_logprobs = echoed(run)
            chunks = self._pieces(run)
            head, head_logprobs = next(chunks, ("", None))
            if first:
                events.send(first(rid, index))
            if echo_text or echo_logprobs:   # a prompt of no text still has its tokens
                events.send(piece_chunk(rid, index, echo_text, echo_logprobs))
            if head:
                events.send(piece_chunk(rid, index, head, head_logprobs))
            for piece, logprobs in chunks:
                events.send(piece_chunk(rid, index, piece, logprobs))
        except TinyLoopError as e:
            if not events.started:
                raise
            events.send({"error": _library_error(e).body()["error"]})
            return False
        events.send(last_chunk(rid, index, run.record.finish_reason, report.take()))
        return True


# the routes responses are counted under (send_response); others count as "other"
_ROUTES = {"/v1/models", "/v1/models/{model}", "/health", "/metrics", "/v1/completions",
           "/v1/chat/completions", "/tokenize", "/detokenize"}


class _ChoiceRun:
    def __init__(self, choice, record, report):
        self.choice, self.record, self.report = choice, record, report
        self.pieces = None
        self.ok = False

    def chunks(self):
        """The text pieces, each with the log-probabilities of the tokens it brings."""
        for piece in self.pieces:
            yield piece, self.report.take()


class _Events:
    """A response's server-sent events: the 200 and its headers go out before the first."""

    def __init__(self, handler):
        self._handler = handler
        self.started = False

    def send(self, payload: dict | str) -> None:
        handler = self._handler
        if not self.started:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-cache")
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            self.started = True
        data = payload if isinstance(payload, str) else json.dumps(payload)
        handler.wfile.write(f"data: {data}\n\n".encode())
        handler.wfile.flush()


def _nothing_generated(record):
    """The pieces of a request that generates nothing (max_tokens 0)."""
    record.finish_reason = "length"
    return
    yield


def _library_error(error: TinyLoopError) -> RequestError:
    """A library refusal of the request (depth, drafts, context) as a 4xx; others 500."""
    if isinstance(error, (InvalidArgumentError, UnsupportedError)):
        return RequestError(str(error))
    if isinstance(error, ContextFullError):
        return RequestError(str(error), code="context_length_exceeded")
    return RequestError(str(error), status=500, kind="server_error")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def serve(model, *, host: str, port: int, name: str, parallel: int,
          prompt_cache: int | None = None, batch_decode: bool | None = None, log=None) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM, as service managers stop a process), then
    close the listening socket and let running generations end."""
    server = ModelServer((host, port), model, name=name, parallel=parallel,
                         prompt_cache=prompt_cache, batch_decode=batch_decode, log=log)
    # only from the main thread (where signals are delivered), and only over the default
    # disposition: a SIGTERM handler or an ignore someone else set stays theirs
    take_sigterm = (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    try:
        if take_sigterm:
            signal.signal(signal.SIGTERM, _stop_on_sigterm)
        print(f"tinyloop serve: {name} at {server.url}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr,
              flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if take_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.server_close()
