"""Several choices (`n`) and lists of prompts in the server's answers (docs/server.md,
"Choices and lists of prompts"): each choice is the generation the Python API (or a
single-prompt request) gives, in OpenAI's order, whole or streamed, with its own
log-probabilities and echo; usage sums the choices; bad values are refused."""

import pytest


GREEDY = {"temperature": 0}
# the server's defaults of the sampler options the Python API defaults otherwise
SERVER_SAMPLING = dict(top_p=1.0, min_p=0.0, repetition_penalty=1.0)


def _strip_index(choice):
    return {key: value for key, value in choice.items() if key != "index"}


def _by_index(events, key="text"):
    """Streamed choices put together: index -> (text, finish_reason, logprob tokens)."""
    out = {}
    for e in events:
        for c in e["choices"]:
            text, finish, tokens = out.get(c["index"], ("", None, []))
            piece = c[key] if key == "text" else c["delta"].get("content", "")
            if c["logprobs"] is not None:
                tokens = tokens + c["logprobs"]["tokens"]
            out[c["index"]] = (text + piece, c["finish_reason"] or finish, tokens)
    return out


def test_sampled_choices_are_the_generations_of_consecutive_seeds(server):
    request = {"prompt": "Hi", "max_tokens": 10, "temperature": 1.0, "top_k": 20, "seed": 5, "n": 3}
    status, body = server.post("/v1/completions", request)
    assert status == 200, body
    expected = [server.model.generate("Hi", max_tokens=10, temperature=1.0, top_k=20, seed=5 + i,
                                      **SERVER_SAMPLING) for i in range(3)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [e.text for e in expected]
    assert len({e.text for e in expected}) > 1   # the seeds differ, and so do the samples
    n_prompt = len(server.model.tokenizer.encode("Hi"))
    usage = body["usage"]
    assert usage["prompt_tokens"] == n_prompt   # one prompt, counted once
    assert usage["completion_tokens"] == sum(len(e.tokens) for e in expected)
    assert usage["total_tokens"] == n_prompt + usage["completion_tokens"]
    # choice i is the single request with seed + i; best_of = n is accepted
    for i in range(3):
        single = server.post("/v1/completions", dict(request, n=1, seed=5 + i))[1]
        assert single["choices"][0]["text"] == body["choices"][i]["text"]
    assert server.post("/v1/completions", dict(request, best_of=3))[1]["choices"] == body["choices"]
    # without a seed each choice draws its own
    status, body = server.post("/v1/completions", dict(request, seed=None, n=4))
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


def test_greedy_choices_are_identical(server, chat_server):
    single = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, **GREEDY})[1]
    body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "n": 3, **GREEDY})[1]
    assert [_strip_index(c) for c in body["choices"]] == [_strip_index(single["choices"][0])] * 3
    assert body["usage"]["completion_tokens"] == 3 * single["usage"]["completion_tokens"]
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **GREEDY}
    single = chat_server.post("/v1/chat/completions", request)[1]["choices"][0]
    body = chat_server.post("/v1/chat/completions", dict(request, n=2))[1]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [_strip_index(c) for c in body["choices"]] == [_strip_index(single)] * 2
    events = chat_server.events("/v1/chat/completions", dict(request, n=2, stream=True))
    roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role")]
    assert roles == [0, 1]   # each choice's first chunk names the role
    streamed = _by_index(events, key="delta")
    assert {i: streamed[i][:2] for i in streamed} == {
        i: (single["message"]["content"], single["finish_reason"]) for i in (0, 1)}


def _prompts(server):
    return ["Hello", server.model.tokenizer.encode("Once upon"), "abc"]


def test_a_list_of_prompts_gives_each_prompts_own_completion(server):
    """Choices prompt-major (index = prompt * n + i), each the single-prompt request's
    answer, with its own logprobs and its own prompt echoed."""
    prompts = _prompts(server)
    request = {"max_tokens": 5, "logprobs": 2, "echo": True, **GREEDY}
    status, body = server.post("/v1/completions", dict(request, prompt=prompts, n=2))
    assert status == 200, body
    singles = [server.post("/v1/completions", dict(request, prompt=p))[1] for p in prompts]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for p, single in enumerate(singles):
        for i in range(2):
            assert _strip_index(body["choices"][p * 2 + i]) == _strip_index(single["choices"][0]), (p, i)
    # echo: each choice starts with its own prompt
    assert body["choices"][2]["text"].startswith(server.model.tokenizer.decode(prompts[1]))
    assert body["choices"][4]["text"].startswith("abc")
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0   # the prompt cache is bypassed
    # a sampled list: prompt p's choice i is that prompt's single request with seed + i
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 11}
    body = server.post("/v1/completions", dict(sampled, prompt=prompts[:2], n=2))[1]
    for p in range(2):
        for i in range(2):
            single = server.post("/v1/completions", dict(sampled, prompt=prompts[p], seed=11 + i))[1]
            assert body["choices"][p * 2 + i]["text"] == single["choices"][0]["text"]


