"""`tinyloop serve`: an OpenAI-compatible HTTP server over one loaded model (docs/server.md).

uvicorn runs the ASGI app (app.py) on one event loop, over a socket bound here with a
real accept queue; the connections' limits are protocol.py's. Generations run in worker
threads (engine.py), at most `parallel` at once, each in a context of its own, so they
run in parallel in C; the others wait in a bounded queue. ModelServer is the server as
an object (serve_forever, drain, shutdown, server_close); serve() runs one until SIGTERM
or Ctrl-C, then drains it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
import time

import uvicorn

from .app import ServerOptions, State, build_app
from .engine import Engine
from .protocol import Limits, protocol_class


class _Uvicorn(uvicorn.Server):
    # signals are serve()'s: they drain rather than stop at once
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(address, backlog: int) -> socket.socket:
    host, port = address[:2]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ModelServer:
    """A server of `model` on `address` (host, port; port 0 = any free one), bound when
    made. `name` is the model's name, or a list of names (aliases, the first the main one);
    `options` (ServerOptions) the limits, the key and the checks."""

    def __init__(self, address, model, *, name, parallel: int = 1, prompt_cache: int | None = None,
                 batch_decode: bool | None = None, batch_choices: bool = True, log=None,
                 options: ServerOptions | None = None):
        options = options or ServerOptions()
        if options.max_waiting < 0:
            raise ValueError(f"max_waiting is {options.max_waiting}: requests waiting at most, 0 = none")
        self.options = options
        self.engine = Engine(model, names=name, parallel=parallel, prompt_cache=prompt_cache,
                             batch_decode=batch_decode, batch_choices=batch_choices,
                             max_tokens_cap=options.max_tokens)
        try:
            self.socket = _listen(address, options.backlog)
        except BaseException:
            self.engine.close()
            raise
        self.server_address = self.socket.getsockname()
        self.state = State(self.engine, options, log, str(address[0]))
        self.app = build_app(self.state)
        limits = Limits(options.header_timeout, options.max_header_bytes, options.max_connections)
        config = uvicorn.Config(self.app, http=protocol_class(limits), lifespan="off", log_level="warning",
                                access_log=False, timeout_keep_alive=options.keep_alive_timeout,
                                timeout_graceful_shutdown=5, backlog=options.backlog, ws="none",
                                server_header=False)
        self._uvicorn = _Uvicorn(config)
        self._served = threading.Event()    # serve_forever has ended
        self._serving = False
        self._closed = False

    # what the server shares with its callers and tests
    model = property(lambda self: self.engine.model)
    name = property(lambda self: self.engine.name)
    names = property(lambda self: self.engine.names)
    parallel = property(lambda self: self.engine.parallel)
    cache = property(lambda self: self.engine.cache)
    batcher = property(lambda self: self.engine.batcher)
    metrics = property(lambda self: self.engine.metrics)
    template = property(lambda self: self.engine.template)
    stopping = property(lambda self: self.engine.stopping)
    draining = property(lambda self: self.state.draining)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve in this thread until shutdown() or the end of drain()."""
        self._serving = True
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._served.set()

    def _stop_serving(self, timeout: float | None) -> None:
        self._uvicorn.should_exit = True
        if self._serving:
            self._served.wait(timeout)

    def shutdown(self) -> None:
        """Stop at once: the running generations end at their next token (a stream with
        an error event), and serving ends; returns when serve_forever has returned."""
        self.engine.stopping.set()
        self._stop_serving(30)

    def drain(self, timeout: float | None = None) -> bool:
        """Stop gracefully: refuse new generation requests (503; /health says "draining"),
        let the running and waiting ones finish for up to `timeout` seconds (default: the
        options' drain_timeout), then end the streams still open with an error event and
        [DONE] and stop serving. True when everything finished in time."""
        timeout = self.options.drain_timeout if timeout is None else timeout
        self.state.draining = True
        deadline = time.monotonic() + timeout
        slots = self.state.slots
        while time.monotonic() < deadline and (slots.waiting or slots.running):
            time.sleep(0.05)
        finished = not (slots.waiting or slots.running)
        if not finished:
            self.engine.ending.set()
            self.engine.wait_idle(10)
        self._stop_serving(30)
        return finished

    def server_close(self) -> None:
        """End the running generations at their next token and wait for them, so that the
        model may be closed afterwards; close the socket."""
        if self._closed:
            return
        self._closed = True
        self.engine.stopping.set()
        if self._serving and not self._served.is_set():
            self._stop_serving(30)
        self.engine.close()
        self.state.executor.shutdown(wait=True)
        self.socket.close()


def serve(model, *, host: str, port: int, name, parallel: int,
          prompt_cache: int | None = None, batch_decode: bool | None = None, log=None,
          options: ServerOptions | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C (the first drains the server, options.drain_timeout;
    a second stops it at once), then let running generations end."""
    server = ModelServer((host, port), model, name=name, parallel=parallel, prompt_cache=prompt_cache,
                         batch_decode=batch_decode, log=log, options=options)
    # only from the main thread (where signals are delivered), and only over the default
    # dispositions: a handler or an ignore someone else set stays theirs
    main = threading.current_thread() is threading.main_thread()
    taken = {}
    signals = 0

    def on_signal(signum, frame):
        nonlocal signals
        signals += 1
        if signals == 1:
            print(f"tinyloop serve: {signal.Signals(signum).name}: draining (again to stop at once)",
                  file=sys.stderr, flush=True)
            threading.Thread(target=server.drain, name="tinyloop-drain", daemon=True).start()
        else:
            server.engine.stopping.set()
            server._uvicorn.should_exit = True

    try:
        for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if main and signal.getsignal(sig) == default:
                taken[sig] = signal.signal(sig, on_signal)
        names = ", ".join(server.names)
        print(f"tinyloop serve: {names} at {server.url}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr,
              flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        for sig, previous in taken.items():
            signal.signal(sig, previous)
        server.server_close()
