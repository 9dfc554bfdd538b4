"""`tinyloop serve`: an OpenAI-compatible HTTP server over one loaded model (docs/server.md).

http_server: the server and its request handler (ModelServer, serve); api: request and
response bodies; tokens: /tokenize and /detokenize; logprobs: the log-probabilities a
response reports; metrics: GET /metrics; choice_batch: a request's choices stepped
together; decode_batcher: concurrent generations' decode steps taken together.
"""

from .http_server import ModelServer, serve

__all__ = ["ModelServer", "serve"]