def test_streamed_choices_reassemble_to_the_whole_answer(server):
    request = {"prompt": _prompts(server), "n": 2, "max_tokens": 7, "logprobs": 1, "echo": True,
               "temperature": 1.0, "seed": 3}
    whole = server.post("/v1/completions", request)[1]
    events = server.events("/v1/completions", dict(request, stream=True,
                                                   stream_options={"include_usage": True}))
    streamed = _by_index([e for e in events if e["choices"]])
    assert sorted(streamed) == list(range(6))
    for c in whole["choices"]:
        assert streamed[c["index"]] == (c["text"], c["finish_reason"], c["logprobs"]["tokens"])
    # each choice's last chunk carries its finish_reason; usage comes once, at the end
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == list(range(6))
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert sum("usage" in e for e in events) == 1


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "n": 17}, "n", "must be in"),
    ({"prompt": "x", "n": 1.5}, "n", "must be an integer"),
    ({"prompt": "x", "best_of": 3}, "best_of", "rank the choices by their log-probability"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of = 1 with n = 2"),
    ({"prompt": ["a", "b", [1, 2, 999]]}, "prompt[2]", "prompt[2] token 999 is out of range"),
    ({"prompt": ["a", "b", ""]}, "prompt[2]", "empty"),
    ({"prompt": ["a", 7]}, "prompt[1]", "must be a non-empty string or list of token ids"),
    ({"prompt": ["a", ["b"]]}, "prompt[1]", "must be a non-empty string or list of token ids"),
    ({"prompt": ["a", "x" * 200]}, "prompt[1]", "context"),
    ({"prompt": ["a"] * 33}, "prompt", "at most 32"),
    ({"prompt": []}, "prompt", "must be a non-empty string"),
])
def test_bad_choices_and_prompt_lists(server, body, param, words):
    status, reply = server.post("/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply


def test_bad_chat_choices(chat_server):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    messages = [{"role": "user", "content": "Hi"}]
    status, reply = chat_server.post("/v1/chat/completions", {"messages": messages, "n": 0})
    assert status == 400 and reply["error"]["param"] == "n"
    status, reply = chat_server.post("/v1/chat/completions", {"messages": messages, "best_of": 2})
    assert status == 400 and reply["error"]["param"] == "best_of"   # not a chat field


@pytest.mark.parametrize("batched", [True, False])
def test_a_refusal_before_the_stream_is_a_400_and_a_later_failure_its_last_event(paths, monkeypatch, batched):
    """Batched choices (a failure injected in a batched step) and choices run one after
    another (drafting ones: a failure injected in a stream's own step) alike."""
    import json

    import tinyloop
    from serving import Running
    running = Running(paths[0])
    try:
        request = {"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "stream": True, **GREEDY}
        status, reply = running.post("/v1/completions", dict(request, logprobs=1, draft_depth=1))
        assert status == 400 and "speculative" in reply["error"]["message"], reply
        calls = []
        if batched:
            real_batch = tinyloop.Model.next_batch

            def failing_batch(model, streams):   # choice 1 fails in the second step
                out = real_batch(model, streams)
                calls.append(1)
                if len(calls) == 2:
                    streams[1].close()
                    out[1] = tinyloop.errors.TinyLoopError("injected failure")
                return out

            monkeypatch.setattr(tinyloop.Model, "next_batch", failing_batch)
        else:
            request["draft_depth"] = 1
            real_next = tinyloop.model.TokenStream.__next__

            def failing_next(stream):   # fails in the second choice, after the first went out
                calls.append(1)
                if len(calls) == 7:
                    raise tinyloop.errors.TinyLoopError("injected failure")
                return real_next(stream)

            monkeypatch.setattr(tinyloop.model.TokenStream, "__next__", failing_next)
        status, payload = running.request("POST", "/v1/completions", request)
        assert status == 200
        lines = [line for line in payload.decode().split("\n\n") if line]
        assert "[DONE]" not in payload.decode()
        events = [json.loads(line[6:]) for line in lines]
        assert "injected failure" in events[-1]["error"]["message"]
        assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == [
            "length"]   # choice 0 ended, choice 1 did not
        assert {c["index"] for e in events[:-1] for c in e["choices"]} <= {0, 1}   # nothing after it
        assert running.server.cache._idle == []   # several choices bypass the prompt cache
    finally:
        running.close()
