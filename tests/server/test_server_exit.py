"""Adaptive depth in the server (docs/server.md, "Adaptive depth"): the `exit` field of
completions and chat, checked (a 400 naming it); each choice's `tinyloop` depths, one per
completion token, whole and streamed, equal to the Python API's; the server's default rule;
the library refusing a rule is a 400; /metrics' histogram of the depths used; kept
sequences serve only their own rule."""

import dataclasses
import json
import types

import pytest

import textmodel
import tinyloop
from serving import Running
from tinyloop.exit_rule import ExitRule
from tinyloop.prompt_cache import PromptCache
from tinyloop.server import ServerOptions, api
from tinyloop.server.api import RequestError

GREEDY = {"temperature": 0}
DEPTH = 2   # textmodel's default depth


def _check_depths(choice, completion_tokens):
    report = choice["tinyloop"]
    assert len(report["depths"]) == completion_tokens
    assert all(1 <= d <= textmodel.MAX_DEPTH for d in report["depths"])
    mean = sum(report["depths"]) / completion_tokens if completion_tokens else 0.0
    assert report["mean_depth"] == pytest.approx(mean)
    return report["depths"]


@pytest.mark.parametrize("rule", ["kl:1e-3", "latent_delta:0.05", {"rule": "argmax_stable", "patience": 2},
                                  {"rule": "entropy_delta", "threshold": 0.01, "min_depth": 2}])
def test_completion_reports_the_depths_of_its_tokens(server, rule):
    request = {"prompt": "Hello", "max_tokens": 8, "exit": rule, **GREEDY}
    status, body = server.post("/v1/completions", request)
    assert status == 200, body
    choice = body["choices"][0]
    depths = _check_depths(choice, body["usage"]["completion_tokens"])
    expected = server.model.generate("Hello", max_tokens=8, temperature=0, exit=rule)
    assert choice["text"] == expected.text and depths == expected.depths


def test_fixed_rule_reports_the_fixed_depth_and_no_rule_reports_nothing(server):
    request = {"prompt": "Hello", "max_tokens": 6, **GREEDY}
    status, body = server.post("/v1/completions", dict(request, exit="fixed"))
    assert status == 200
    assert _check_depths(body["choices"][0], 6) == [DEPTH] * 6
    deep = server.post("/v1/completions", dict(request, exit="fixed", depth=4))[1]
    assert deep["choices"][0]["tinyloop"] == {"depths": [4] * 6, "mean_depth": 4.0}
    plain = server.post("/v1/completions", request)[1]["choices"][0]
    assert "tinyloop" not in plain and plain["text"] == body["choices"][0]["text"]


def test_streamed_choice_ends_with_its_depths(server):
    request = {"prompt": "Once upon", "max_tokens": 7, "exit": "kl:1e-3", **GREEDY}
    whole = server.post("/v1/completions", request)[1]
    events = server.events("/v1/completions", dict(request, stream=True,
                                                   stream_options={"include_usage": True}))
    reports = [c["tinyloop"] for e in events for c in e["choices"] if "tinyloop" in c]
    assert len(reports) == 1 and events[-2]["choices"][0]["finish_reason"] is not None
    assert "tinyloop" in events[-2]["choices"][0]   # on the choice's last chunk
    assert reports[0] == whole["choices"][0]["tinyloop"]
    assert len(reports[0]["depths"]) == events[-1]["usage"]["completion_tokens"]


def test_every_choice_and_prompt_has_its_depths(server):
    request = {"prompt": ["Hi there", "Loop"], "n": 2, "max_tokens": 5, "exit": "kl:1e-3", **GREEDY}
    status, body = server.post("/v1/completions", request)
    assert status == 200, body
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        prompt = request["prompt"][choice["index"] // 2]
        expected = server.model.generate(prompt, max_tokens=5, temperature=0, exit="kl:1e-3")
        assert choice["text"] == expected.text
        assert _check_depths(choice, len(expected.tokens)) == expected.depths
    events = server.events("/v1/completions", dict(request, stream=True))
    streamed = {c["index"]: c["tinyloop"] for e in events for c in e["choices"] if "tinyloop" in c}
    assert streamed == {c["index"]: c["tinyloop"] for c in body["choices"]}


def test_chat_reports_depths(chat_server):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "exit": "kl:1e-3", **GREEDY}
    status, body = chat_server.post("/v1/chat/completions", request)
    assert status == 200, body
    _check_depths(body["choices"][0], body["usage"]["completion_tokens"])
    events = chat_server.events("/v1/chat/completions", dict(request, stream=True))
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert last[0]["tinyloop"] == body["choices"][0]["tinyloop"]


