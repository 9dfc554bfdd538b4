"""The server's HTTP layer: HTTP/1.1 conformance (405 with Allow, HEAD, one Content-Length,
header limits and deadlines, keep-alive), every error in OpenAI's JSON shape, the API
key on every endpoint but /health, Host and Origin checks, CORS, the bounded queue (429
with Retry-After), per-request caps and deadlines, ignored OpenAI fields, model aliases,
request ids and the access log."""

import http.client
import json
import socket
import threading
import time

import pytest

import textmodel
import tinyloop
from tinyloop.server import ModelServer, ServerOptions

GREEDY = {"temperature": 0}
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("http") / "plain.tinyloop"
    textmodel.make_text_model(path)
    return path


class Server:
    def __init__(self, path, options=None, **kw):
        self.model = tinyloop.Model(path, threads=1)
        self.lines = []
        self.server = ModelServer(("127.0.0.1", 0), self.model, name=kw.pop("name", "tiny"),
                                  options=options, log=self.lines.append, **kw)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def request(self, method, path, body=None, headers=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, dict(response.getheaders()), payload

    def raw(self, data: bytes, wait: float = 30) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=wait) as s:
            s.sendall(data)
            received = b""
            try:
                while chunk := s.recv(65536):
                    received += chunk
            except TimeoutError:
                pass
        return received

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.model.close()


@pytest.fixture(scope="module")
def server(model_path):
    running = Server(model_path, name=["tiny", "gpt-4o-mini"])
    yield running
    running.close()


def error_of(payload: bytes) -> dict:
    body = json.loads(payload)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("method,path,allow", [("PUT", "/v1/completions", "POST"),
                                               ("DELETE", "/v1/models", "GET, HEAD"),
                                               ("OPTIONS", "/health", "GET, HEAD"),
                                               ("GET", "/v1/chat/completions", "POST")])
def test_a_wrong_method_is_a_405_in_json_with_allow(server, method, path, allow):
    status, headers, payload = server.request(method, path)
    assert status == 405
    assert set(headers["allow"].split(", ")) == set(allow.split(", "))
    assert error_of(payload)["code"] == "method_not_allowed"


def test_head_on_get_routes(server):
    for path in ("/health", "/v1/models", "/metrics"):
        status, headers, payload = server.request("HEAD", path)
        assert status == 200 and payload == b"" and int(headers["content-length"]) > 0


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
])
def test_ambiguous_framing_is_refused_in_json(server, head):
    received = server.raw(head)
    assert received.startswith(b"HTTP/1.1 400"), received
    assert received.count(b"HTTP/1.1") == 1
    assert error_of(received.split(b"\r\n\r\n", 1)[1])["code"] == "bad_request"


def test_huge_headers_are_a_431_in_json(server):
    received = server.raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 431")
    assert error_of(received.split(b"\r\n\r\n", 1)[1])["code"] == "headers_too_large"


def test_a_header_trickle_is_cut_off(model_path):
    running = Server(model_path, ServerOptions(header_timeout=0.5))
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            received = b""
            for _ in range(20):   # a byte every 0.1 s, never the end of the head
                try:
                    s.sendall(b"X")
                except OSError:
                    break
                time.sleep(0.1)
            try:
                while chunk := s.recv(4096):
                    received += chunk
            except OSError:
                pass
        assert received.startswith(b"HTTP/1.1 408"), received
        assert time.monotonic() - started < 5
        # an idle connection is closed too, without an answer
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
            assert s.recv(10) == b""
    finally:
        running.close()


def test_keep_alive_serves_several_requests_on_one_connection(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(3):
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 2}))
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"]
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b'{"status": "ok"}'
    conn.close()


