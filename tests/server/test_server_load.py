"""The server under load and at its end, on loopback only and bounded in count and time:
a burst of 256 concurrent streams (each answered: a stream ending in [DONE] or a clean
429 with Retry-After; no reset, no 5xx), clients leaving mid-stream, and SIGTERM during
32 streams (every client gets a last event and [DONE]; /health says draining)."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import textmodel
import tinyloop
from tinyloop.server import ModelServer, ServerOptions


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny random model with a long context, so that generations can run long."""
    path = tmp_path_factory.mktemp("load") / "long.tinyloop"
    textmodel.make_text_model(path, max_seq_len=4096)
    return path


def no_eos(model_or_vocab_eos: int) -> dict:
    return {"logit_bias": {str(model_or_vocab_eos): -100}}


def stream(port: int, body: dict, results: list, started: threading.Event | None = None,
           timeout: float = 60) -> None:
    """POST a streamed completion; append (status, headers, events or error body, failure)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)))
        response = conn.getresponse()
        headers = dict(response.getheaders())
        if response.status != 200:
            results.append((response.status, headers, json.loads(response.read()), None))
            return
        events = []
        while line := response.readline():
            if line.startswith(b"data: "):
                events.append(line[6:].strip().decode())
                if started is not None:
                    started.set()
        results.append((200, headers, events, None))
        conn.close()
    except Exception as e:   # a reset or a timeout: what the burst must never see
        results.append((None, {}, None, repr(e)))


def test_a_burst_of_256_streams_is_answered(long_model):
    model = tinyloop.Model(long_model, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name="tiny", parallel=2,
                         options=ServerOptions(max_waiting=32))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    results, barrier = [], threading.Barrier(256)

    def one():
        barrier.wait()
        stream(port, {"prompt": "Hi", "max_tokens": 8, "temperature": 0}, results)

    try:
        clients = [threading.Thread(target=one) for _ in range(256)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(90)
        assert len(results) == 256
        failures = [r[3] for r in results if r[3] is not None]
        assert failures == []
        done = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(done) + len(refused) == 256, sorted({r[0] for r in results})
        assert all(r[2][-1] == "[DONE]" for r in done)
        assert all(int(r[1]["retry-after"]) >= 1 and r[2]["error"]["code"] == "queue_full" for r in refused)
        assert len(done) >= 34   # at least the slots and the queue's worth
    finally:
        server.shutdown()
        server.server_close()
        model.close()


def test_clients_leaving_mid_stream_free_their_slots(long_model):
    model = tinyloop.Model(long_model, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name="tiny", parallel=4)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    body = json.dumps({"prompt": "Hi", "max_tokens": 3000, "stream": True, **no_eos(textmodel.EOS)})
    try:
        conns = []
        for _ in range(8):   # more than the slots: some wait, and leave while waiting
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", body=body)
            conns.append(conn)
        first = conns[0].getresponse()
        assert first.status == 200 and first.readline().startswith(b"data: ")
        for conn in conns:
            conn.sock.close()
        deadline = time.monotonic() + 20
        while (server.state.slots.running or server.state.slots.waiting) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.state.slots.running == 0 and server.state.slots.waiting == 0
        assert server.engine.wait_idle(10)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}))
        assert conn.getresponse().status == 200
    finally:
        server.shutdown()
        server.server_close()
        model.close()


def test_drain_lets_running_requests_finish(long_model, monkeypatch):
    model = tinyloop.Model(long_model, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name="tiny", parallel=2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    real = tinyloop.model.TokenStream.__next__

    def slow(s):
        time.sleep(0.02)
        return real(s)

    monkeypatch.setattr(tinyloop.model.TokenStream, "__next__", slow)
    results, started = [], threading.Event()
    client = threading.Thread(target=stream, args=(server.server_address[1], {
        "prompt": "Hi", "max_tokens": 20, **no_eos(textmodel.EOS)}, results, started))
    try:
        client.start()
        assert started.wait(30)
        assert server.drain(timeout=20) is True
        client.join(30)
        events = results[0][2]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        server.server_close()
        model.close()


_CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'tinyloop'; runpy.run_module('tinyloop', run_name='__main__')")


def test_sigterm_during_32_streams_ends_each_with_an_event(long_model):
    proc = subprocess.Popen([sys.executable, "-c", _CLI, "serve", str(long_model), "--port", "0",
                             "--threads", "1", "--parallel", "32", "--drain-timeout", "1", "--name", "tiny"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = proc.stderr.readline()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        results, starts = [], [threading.Event() for _ in range(32)]
        body = {"prompt": "Hi", "max_tokens": 4000, **no_eos(textmodel.EOS)}
        clients = [threading.Thread(target=stream, args=(port, body, results, started))
                   for started in starts]
        for c in clients:
            c.start()
        for started in starts:
            assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())) == (503, {"status": "draining"})
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}))
        response = conn.getresponse()
        assert response.status == 503 and json.loads(response.read())["error"]["code"] == "server_shutdown"
        conn.close()
        for c in clients:
            c.join(60)
        assert len(results) == 32 and all(r[3] is None and r[0] == 200 for r in results), results
        for _, _, events, _ in results:
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