@pytest.mark.parametrize("rule, words", [
    ("kl", "exit.threshold: rule kl needs a threshold"),
    ("kl:-1", "exit.threshold"),
    ("gate:2", "exit.threshold"),
    ("nope:1", "exit.rule"),
    ({"rule": "kl", "threshold": "small"}, "exit.threshold"),
    ({"rule": "kl", "threshold": 1, "depth": 3}, "exit.depth: unknown key"),
    ({"threshold": 1}, "exit.rule: missing"),
    (3, "exit: must be a string"),
    (["kl", 1], "exit: must be a string"),
    ("gate:0.9", "no exit gate"),   # the text model has no gate
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_rules_are_a_400_naming_the_field(server, chat_server, rule, words, path):
    if path == "/v1/completions":
        running, body = server, {"prompt": "Hi", "max_tokens": 2}
    else:
        pytest.importorskip("jinja2")
        running, body = chat_server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, reply = running.post(path, dict(body, exit=rule))
    assert status == 400, reply
    assert reply["error"]["param"] == "exit" and words in reply["error"]["message"]


def test_an_exit_rule_excludes_drafts(server):
    status, reply = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "exit": "kl:1e-3",
                                                    "draft_depth": 1})
    assert status == 400 and reply["error"]["param"] == "exit" and "draft_depth" in reply["error"]["message"]
    # the fixed rule is no exit rule: drafts go on
    status, reply = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "exit": "fixed",
                                                    "draft_depth": 1, **GREEDY})
    assert status == 200, reply


def test_a_model_without_a_loop_refuses_early_exits(text_model):
    looped = types.SimpleNamespace(info=text_model.info, tokenizer=text_model.tokenizer)
    flat = types.SimpleNamespace(info=dataclasses.replace(text_model.info, n_core=0), tokenizer=text_model.tokenizer)
    body = {"prompt": "Hi", "exit": "kl:1e-3"}
    assert api.completion_request(body, looped, "tiny").options["exit"] == ExitRule("kl", 1e-3)
    with pytest.raises(RequestError) as info:
        api.completion_request(body, flat, "tiny")
    assert info.value.param == "exit" and info.value.status == 400 and "no loop" in info.value.message
    assert api.completion_request(dict(body, exit="fixed"), flat, "tiny").options["exit"] == ExitRule()


@pytest.mark.parametrize("error", [tinyloop.UnsupportedError, tinyloop.InvalidArgumentError])
@pytest.mark.parametrize("stream", [False, True])
def test_a_rule_the_library_refuses_is_a_400(paths, monkeypatch, error, stream):
    def refuse(self, model, context, prompt, options, pool=None):   # as tl_stream_start would
        if options.exit is not None:
            raise error("exit: this model cannot run rule kl")
        real(self, model, context, prompt, options, pool)

    real = tinyloop.model.TokenStream.__init__
    monkeypatch.setattr(tinyloop.model.TokenStream, "__init__", refuse)
    running = Running(paths[0])
    try:
        request = {"prompt": "Hi", "max_tokens": 3, "exit": "kl:1e-3", "stream": stream}
        status, payload = running.request("POST", "/v1/completions", request)
        assert status == 400, payload
        assert "cannot run rule kl" in json.loads(payload)["error"]["message"]
        del request["exit"]
        assert running.request("POST", "/v1/completions", request)[0] == 200
    finally:
        running.close()


