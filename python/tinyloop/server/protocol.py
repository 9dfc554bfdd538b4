"""The HTTP/1.1 connection the server runs under uvicorn: uvicorn's httptools protocol (the
llhttp parser: strict framing, so a second Content-Length, a Content-Length beside
Transfer-Encoding or a malformed length is refused) with the limits uvicorn leaves out
(docs/server.md, "Connections"):

- a header deadline: a request's headers must be complete within `header_timeout` from
  the connection's start or the end of the previous response (a client trickling bytes
  is cut off, which uvicorn's keep-alive timer, reset by every byte, does not do);
- a header size limit (431);
- a connection cap: a connection beyond `max_connections` gets a 503 and is closed;
- every error uvicorn writes itself in OpenAI's JSON error shape.
"""

from __future__ import annotations

import json

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


def error_bytes(status: int, message: str, kind: str, code: str | None = None,
                headers: tuple = ()) -> bytes:
    """A whole HTTP response carrying an OpenAI error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    lines = [STATUS_LINE[status], b"content-type: application/json\r\n",
             b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    lines += [b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in headers]
    return b"".join(lines) + b"\r\n" + body


class Limits:
    """The connection limits one server's protocols share (set before it starts)."""

    def __init__(self, header_timeout: float, max_header_bytes: int, max_connections: int):
        self.header_timeout = header_timeout
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections


def protocol_class(limits: Limits) -> type:
    """uvicorn's `http` protocol class for these limits."""

    class Protocol(_LimitedProtocol):
        pass

    Protocol.limits = limits
    return Protocol


class _LimitedProtocol(HttpToolsProtocol):
    limits: Limits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_bytes = self._head_bytes = 0
        self._in_headers = False   # bytes of a request's head have arrived, not all of it
        self._deadline = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server holds {self.limits.max_connections} connections, "
                              "its limit: retry shortly", "server_error", "too_many_connections",
                         (("retry-after", "1"),))
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_bytes = self._head_bytes = 0
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_headers:
            self._refuse(408, f"the request's headers did not arrive within "
                              f"{self.limits.header_timeout:g} s", "invalid_request_error", "timeout")
        else:   # an idle connection: nothing to answer
            self.transport.close()

    def _refuse(self, status: int, message: str, kind: str, code: str | None, headers=()) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(error_bytes(status, message, kind, code, headers))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._deadline is not None:   # reading a request's head
            self._in_headers = True
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:   # no upgrades (WebSocket) are served
            self._refuse(400, "protocol upgrades are not supported", "invalid_request_error",
                         "bad_request")
        except httptools.HttpParserError as e:   # the parser's reason, e.g. a second Content-Length
            if self._header_bytes > self.limits.max_header_bytes:   # on_header stopped it
                self._refuse(431, f"the request's headers exceed {self.limits.max_header_bytes} bytes",
                             "invalid_request_error", "headers_too_large")
                return
            reason = str(e) or "malformed request"
            self._refuse(400, f"malformed HTTP request: {reason}", "invalid_request_error",
                         "bad_request")
            return
        # a head still unfinished after all these bytes (one header line the parser holds)
        if self._deadline is not None and self._head_bytes > self.limits.max_header_bytes:
            self._header_bytes = self._head_bytes
            self._refuse(431, f"the request's headers exceed {self.limits.max_header_bytes} bytes",
                         "invalid_request_error", "headers_too_large")

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.limits.max_header_bytes:
            raise ValueError("headers too large")   # stops the parser (data_received answers 431)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next request's head, on this kept-alive connection (unless a pipelined one
        # has already arrived and started)
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg}", "invalid_request_error", "bad_request")