def test_a_chunked_body_is_read(server):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    received = server.raw(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert received.startswith(b"HTTP/1.1 200"), received


@pytest.mark.parametrize("raw,status", [(b"{bad", 400), (b"[]", 400), (b'{"prompt": "x", "n": "2"}', 400)])
def test_bad_json_bodies(server, raw, status):
    code, headers, payload = server.request("POST", "/v1/completions", raw=raw)
    assert code == status and headers["content-type"] == "application/json"
    error_of(payload)


def test_unknown_paths_and_models_are_json_404s(server):
    status, _, payload = server.request("GET", "/nowhere")
    assert status == 404 and error_of(payload)["code"] == "not_found"
    status, _, payload = server.request("GET", "/v1/models/other")
    assert status == 404 and error_of(payload)["code"] == "model_not_found"


def test_model_aliases(server):
    status, _, payload = server.request("GET", "/v1/models")
    assert [m["id"] for m in json.loads(payload)["data"]] == ["tiny", "gpt-4o-mini"]
    assert server.request("GET", "/v1/models/gpt-4o-mini")[0] == 200
    status, _, payload = server.request("POST", "/v1/completions", {"model": "gpt-4o-mini", "prompt": "Hi",
                                                                    "max_tokens": 2})
    assert status == 200 and json.loads(payload)["model"] == "gpt-4o-mini"
    status, _, payload = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert json.loads(payload)["model"] == "tiny"


def test_ignored_openai_fields_warn_unless_strict(server, model_path):
    body = {"prompt": "Hi", "max_tokens": 2, "store": True, "metadata": {"a": "b"}}
    status, headers, _ = server.request("POST", "/v1/completions", body)
    assert status == 200 and "ignored fields: metadata, store" in headers["warning"]
    status, _, payload = server.request("POST", "/v1/completions", dict(body, bogus=1))
    assert status == 400 and error_of(payload)["param"] == "bogus"
    strict = Server(model_path, ServerOptions(strict=True))
    try:
        status, _, payload = strict.request("POST", "/v1/completions", body)
        assert status == 400 and error_of(payload)["param"] == "metadata"
    finally:
        strict.close()


def test_request_ids_are_echoed_and_logged(server):
    status, headers, _ = server.request("GET", "/health", headers={"X-Request-Id": "abc-123"})
    assert headers["x-request-id"] == "abc-123"
    status, headers, _ = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "depth": 2})
    rid = headers["x-request-id"]
    assert len(rid) == 24
    line = next(line for line in server.lines if f"id={rid}" in line)
    assert '"POST /v1/completions" 200' in line and "completion=3" in line and "depth=2" in line
    assert "ms id=" in line and line[:4].isdigit()


@pytest.fixture(scope="module")
def locked(model_path):
    running = Server(model_path, ServerOptions(api_key=KEY, json_logs=True))
    yield running
    running.close()


ENDPOINTS = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/metrics", None),
             ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
             ("POST", "/v1/embeddings", {"input": "Hi"}),
             ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/nowhere", None), ("PUT", "/v1/completions", None)]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_every_endpoint_but_health_needs_the_key(locked, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": "Basic " + KEY}):
        status, answer_headers, payload = locked.request(method, path, body, headers)
        assert status == 401, (headers, payload)
        assert error_of(payload)["code"] == "invalid_api_key"
        assert answer_headers["www-authenticate"] == "Bearer"
    status, _, _ = locked.request(method, path, body, {"Authorization": f"Bearer {KEY}"})
    assert status != 401


def test_health_needs_no_key_and_the_log_is_json(locked):
    assert locked.request("GET", "/health")[0] == 200
    record = json.loads(locked.lines[-1])
    assert record["route"] == "/health" and record["status"] == 200 and record["latency_ms"] >= 0
    assert {"time", "request_id", "prompt_tokens", "completion_tokens", "depth", "queue"} <= set(record)


def test_metrics_may_be_public(model_path):
    running = Server(model_path, ServerOptions(api_key=KEY, metrics_need_key=False))
    try:
        assert running.request("GET", "/metrics")[0] == 200
        assert running.request("GET", "/v1/models")[0] == 401
    finally:
        running.close()


