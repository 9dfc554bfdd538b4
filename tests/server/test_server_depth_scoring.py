"""Tree speculation's request fields through the official `openai` client, min_p's range
named by the server, and the /tinyloop/score extension endpoint (logit lens and
consistency escalation) equal to the Python API's calls."""

import threading

import numpy as np
import pytest

import textmodel
import tinyloop
from tinyloop.server import ModelServer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("depth_scoring") / "plain.tinyloop"
    textmodel.make_text_model(path)
    model = tinyloop.Model(path, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name="tiny", parallel=1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield server, client, model
    server.shutdown()
    server.server_close()
    model.close()


def test_tree_speculation_fields_give_plain_greedy_tokens(served):
    _, client, model = served
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    tree = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"draft_depth": 1, "tree": [2, 1], "tree_budget": 3})
    assert tree.choices[0].text == plain.choices[0].text
    direct = model.generate("Hello", max_tokens=12, temperature=0.0, draft_depth=1, tree=(2, 1), tree_budget=3)
    assert direct.drafted_tokens > 0 and direct.text == plain.choices[0].text


@pytest.mark.parametrize("extra, param", [({"tree": [2, 1]}, "tree"),                    # no draft_depth
                                          ({"draft_depth": 1, "tree": [9]}, "tree"),
                                          ({"draft_depth": 1, "tree": []}, "tree"),
                                          ({"draft_depth": 1, "tree": [2], "tree_budget": 64}, "tree_budget"),
                                          ({"min_p": 1.0}, "min_p")])
def test_bad_fields_are_400s_naming_them(served, extra, param):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == param


def _score(server, body):
    return httpx.post(server.url + "/tinyloop/score", json=body, timeout=60)


def test_logit_lens_is_the_models(served):
    server, _, model = served
    answer = _score(server, {"method": "logit_lens", "input": "Hello", "max_depth": 3, "top_logprobs": 4})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "tinyloop.logit_lens" and body["model"] == "tiny"
    ids = model.tokenizer.encode("Hello")
    assert body["usage"]["prompt_tokens"] == len(ids)
    logits = model.score_logit_lens(ids, max_depth=3).astype(np.float64)
    assert [row["depth"] for row in body["depths"]] == [1, 2, 3]
    for row, depth_logits in zip(body["depths"], logits):
        logprobs = depth_logits - depth_logits.max()
        logprobs -= np.log(np.exp(logprobs).sum())
        best = np.argsort(-logprobs, kind="stable")[:4]
        assert [item["token"] for item in row["top_logprobs"]] == best.tolist()
        assert np.allclose([item["logprob"] for item in row["top_logprobs"]], logprobs[best], atol=1e-5)
        assert row["entropy"] == pytest.approx(float(-(np.exp(logprobs) * logprobs).sum()), abs=1e-5)
        assert all(isinstance(item["text"], str) for item in row["top_logprobs"])
    # token ids work as input, and max_depth 0 is the model's max_depth
    whole = _score(server, {"method": "logit_lens", "input": ids}).json()
    assert len(whole["depths"]) == model.info.max_depth


def test_consistency_escalation_is_the_models(served):
    server, _, model = served
    text = "the quick brown fox jumps over the lazy dog"
    answer = _score(server, {"method": "consistency_escalation", "input": text, "min_depth": 1,
                             "max_depth": 4, "max_changed": 0.1})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    logprobs, entropies, depth = model.score_with_consistency_escalation(
        model.tokenizer.encode(text), min_depth=1, max_depth=4, max_changed=0.1)
    assert body["object"] == "tinyloop.consistency_escalation" and body["depth"] == depth
    assert np.allclose(body["logprobs"], logprobs) and np.allclose(body["entropies"], entropies)
    assert body["perplexity"] == pytest.approx(float(np.exp(-np.mean(logprobs, dtype=np.float64))))


@pytest.mark.parametrize("body, param", [({"input": "Hi"}, "method"),
                                         ({"method": "lens", "input": "Hi"}, "method"),
                                         ({"method": "logit_lens"}, "input"),
                                         ({"method": "logit_lens", "input": "Hi", "min_depth": 2}, "min_depth"),
                                         ({"method": "logit_lens", "input": "Hi", "top_logprobs": 21},
                                          "top_logprobs"),
                                         ({"method": "consistency_escalation", "input": "Hi there",
                                           "top_logprobs": 2}, "top_logprobs"),
                                         ({"method": "consistency_escalation", "input": "Hi there",
                                           "min_depth": 4, "max_depth": 2}, "min_depth"),
                                         ({"method": "logit_lens", "input": "Hi", "depth": 2}, "depth")])
def test_bad_score_requests_are_400s_naming_the_field(served, body, param):
    answer = _score(served[0], body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
