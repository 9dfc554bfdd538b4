"""POST /v1/embeddings (docs/server.md, "Embeddings")."""

from __future__ import annotations

from .api import RequestError


def embedding_request(body, model, served):
    raise RequestError("embeddings are not available yet", status=501, kind="server_error")


def embed(engine, request, gone):
    raise RequestError("embeddings are not available yet", status=501, kind="server_error")