def test_foreign_host_and_origin_are_refused_on_loopback(server):
    for headers in ({"Host": "evil.example:8080"}, {"Origin": "https://evil.example"},
                    {"Origin": "null"}):
        status, _, payload = server.request("POST", "/v1/completions",
                                            {"prompt": "Hi", "max_tokens": 2}, headers)
        assert status == 403, headers
        assert error_of(payload)["type"] == "permission_error"
    for headers in ({"Host": "127.0.0.1:1"}, {"Host": "localhost"}, {"Host": "[::1]:80"},
                    {"Origin": "http://localhost:3000"}):
        assert server.request("GET", "/health", headers=headers)[0] == 200, headers


def test_cors_allow_list(model_path):
    running = Server(model_path, ServerOptions(api_key=KEY, cors_origins=("https://app.example",)))
    try:
        status, headers, _ = running.request("OPTIONS", "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        status, headers, _ = running.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, {
            "Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        assert running.request("GET", "/health", headers={"Origin": "https://other.example"})[0] == 403
    finally:
        running.close()


def test_a_full_queue_is_a_429_with_retry_after(model_path):
    running = Server(model_path, ServerOptions(max_waiting=1))
    gate, entered = threading.Event(), threading.Event()
    original = running.server.metrics.first_piece

    def held(seconds):
        entered.set()
        gate.wait(30)
        original(seconds)

    running.server.metrics.first_piece = held
    results = []
    body = {"prompt": "Hi", "max_tokens": 2}
    try:
        threads = [threading.Thread(target=lambda: results.append(running.request("POST", "/v1/completions", body)))
                   for _ in range(2)]
        threads[0].start()
        assert entered.wait(30)
        threads[1].start()
        deadline = time.monotonic() + 10
        while running.server.state.slots.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, payload = running.request("POST", "/v1/completions", body)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert error_of(payload)["type"] == "rate_limit_error"
        gate.set()
        for t in threads:
            t.join(30)
        assert sorted(r[0] for r in results) == [200, 200]
        text = running.request("GET", "/metrics")[2].decode()
        assert 'tinyloop_requests_rejected_total{reason="queue_full"} 1' in text
        assert "tinyloop_queue_length 0" in text
    finally:
        gate.set()
        running.close()


def test_max_tokens_cap(model_path):
    running = Server(model_path, ServerOptions(max_tokens=4))
    try:
        status, _, payload = running.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
        assert status == 400 and error_of(payload)["param"] == "max_tokens"
        status, _, payload = running.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                                         **GREEDY})
        assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] <= 4
    finally:
        running.close()


def test_a_request_past_its_deadline(model_path, monkeypatch):
    running = Server(model_path, ServerOptions(request_timeout=0.3))
    real = tinyloop.model.TokenStream.__next__

    def slow(stream):
        time.sleep(0.05)
        return real(stream)

    monkeypatch.setattr(tinyloop.model.TokenStream, "__next__", slow)
    try:
        body = {"prompt": "Hi", "max_tokens": 60, "logit_bias": {str(running.model.tokenizer.eos_id): -100}}
        status, _, payload = running.request("POST", "/v1/completions", body)
        assert status == 504 and error_of(payload)["code"] == "timeout"
        status, _, payload = running.request("POST", "/v1/completions", dict(body, stream=True))
        events = [e for e in payload.decode().split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "timeout"
    finally:
        running.close()


def test_verify_checksums_refuses_a_damaged_model(model_path, tmp_path):
    """`tinyloop serve --verify-checksums` does not serve a model whose weights were overwritten."""
    import subprocess
    import sys
    data = bytearray(model_path.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])   # inside the weights
    damaged = tmp_path / "damaged.tinyloop"
    damaged.write_bytes(bytes(data))
    tinyloop.Model(damaged, threads=1).close()   # it loads without the check
    done = subprocess.run([sys.executable, "-m", "tinyloop", "serve", str(damaged), "--port", "0",
                           "--threads", "1", "--verify-checksums"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "checksum" in done.stderr.lower(), done.stderr
