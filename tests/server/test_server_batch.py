"""The choices of one request generated together (docs/server.md, "Choices and lists of
prompts"; tinyloop/choice_batch.py): a server whose choices step as one batch answers
exactly as one running them one after another (same seeds): every choice's text,
finish_reason, logprobs and the usage, whole or streamed, for greedy and sampled
requests with stops, logprobs, echo, penalties, logit_bias, grammars, depths, n up to 16
and lists of prompts, chat too; the steps are shared and each prompt is prefilled once;
refusals are unchanged."""

import pytest

import tinyloop
from serving import Running
from tinyloop.server import choice_batch

SAMPLED = {"temperature": 1.5, "top_k": 30, "seed": 17}
REQUESTS = {
    "greedy": {"prompt": "Hello", "max_tokens": 9, "temperature": 0, "n": 3},
    "sampled": {"prompt": "Once upon", "max_tokens": 12, "n": 4, **SAMPLED},
    "stops": {"prompt": "ab", "max_tokens": 20, "n": 5, "stop": ["bbb", "o"], **SAMPLED},
    "logprobs": {"prompt": "The", "max_tokens": 8, "n": 3, "logprobs": 3, **SAMPLED},
    "echo": {"prompt": "Hi there", "max_tokens": 6, "n": 2, "logprobs": 2, "echo": True, **SAMPLED},
    "penalties": {"prompt": "aaa", "max_tokens": 14, "n": 4, "presence_penalty": 1.5,
                  "frequency_penalty": 0.7, "repetition_penalty": 1.3, "logit_bias": {"97": 5, "98": -100},
                  **SAMPLED},
    "filters": {"prompt": "x", "max_tokens": 10, "n": 3, "top_p": 0.8, "min_p": 0.05, "temperature": 0.7,
                "seed": 2},
    "grammar": {"prompt": "Answer:", "max_tokens": 12, "n": 4, "grammar": 'root ::= ("yes" | "no" | "maybe") " ok"',
                **SAMPLED},
    "json": {"prompt": "{", "max_tokens": 16, "n": 3, "response_format": {"type": "json_object"}, **SAMPLED},
    "depths": {"prompt": "deep", "max_tokens": 7, "n": 3, "depth": 4, **SAMPLED},
    "shallow": {"prompt": "deep", "max_tokens": 7, "n": 2, "depth": 1, "temperature": 0},
    "sixteen": {"prompt": "Sixteen", "max_tokens": 6, "n": 16, **SAMPLED},
    "one token prompt": {"prompt": [65], "max_tokens": 5, "n": 3, **SAMPLED},
    # 5 prompts x 4 choices: more than MAX_ROWS, so choices start as others end
    "prompt list": {"prompt": ["a", "bb", [66, 67, 68], "dddd", "e"], "max_tokens": 8, "n": 4,
                    "logprobs": 1, **SAMPLED},
    "long": {"prompt": "x" * 60, "max_tokens": 60, "n": 2, **SAMPLED},   # ends with the context full
}


@pytest.fixture(scope="module")
def servers(paths):
    """Choices batched (alone, and through the decode batcher of a 2-slot server) and one
    after another."""
    running = {"batched": Running(paths[0]), "batcher": Running(paths[0], parallel=2),
               "sequential": Running(paths[0], batch_choices=False)}
    assert running["batcher"].server.batcher is not None and running["batched"].server.batcher is None
    yield running
    for r in running.values():
        r.close()


def _plain(body):
    """A response without what differs between two answers of one request (id, time)."""
    if isinstance(body, list):
        return [_plain(b) for b in body]
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _answers(servers, path, request):
    out = {}
    for name, running in servers.items():
        status, body = running.post(path, request)
        assert status == 200, (name, body)
        out[name] = _plain(body)
    return out


