"""The server's refusal of a request: an HTTP status, OpenAI's error body and the
response's headers (api.py raises it for bad bodies, the app for its limits)."""

from __future__ import annotations


class RequestError(Exception):
    """A refusal: its HTTP status, OpenAI's error body, and headers for the response
    (Retry-After, Allow, ...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
