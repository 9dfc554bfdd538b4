"""The server's /tokenize, /detokenize and /metrics: token ids equal the Python API's
tokenizer and the chat endpoint's prompt; bad bodies get a 4xx naming the field; the
Prometheus text parses, and its counters, gauges and histograms move by exactly what the
requests made."""

import re
import threading
import time

import pytest

import tinyloop
from serving import Running

GREEDY = {"temperature": 0}
SAMPLE_LINE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


@pytest.fixture(scope="module")
def chat_server(paths):
    running = Running(paths[1], parallel=2)
    yield running
    running.close()


@pytest.fixture()
def server(paths):  # a fresh one per test: the metrics start at zero
    running = Running(paths[0], parallel=1)
    yield running
    running.close()


def metrics(server) -> dict:
    """{(name, labels): value} of GET /metrics, every line checked against the format."""
    status, payload = server.request("GET", "/metrics")
    assert status == 200
    text = payload.decode()
    assert text.endswith("\n")
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge", "histogram")
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE_LINE.match(line)
        assert match, line
        name, labels, value = match.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or base in typed, f"{name} has no TYPE line"
        samples[(name, labels or "")] = float(value)
    return samples


# ------------------------------------------------------------------ tokenize / detokenize

def test_tokenize_matches_the_tokenizer_and_detokenize_inverts_it(server):
    text = "Hello there, looping world."
    tok = server.model.tokenizer
    status, body = server.post("/tokenize", {"prompt": text})
    assert status == 200, body
    ids = tok.encode(text, add_bos=None)
    assert body == {"count": len(ids), "max_model_len": server.model.info.max_seq_len, "tokens": ids,
                    "token_strs": None}
    status, body = server.post("/detokenize", {"tokens": ids})
    assert (status, body) == (200, {"prompt": tok.decode(ids)})
    assert body["prompt"].strip() == text


def test_tokenize_options(server):
    tok = server.model.tokenizer
    text = "one two"
    _, plain = server.post("/tokenize", {"prompt": text, "add_special_tokens": False,
                                         "return_token_strs": True, "model": "tiny"})
    assert plain["tokens"] == tok.encode(text, add_bos=False)
    assert plain["token_strs"] == [tok.token_bytes(t).decode("utf-8") for t in plain["tokens"]]
    _, ids = server.post("/tokenize", {"prompt": [3, 5, 7]})
    assert ids["tokens"] == [3, 5, 7] and ids["count"] == 3


def test_tokenize_messages_equals_the_chat_endpoints_prompt(chat_server):
    messages = [{"role": "user", "content": "What is a loop?"}]
    status, body = chat_server.post("/tokenize", {"messages": messages})
    assert status == 200, body
    _, chat = chat_server.post("/v1/chat/completions", dict(messages=messages, max_tokens=1, **GREEDY))
    assert body["count"] == chat["usage"]["prompt_tokens"]
    tok = chat_server.model.tokenizer
    assert tok.decode(body["tokens"], skip_special_tokens=False).endswith("<s>assistant\n")
    _, bare = chat_server.post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert body["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < body["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": [1, 10 ** 9]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "colour": 1}, "colour"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}]}, "messages"),   # no chat template
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_token_requests_name_their_field(server, path, body, param):
    status, answer = server.post(path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


def test_a_token_request_for_another_model_is_a_404(server):
    status, answer = server.post("/detokenize", {"model": "other", "tokens": [1]})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------ metrics

def test_metrics_count_what_the_requests_did(server):
    before = metrics(server)
    assert before[("tinyloop_generation_tokens_total", "")] == 0
    assert before[("tinyloop_requests_running", "")] == 0
    status, a = server.post("/v1/completions", dict(prompt="Once upon", max_tokens=5, **GREEDY))
    assert status == 200
    events = server.events("/v1/completions", dict(prompt="The loop", max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY))
    streamed = events[-1]["usage"]
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
    assert server.request("GET", "/nowhere")[0] == 404
    after = metrics(server)
    assert after[("tinyloop_prompt_tokens_total", "")] == a["usage"]["prompt_tokens"] + streamed["prompt_tokens"]
    assert after[("tinyloop_generation_tokens_total", "")] == \
        a["usage"]["completion_tokens"] + streamed["completion_tokens"] > 0
    assert after[("tinyloop_http_responses_total", '{route="/v1/completions",status="200"}')] == 2
    assert after[("tinyloop_http_responses_total", '{route="/v1/completions",status="400"}')] == 1
    assert after[("tinyloop_http_responses_total", '{route="other",status="404"}')] == 1
    assert after[("tinyloop_http_responses_total", '{route="/metrics",status="200"}')] == 1
    reasons = sum(v for (name, _), v in after.items() if name == "tinyloop_choices_finished_total")
    assert reasons == 2
    for hist in ("tinyloop_time_to_first_piece_seconds", "tinyloop_request_duration_seconds"):
        assert after[(f"{hist}_count", "")] == 2
        assert after[(f"{hist}_bucket", '{le="+Inf"}')] == 2
        buckets = [v for (labels, v) in sorted(((labels, v) for (name, labels), v in after.items()
                                                 if name == f"{hist}_bucket"), key=lambda lv: _le(lv[0]))]
        assert buckets == sorted(buckets), "buckets are cumulative"
        assert after[(f"{hist}_sum", "")] > 0
    assert after[("tinyloop_time_to_first_piece_seconds_sum", "")] <= \
        after[("tinyloop_request_duration_seconds_sum", "")]
    assert after[("tinyloop_memory_weights_bytes", "")] == server.model.memory_report()["weights_bytes"]


def _le(labels: str) -> float:
    value = labels.split('"')[1]
    return float("inf") if value == "+Inf" else float(value)


def test_metrics_show_requests_waiting_and_running(server):
    # the one slot held by a generation that waits on this test: a second request waits
    gate, entered = threading.Event(), threading.Event()
    original = server.server.metrics.first_piece

    def held(seconds):
        entered.set()
        gate.wait(30)
        original(seconds)

    server.server.metrics.first_piece = held
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        server.post("/v1/completions", dict(prompt="Hi", max_tokens=4, **GREEDY))[0])) for _ in range(2)]
    threads[0].start()
    assert entered.wait(30)
    threads[1].start()
    for _ in range(300):
        now = metrics(server)
        if now[("tinyloop_requests_waiting", "")] == 1:
            break
        time.sleep(0.01)
    assert now[("tinyloop_requests_running", "")] == 1 and now[("tinyloop_requests_waiting", "")] == 1
    gate.set()
    for t in threads:
        t.join(60)
    assert results == [200, 200]
    done = metrics(server)
    assert done[("tinyloop_requests_running", "")] == 0 and done[("tinyloop_requests_waiting", "")] == 0


def test_metrics_text_is_prometheus_exposition(server):
    status, payload = server.request("GET", "/metrics")
    text = payload.decode()
    assert status == 200
    for family in ("tinyloop_http_responses_total", "tinyloop_requests_waiting",
                   "tinyloop_time_to_first_piece_seconds"):
        assert f"# HELP {family} " in text and f"# TYPE {family} " in text
    samples = metrics(server)   # every sample line parses
    assert ("tinyloop_memory_kv_cache_bytes", "") in samples and ("tinyloop_requests_running", "") in samples


def test_the_histogram_buckets_are_cumulative_with_an_inf_bucket():
    from tinyloop.server.metrics import Histogram
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(v)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 5',
                            "x_sum 5.65", "x_count 5"]
    assert tinyloop   # the package imports with the server modules