@pytest.mark.parametrize("name", list(REQUESTS))
def test_batched_choices_equal_the_sequential_ones(servers, name):
    request = REQUESTS[name]
    answers = _answers(servers, "/v1/completions", request)
    assert answers["batched"] == answers["sequential"]
    assert answers["batcher"] == answers["sequential"]
    choices = answers["sequential"]["choices"]
    prompt = request["prompt"]
    n_prompts = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else 1
    assert len(choices) == n_prompts * request["n"]
    if name == "long":   # ran until the context was full
        assert {c["finish_reason"] for c in choices} == {"length"}
        assert answers["sequential"]["usage"]["completion_tokens"] == 2 * (96 - 61 + 1)
    if name == "stops":
        assert any(c["finish_reason"] == "stop" for c in choices)   # a stop string was met
    if name in ("sampled", "sixteen", "prompt list"):
        assert len({c["text"] for c in choices}) > 1   # the seeds differ, so do the samples


@pytest.mark.parametrize("name", ["sampled", "stops", "logprobs", "echo", "prompt list"])
def test_streamed_batched_choices_send_the_sequential_events(servers, name):
    """The same events in the same order: a choice's chunks, its finish, then the next
    choice's; usage and [DONE] once at the end."""
    request = dict(REQUESTS[name], stream=True, stream_options={"include_usage": True})
    streamed = {key: _plain(r.events("/v1/completions", request)) for key, r in servers.items()}
    assert streamed["batched"] == streamed["sequential"]
    assert streamed["batcher"] == streamed["sequential"]
    indices = [c["index"] for e in streamed["batched"] for c in e["choices"]]
    assert indices == sorted(indices)   # one choice after another


def test_chat_choices(paths):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    batched, sequential = Running(paths[1]), Running(paths[1], batch_choices=False)
    try:
        request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "n": 3,
                   "logprobs": True, "top_logprobs": 2, "stop": ["q"], **SAMPLED}
        for extra in ({}, {"stream": True}):
            if extra:
                got = [_plain(r.events("/v1/chat/completions", dict(request, **extra)))
                       for r in (batched, sequential)]
            else:
                got = [_plain(r.post("/v1/chat/completions", request)[1]) for r in (batched, sequential)]
            assert got[0] == got[1]
    finally:
        batched.close()
        sequential.close()


def test_the_choices_share_their_steps_and_their_prompt(servers, monkeypatch):
    """n choices step as one batch of n streams, and a prompt runs once up to its last
    token (one context per prompt filled, the others forked from it)."""
    widths, appended, forks = [], [], []
    real_next, real_append, real_fork = tinyloop.Model.next_batch, tinyloop.Context.append, tinyloop.Context.fork

    def next_batch(model, streams):
        widths.append(len(streams))
        return real_next(model, streams)

    def append(ctx, tokens, depth=0):
        appended.append(len(tokens))
        return real_append(ctx, tokens, depth)

    def fork(ctx):
        forks.append(1)
        return real_fork(ctx)

    monkeypatch.setattr(tinyloop.Model, "next_batch", next_batch)
    monkeypatch.setattr(tinyloop.Context, "append", append)
    monkeypatch.setattr(tinyloop.Context, "fork", fork)
    request = {"prompt": ["Hello there", "abc"], "max_tokens": 6, "n": 8, "temperature": 0}
    status, body = servers["batched"].post("/v1/completions", request)
    assert status == 200
    assert max(widths) == choice_batch.MAX_ROWS == 16   # both prompts' 8 choices in one step
    assert len(widths) <= 6 + 1   # max_tokens steps and the one that ends them
    encode = servers["batched"].model.tokenizer.encode
    assert appended == [len(encode("Hello there")) - 1, len(encode("abc")) - 1]   # each prompt once
    assert len(forks) == 2 * 7
    # no context is left behind
    assert not any(isinstance(c, tinyloop.Context) and not c.closed
                   for c in list(servers["batched"].model._children))


def test_a_batch_through_the_decode_batcher_shares_its_steps(servers):
    batcher = servers["batcher"].server.batcher
    steps, stepped = batcher.steps, batcher.stepped
    status, _ = servers["batcher"].post("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "n": 4,
                                                            "temperature": 0})
    assert status == 200
    # 5 tokens and the call that ends the streams, all 4 streams each time
    assert batcher.stepped - stepped == 4 * 6 and batcher.steps - steps == 6


