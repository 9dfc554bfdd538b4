"""`tinyloop serve`: an OpenAI-compatible HTTP server over one loaded model (docs/server.md).

http_server: the server (ModelServer, serve) on uvicorn; app: the ASGI app (routes,
limits, auth, access log; ServerOptions); protocol: the HTTP connection's limits;
engine: the generations, in worker threads; api: request and response bodies; tools:
tool calling; embeddings: /v1/embeddings; tokens: /tokenize and /detokenize; logprobs:
the log-probabilities a response reports; metrics: GET /metrics; choice_batch: a
request's choices stepped together; decode_batcher: concurrent generations' decode steps
taken together.
"""

from .app import ServerOptions
from .http_server import ModelServer, serve

__all__ = ["ModelServer", "ServerOptions", "serve"]