def _depth_histogram(running) -> dict:
    """GET /metrics' tinyloop_generation_token_depth samples: {suffix or le: value}."""
    status, payload = running.request("GET", "/metrics")
    assert status == 200
    text = payload.decode()
    assert "# TYPE tinyloop_generation_token_depth histogram" in text
    out = {}
    for line in text.splitlines():
        if line.startswith("tinyloop_generation_token_depth_"):
            name, value = line.rsplit(" ", 1)
            key = name.split('le="')[1].rstrip('"}') if "_bucket" in name else name.rsplit("_", 1)[1]
            out[key] = float(value)
    return out


def test_metrics_count_the_depths_used(paths):
    running = Running(paths[0])
    try:
        assert _depth_histogram(running)["count"] == 0
        assert running.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5, **GREEDY})[0] == 200
        hist = _depth_histogram(running)
        # without a rule every token ran the default depth
        assert hist["count"] == 5 and hist["sum"] == 5 * DEPTH
        assert hist["1.0"] == 0 and hist["2.0"] == 5 and hist["+Inf"] == 5
        status, body = running.post("/v1/completions", {"prompt": "Hi", "max_tokens": 6, "exit": "kl:1e-3",
                                                        **GREEDY})
        assert status == 200
        hist = _depth_histogram(running)
        depths = body["choices"][0]["tinyloop"]["depths"]
        assert hist["count"] == 5 + len(depths) and hist["sum"] == 5 * DEPTH + sum(depths)
        buckets = [v for k, v in hist.items() if k not in ("sum", "count")]
        assert buckets == sorted(buckets), "buckets are cumulative"
    finally:
        running.close()


def test_the_servers_default_rule(paths):
    running = Running(paths[0], options=ServerOptions(exit=ExitRule.parse("kl:1e-3")))
    try:
        body = running.post("/v1/completions", {"prompt": "Hello", "max_tokens": 6, **GREEDY})[1]
        expected = running.model.generate("Hello", max_tokens=6, temperature=0, exit="kl:1e-3")
        assert _check_depths(body["choices"][0], 6) == expected.depths
        # a request's own rule wins
        body = running.post("/v1/completions", {"prompt": "Hello", "max_tokens": 6, "exit": "fixed", **GREEDY})[1]
        assert body["choices"][0]["tinyloop"]["depths"] == [DEPTH] * 6
        status, reply = running.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "draft_depth": 1})
        assert status == 400 and "default exit rule" in reply["error"]["message"]
    finally:
        running.close()


def test_kept_sequences_serve_only_their_own_rule(text_model):
    prompt = text_model.tokenizer.encode("Hello there")
    rule = ExitRule.parse("latent_delta:0.05")

    def turn(cache, depth, rule):
        """One request: (prompt tokens reused, the context it ran on)."""
        lease = cache.acquire(prompt, depth, rule)
        result = lease.context.generate(lease.rest, max_tokens=1, depth=depth, exit=rule, temperature=0)
        cache.release(lease, prompt + result.tokens)
        return lease.cached, lease.context

    cache = PromptCache(text_model, 1)
    try:
        assert turn(cache, 2, None)[0] == 0
        assert turn(cache, 1, None)[0] == 0
        kept = turn(cache, 2, None)                       # fixed depth: deepened as before
        assert kept[0] == len(prompt) - 1
        # a rule runs on no context that keeps loop states: another one, afresh
        cached, context = turn(cache, 2, rule)
        assert cached == 0 and context is not kept[1]
        assert turn(cache, 2, rule)[0] == len(prompt) - 1               # the same rule and depth
        assert turn(cache, 2, "latent_delta:0.05")[0] == len(prompt) - 1  # its string form
        assert turn(cache, 2, None)[0] == 0                             # another rule (none)
        assert turn(cache, 2, ExitRule())[0] == len(prompt) - 1         # the fixed rule is none
        assert turn(cache, 3, rule)[0] == 0
        assert turn(cache, 4, rule)[0] == 0                             # under a rule never deepened
        assert turn(cache, 4, ExitRule.parse("latent_delta:0.1"))[0] == 0
        # a rule that probes the next-token distribution reuses nothing
        for probing in ("kl:1e-3", "entropy_delta:0.01", "argmax_stable"):
            assert turn(cache, 2, probing)[0] == turn(cache, 2, probing)[0] == 0
    finally:
        cache.close()
