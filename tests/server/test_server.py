"""`tinyloop serve`: the OpenAI-compatible endpoints on a tiny model with a real tokenizer.
Answers equal the Python API's; bad requests get a 4xx naming the field and cost nothing;
streams, stop strings, parallel requests, a client leaving mid-stream and the CLI."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import textmodel
import tinyloop
from serving import Running

GREEDY = {"temperature": 0}


def test_models_and_health(server):
    status, body = server.request("GET", "/v1/models")
    assert status == 200
    entry = json.loads(body)["data"][0]
    assert entry["id"] == "tiny" and entry["max_model_len"] == textmodel.MAX_SEQ_LEN
    assert server.request("GET", "/v1/models/tiny")[0] == 200
    assert server.request("GET", "/health") == (200, b'{"status": "ok"}')
    status, body = server.request("GET", "/v2/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_completion_equals_the_python_api(server):
    expected = server.model.generate("Hello", max_tokens=8, temperature=0)
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello",
                                                   "max_tokens": 8, **GREEDY})
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == {"max_tokens": "length", "eos": "stop"}[expected.stop_reason]
    n_prompt = len(server.model.tokenizer.encode("Hello"))
    usage = body["usage"]
    assert {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": n_prompt, "completion_tokens": len(expected.tokens),
        "total_tokens": n_prompt + len(expected.tokens)}
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < n_prompt
    # token-id prompts, a batch of one, the per-request loop depth
    ids = server.model.tokenizer.encode("Hello")
    for prompt in (ids, [ids], ["Hello"]):
        assert server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, **GREEDY})[1][
            "choices"][0]["text"] == choice["text"]
    deep = server.model.generate("Hello", max_tokens=8, temperature=0, depth=4)
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "depth": 4,
                                                   **GREEDY})
    assert body["choices"][0]["text"] == deep.text


def test_stream_equals_the_whole_answer(server):
    request = {"prompt": "Once upon", "max_tokens": 12, **GREEDY}
    whole = server.post("/v1/completions", request)[1]["choices"][0]
    events = server.events("/v1/completions", dict(request, stream=True,
                                                   stream_options={"include_usage": True}))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == whole["text"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == whole["finish_reason"]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_stop_strings_end_the_text_before_them(server):
    # the seeded model's greedy continuation, then a stop string from its middle
    text = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 20, **GREEDY})[1][
        "choices"][0]["text"]
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = text.find(stop)
    status, body = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 20, "stop": [stop],
                                                   **GREEDY})
    assert body["choices"][0] == {"index": 0, "text": text[:cut], "finish_reason": "stop",
                                  "logprobs": None}
    events = server.events("/v1/completions", {"prompt": "abc", "max_tokens": 20, "stop": stop,
                                               "stream": True, **GREEDY})
    assert "".join(e["choices"][0]["text"] for e in events) == text[:cut]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_sampling_is_seeded(server):
    request = {"prompt": "Hi", "max_tokens": 10, "temperature": 1.0, "top_k": 20, "seed": 3}
    first, second = (server.post("/v1/completions", request)[1]["choices"][0]["text"] for _ in "ab")
    assert first == second
    # the same with drafts (speculative sampling: the library's own tests check the
    # distribution; here the request is taken and seeded)
    request.update(draft_depth=1, n_draft=3)
    replies = [server.post("/v1/completions", request) for _ in "ab"]
    assert [status for status, _ in replies] == [200, 200], replies
    assert replies[0][1]["choices"][0]["text"] == replies[1][1]["choices"][0]["text"]
    request.update(draft_p_min=0.3)
    status, reply = server.post("/v1/completions", request)
    assert status == 200, reply


def test_chat(chat_server):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "<s>system\nBe brief.</s>\n<s>user\nHi</s>\n<s>assistant\n"
    ids = chat_server.model.tokenizer.encode(rendered, add_bos=False)
    expected = chat_server.model.generate(ids, max_tokens=6, temperature=0)
    status, body = chat_server.post("/v1/chat/completions", {"messages": messages,
                                                             "max_tokens": 6, **GREEDY})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(ids)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant",
                       "content": chat_server.model.tokenizer.decode(expected.tokens)}
    events = chat_server.events("/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                         "stream": True, **GREEDY})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]
    # max_completion_tokens is the newer name; content parts are joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    status, body = chat_server.post("/v1/chat/completions", {"messages": parts,
                                                             "max_completion_tokens": 3, **GREEDY})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3


def test_a_conversation_continues_its_kept_sequence(paths):
    """A prompt that resends the one before and its answer reuses that request's sequence
    (usage says how many prompt tokens), a deeper request deepens it, and every answer is
    the uncached server's."""
    cached_server, plain_server = Running(paths[0]), Running(paths[0], prompt_cache=0)
    try:
        prompt, turns = "Sea", []
        for depth, stream in ((2, False), (2, True), (4, False), (3, False)):
            body = {"prompt": prompt, "max_tokens": 8, "depth": depth, **GREEDY}
            if stream:
                events = cached_server.events("/v1/completions", dict(
                    body, stream=True, stream_options={"include_usage": True}))
                text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                usage = events[-1]["usage"]
            else:
                status, answer = cached_server.post("/v1/completions", body)
                assert status == 200, answer
                text, usage = answer["choices"][0]["text"], answer["usage"]
            status, expected = plain_server.post("/v1/completions", body)
            assert text == expected["choices"][0]["text"], (depth, stream)
            assert expected["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            turns.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            prompt = prompt + text + " more"
        assert turns[0][1] == 0
        assert turns[1][1] >= turns[0][0]        # the first prompt and its answer were kept
        assert turns[2][1] >= turns[1][0]        # deepened from depth 2 to 4
        assert turns[3][1] == 0                  # depth 3 after 4: started over
    finally:
        cached_server.close()
        plain_server.close()


def test_a_stream_failing_midway_empties_its_kept_sequence(paths, monkeypatch):
    """A library error after the stream started goes out as the last event, and the
    request's kept sequence is emptied rather than trusted."""
    running = Running(paths[0])
    try:
        real_next, calls = tinyloop.model.TokenStream.__next__, []

        def failing_next(stream):
            calls.append(1)
            if len(calls) == 4:
                raise tinyloop.errors.TinyLoopError("injected failure")
            return real_next(stream)

        monkeypatch.setattr(tinyloop.model.TokenStream, "__next__", failing_next)
        status, payload = running.request("POST", "/v1/completions", {
            "prompt": "Hello", "max_tokens": 8, "stream": True, **GREEDY})
        assert status == 200
        last = json.loads([line for line in payload.decode().split("\n\n") if line][-1][6:])
        assert "injected failure" in last["error"]["message"]
        assert [seq.tokens for seq in running.server.cache._idle] == [[]]
        assert [len(seq.context) for seq in running.server.cache._idle] == [0]
    finally:
        running.close()


def test_chat_without_template_is_refused(server):
    status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "no chat template" in body["error"]["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "bogus": 1}, "bogus", "unknown field"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "x", "temperature": 3}, "temperature", "must be in"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "must be in"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "n": 0}, "n", "must be in"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "must be in"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
    ({"prompt": "x", "logprobs": 2, "draft_depth": 1}, None, "speculative"),
    ({"prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", "must be in"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias", "not a token id"),
    ({"prompt": "x", "logit_bias": {"3": 200}}, "logit_bias", "logit_bias[3] must be in"),
    ({"prompt": "x", "logit_bias": {"3": "up"}}, "logit_bias", "logit_bias[3] must be a number"),
    ({"prompt": "x", "logit_bias": {"3": 1}, "draft_depth": 1}, None, "speculative"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "must not be empty"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream = true"),
    ({"prompt": "x", "depth": 99}, "depth", "must be in"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 2, 999]}, "prompt", "out of range"),
    ({"prompt": ["a", ""]}, "prompt[1]", "prompt[1] is empty"),
    ({"prompt": {"text": "x"}}, "prompt", "must be a non-empty string"),
    ({"prompt": "x" * 200}, "prompt", "context"),
    ({"prompt": "x", "depth": 1, "draft_depth": 2}, None, "deeper than the generation's depth"),
    ({"prompt": "x", "draft_depth": 1, "draft_p_min": 1.5}, "draft_p_min", "must be in"),
    ({}, "prompt", "must be a non-empty string"),
])
def test_bad_completion_requests(server, body, param, words):
    status, reply = server.post("/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_bad_chat_requests(chat_server):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    for messages, words in (([], "non-empty list"), ([{"role": "robot", "content": "x"}], "role"),
                            ([{"role": "user", "content": 5}], "must be a string"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts")):
        status, reply = chat_server.post("/v1/chat/completions", {"messages": messages})
        assert status == 400 and words in reply["error"]["message"], reply


def test_bad_http_is_refused_and_the_server_lives_on(server):
    status, body = server.request("POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = server.request("POST", "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]
    status, body = server.request("POST", "/v1/completions", raw=b"\xff\xfe")
    assert status == 400
    assert server.post("/v1/completions", {"model": "other", "prompt": "x"})[0] == 404
    # no Content-Length; a body over the limit (refused before it is read)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert b" 411 " in s.recv(4096).split(b"\r\n")[0]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 99999999\r\n\r\n")
        assert b" 413 " in s.recv(4096).split(b"\r\n")[0]
    # a Content-Length of a non-ASCII digit (latin-1 "\xb2", a digit to str.isdigit)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: \xb2\r\n\r\n")
        assert b" 400 " in s.recv(4096).split(b"\r\n")[0]
    assert server.request("POST", "/v1/nothing", {"prompt": "x"})[0] == 404
    assert server.post("/v1/completions", {"prompt": "fine", "max_tokens": 2})[0] == 200


def test_parallel_requests_give_the_sequential_answers(server):
    prompts = ["alpha", "beta", "gamma", "delta"]
    expected = {p: server.post("/v1/completions", {"prompt": p, "max_tokens": 10, **GREEDY})[1]
                ["choices"][0]["text"] for p in prompts}
    assert stream_concurrently(server, prompts, {"max_tokens": 10, "stream": True, **GREEDY}) == expected


def stream_concurrently(running, prompts, body) -> dict:
    """The streamed completions of the prompts, each requested from its own thread, all at once."""
    got, barrier = {}, threading.Barrier(len(prompts))

    def one(p):
        barrier.wait()
        got[p] = "".join(e["choices"][0]["text"] for e in running.events("/v1/completions", {"prompt": p, **body}))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_concurrent_requests_share_their_decode_steps(paths, monkeypatch):
    """With several slots on the CPU the decode steps of concurrent generations run
    together (fewer batched steps than tokens), and each answer is the one it gets alone;
    a stream failing inside a batched step ends only its own request, with the error as
    its last event."""
    running = Running(paths[0], parallel=4, prompt_cache=0)
    try:
        assert running.server.batcher is not None
        prompts = ["alpha", "beta", "gamma", "delta"]
        body = {"max_tokens": 24, "stream": True, **GREEDY}
        expected = {p: running.model.generate(p, max_tokens=24, temperature=0).text for p in prompts}
        assert stream_concurrently(running, prompts, body) == expected
        batcher = running.server.batcher
        assert batcher.stepped > batcher.steps, (batcher.stepped, batcher.steps)

        real, calls = tinyloop.Model.next_batch, []

        def failing(model, streams):
            results = real(model, streams)
            calls.append(1)
            if len(calls) == 3:
                results[0] = tinyloop.errors.TinyLoopError("injected failure")
            return results

        monkeypatch.setattr(tinyloop.Model, "next_batch", failing)
        status, payload = running.request("POST", "/v1/completions", {"prompt": "Hello", **body})
        assert status == 200
        last = json.loads([line for line in payload.decode().split("\n\n") if line][-1][6:])
        assert "injected failure" in last["error"]["message"]
        monkeypatch.setattr(tinyloop.Model, "next_batch", real)
        status, answer = running.post("/v1/completions", {"prompt": "alpha", "max_tokens": 24, **GREEDY})
        assert status == 200 and answer["choices"][0]["text"] == expected["alpha"]
    finally:
        running.close()
    single = Running(paths[0], parallel=1)
    off = Running(paths[0], parallel=2, batch_decode=False)
    try:
        assert single.server.batcher is None and off.server.batcher is None
    finally:
        single.close()
        off.close()


def test_client_leaving_mid_stream(server):
    body = json.dumps({"prompt": "x", "max_tokens": 80, "stream": True, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    # the server drops that generation and answers the next request
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200


# A shell running the tests in the background (`cmd &`) leaves SIGINT ignored, and an
# ignored SIGINT is inherited: Python then never turns Ctrl-C into KeyboardInterrupt. The
# child installs Python's own handler before running the CLI (in Python, not preexec_fn:
# threads are running here).
_CLI_WITH_DEFAULT_SIGINT = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                            "sys.argv[0] = 'tinyloop'; runpy.run_module('tinyloop', run_name='__main__')")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_cli_serve(paths, stop):
    """The server starts, answers, and stops cleanly on Ctrl-C or SIGTERM."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", _CLI_WITH_DEFAULT_SIGINT, "serve", str(paths[0]),
                             "--port", "0", "--threads", "1", "--name", "tiny", "--prompt-cache", "2"], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "tinyloop serve: tiny at http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the server outlived {stop.name} by 60 s; its stderr:\n{proc.communicate()[1][-4000:]}")
    assert proc.returncode == 0, proc.stderr.read()
    taken = subprocess.run([sys.executable, "-m", "tinyloop", "serve", str(paths[0]), "--port",
                            "99999"], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1 and "out of range" in taken.stderr


@pytest.mark.parametrize("raw,words", [
    (b'{"prompt": "x", "temperature": NaN}', "finite"),
    (b'{"prompt": "x", "top_p": Infinity}', "finite"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not valid JSON"),
    (b'{"prompt": "a\\ud800b"}', "not valid text"),
])
def test_odd_json_gets_an_answer(server, raw, words):
    status, body = server.request("POST", "/v1/completions", raw=raw)
    assert status == 400 and words in json.loads(body)["error"]["message"]


def test_chat_max_tokens_given_twice(chat_server):
    status, body = chat_server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": -5})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"


def test_prompt_filling_the_context_still_gives_one_token(server):
    ids = [65] * textmodel.MAX_SEQ_LEN
    status, body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 5, **GREEDY})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("headers", [b"Content-Length: abc\r\n", b"Content-Length: -4\r\n",
                                     b"Transfer-Encoding: chunked\r\n"])
def test_unread_body_ends_the_connection(server, headers):
    """The body after a refused header is never run as the next request."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + headers + b"\r\n" + smuggled)
        received = b""
        while chunk := s.recv(4096):
            received += chunk
    assert received.startswith((b"HTTP/1.1 400", b"HTTP/1.1 411")) and received.count(b"HTTP/1.1") == 1


def test_seeds_choose_the_sample(server):
    texts = {server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 12, "temperature": 1.0,
                                             "seed": seed})[1]["choices"][0]["text"] for seed in range(4)}
    assert len(texts) > 1


@pytest.fixture
def default_model_server():
    from tinyloop import default_model
    if not (default_model.MODELS_DIR / f"{default_model.DEFAULT_MODEL_NAME}.tinyloop").exists():
        pytest.skip("the trained default model is not in this installation (its long generations "
                    "are what these tests cancel)")
    running = Running(default_model.packaged_model_path(), parallel=1)
    yield running
    running.close()


def test_a_client_leaving_frees_its_slot(default_model_server):
    """A long plain (not streamed) generation whose client hangs up stops: the next request,
    waiting for the only slot, is answered soon after."""
    server = default_model_server
    body = json.dumps({"prompt": "The", "max_tokens": 1900, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
    started = time.monotonic()
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    assert time.monotonic() - started < 5


def test_closing_the_server_during_a_stream(default_model_server):
    """server_close() ends the running generation and waits for it, so the model can be
    closed right after (a stream still inside the library would crash the process)."""
    server = default_model_server
    got = []

    def reader():
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "The", "max_tokens": 1900, "stream": True, "temperature": 0}))
        response = conn.getresponse()
        try:
            while line := response.readline():
                got.append(line)
        except (http.client.IncompleteRead, ConnectionError):
            pass

    thread = threading.Thread(target=reader)
    thread.start()
    deadline = time.monotonic() + 20
    while len(got) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) >= 6
    started = time.monotonic()
    server.server.shutdown()
    server.server.server_close()
    assert time.monotonic() - started < 5
    server.model.close()
    thread.join(30)
    assert not any(b"[DONE]" in line for line in got)   # it was cut, not finished


def test_a_model_without_a_tokenizer_is_refused_at_start(tmp_path):
    # every answer is text: serving such a file would answer every request with a 500
    from tinyloop.fileformat.random_model import make_random_model
    from tinyloop.server.engine import Engine
    path = tmp_path / "no_tokenizer.tinyloop"
    make_random_model(path, seed=1, vocab_size=64, d_model=32, n_head=2, n_kv_head=1, head_dim=16, ffn_dim=64,
                      n_pre=1, n_core=1, n_post=0, default_depth=1, max_depth=2, max_seq_len=32)
    with tinyloop.Model(path, threads=1) as model:
        with pytest.raises(ValueError, match="cannot serve .*no tokenizer"):
            Engine(model, names="m")