def test_requests_that_do_not_batch(servers):
    """Drafting choices and echo with max_tokens 0 run one after another, as before."""
    assert not choice_batch.batchable([])
    speculative = {"prompt": "Hello", "max_tokens": 6, "n": 2, "draft_depth": 1, **SAMPLED}
    scored = {"prompt": ["Hello", "yo"], "max_tokens": 0, "n": 2, "echo": True, "logprobs": 1}
    for request in (speculative, scored):
        answers = _answers(servers, "/v1/completions", request)
        assert answers["batched"] == answers["sequential"] == answers["batcher"]


@pytest.mark.parametrize("request_,param", [
    ({"prompt": "x", "n": 3, "logprobs": 1, "draft_depth": 1}, None),
    ({"prompt": ["a", "x" * 200], "n": 2}, "prompt[1]"),
    ({"prompt": "x", "n": 2, "depth": 99}, "depth"),
    ({"prompt": "x", "n": 2, "grammar": 'root ::= "a'}, "grammar"),
])
def test_refusals_are_unchanged(servers, request_, param):
    replies = {name: r.post("/v1/completions", request_) for name, r in servers.items()}
    assert replies["batched"] == replies["sequential"] == replies["batcher"]
    status, reply = replies["batched"]
    assert status == 400 and reply["error"]["param"] == param


def test_a_failure_at_the_start_of_a_later_choice_is_that_choices_error(servers, monkeypatch):
    """A choice whose stream cannot start fails where it would one after another: the
    whole answer is that error (after the choices before it ran)."""
    real_stream, calls = tinyloop.Context.stream, []

    def stream(ctx, prompt, **options):
        calls.append(1)
        if len(calls) == 3:
            raise tinyloop.errors.ContextFullError("injected: no room")
        return real_stream(ctx, prompt, **options)

    monkeypatch.setattr(tinyloop.Context, "stream", stream)
    status, reply = servers["batched"].post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 4,
                                                                 "temperature": 0})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "injected: no room" in reply["error"]["message"]


def test_a_client_leaving_ends_the_whole_batch(servers):
    """A client that hangs up mid-stream ends every choice of its batch at the next step:
    their streams leave the decode batcher and their contexts are freed."""
    import json
    import socket
    import time
    running = servers["batcher"]
    steps = running.server.batcher.steps
    body = json.dumps({"prompt": "x", "max_tokens": 80, "n": 4, "stream": True, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", running.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    batcher = running.server.batcher
    deadline = time.monotonic() + 10
    while batcher._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not batcher._active
    assert batcher.steps - steps < 60   # it stopped early (80 steps would have run to the end)
    assert not any(isinstance(c, tinyloop.Context) and not c.closed for c in list(running.model._children))
    assert running.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2})[0] == 200


def test_the_default_models_batched_choices_equal_the_sequential_ones():
    """The shipped model (q4 weights, byte-level BPE): the same texts, logprobs and usage."""
    from tinyloop import default_model
    path = default_model.MODELS_DIR / f"{default_model.DEFAULT_MODEL_NAME}.tinyloop"
    if not path.exists():
        pytest.skip("the trained default model is not in this installation")
    batched = Running(path)
    try:
        request = {"prompt": ["The capital of France is", "Once upon a time"], "max_tokens": 6, "n": 3,
                   "logprobs": 2, "temperature": 0.8, "seed": 4, "stop": ["\n"]}
        expected = [_plain(batched.post("/v1/completions", dict(request, prompt=p, n=1, seed=4 + i))[1])
                    for p in request["prompt"] for i in range(3)]   # single-choice requests
        got = _plain(batched.post("/v1/completions", request)[1])
        assert [dict(c, index=0) for c in got["choices"]] == [e["choices"][0] for e in expected]
        assert got["usage"]["completion_tokens"] == sum(e["usage"]["completion_tokens"] for e in expected)
    finally:
        batched.close()
