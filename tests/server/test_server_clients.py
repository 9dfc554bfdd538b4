"""The server through the official `openai` client: completions, chat and streams, tool
calling (constrained calls always valid JSON, the tool and developer roles, calls parsed
from text), embeddings (equal to the reference model's pooled head input) and the
errors the client maps to its exceptions."""

import json
import threading

import numpy as np
import pytest

import textmodel
import tinyloop
from tinyloop.server import ModelServer, ServerOptions, api, tools

openai = pytest.importorskip("openai")

KEY = "sk-clients"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("clients") / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=textmodel.CHATML, max_seq_len=2048)
    model = tinyloop.Model(path, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name=["tiny", "alias"], parallel=2,
                         options=ServerOptions(api_key=KEY))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield server, client, path
    server.shutdown()
    server.server_close()
    model.close()


def test_completions_chat_and_streams(served):
    server, client, _ = served
    assert [m.id for m in client.models.list()] == ["tiny", "alias"]
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    assert done.choices[0].text == server.model.generate("Hello", max_tokens=6, temperature=0).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="alias", messages=messages, max_tokens=5, temperature=0)
    assert chat.model == "alias" and chat.choices[0].message.role == "assistant"
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.choices]
    assert "".join(parts) == chat.choices[0].message.content
    # OpenAI fields without effect here pass, with a warning header
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2,
                                                           store=False, metadata={"run": "1"})
    assert "ignored fields: metadata, store" in raw.headers["warning"]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_required_tool_call_is_valid(served, parallel, seed):
    _, client, _ = served
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "The weather in Paris?"}], tools=WEATHER,
        tool_choice="required", parallel_tool_calls=parallel, max_tokens=400, temperature=1.0, seed=seed)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
        assert call.id.startswith("call_") and call.type == "function"


def test_a_named_tool_call_streams_and_the_conversation_goes_on(served):
    _, client, _ = served
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=WEATHER, tool_choice=named,
        max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the call and its result sent back: the assistant's tool_calls and a tool message
    follow = client.chat.completions.create(model="tiny", max_tokens=3, tools=WEATHER, tool_choice="none", messages=[
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}])
    assert follow.choices[0].finish_reason in ("stop", "length")


def test_bad_tools_are_400s(served):
    _, client, _ = served
    messages = [{"role": "user", "content": "x"}]
    for kwargs, param in (({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
                          ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": WEATHER, "tool_choice": "required", "response_format": {"type": "json_object"}},
                           "tool_choice")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **kwargs)
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "tool", "content": "x"}])


def test_calls_are_parsed_from_text():
    calling = tools.parse_tools({"tools": WEATHER})
    request = api.GenerationRequest([1], {}, tool_calling=calling)
    message, finish, _ = tools.chat_message(
        request, 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>', "stop", None)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": '{"zone": "CET"}'}
    message, finish, _ = tools.chat_message(request, '[{"name": "get_time", "arguments": {}}]', "stop", None)
    assert finish == "tool_calls"
    for text in ("plain words", '{"name": "unknown", "arguments": {}}', "<tool_call>{broken</tool_call>"):
        message, finish, _ = tools.chat_message(request, text, "stop", None)
        assert (message, finish) == ({"role": "assistant", "content": text}, "stop")


def test_a_template_that_reads_tools_gets_them(served):
    pytest.importorskip("jinja2")
    from tinyloop.chat_template import load_chat_template

    class Stub:   # a model of a template that renders `tools`
        class info:
            metadata = {"tokenizer.chat_template": "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                                                   "{% for m in messages %}{{ m.content }}{% endfor %}"}
        tokenizer = served[0].model.tokenizer

    render = load_chat_template(Stub)
    assert render.reads_tools
    assert render([{"role": "user", "content": "x"}], tools=WEATHER) == "[get_weather][get_time]x"


def test_embeddings_are_the_pooled_head_input(served):
    server, client, path = served
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from reference.model import ReferenceModel
    reference = ReferenceModel.from_file(path)
    texts = ["Hello there", "a loop"]
    answer = client.embeddings.create(model="tiny", input=texts)   # the client asks for base64
    assert answer.usage.prompt_tokens == sum(len(server.model.tokenizer.encode(t)) for t in texts)
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    head = reference.weights["output.weight" if "output.weight" in reference.weights else "embed.weight"]
    for text, got, got_float in zip(texts, answer.data, floats.data):
        ids = server.model.tokenizer.encode(text)
        # the head input recovered from the oracle's logits (the head has full column rank)
        rows = np.linalg.lstsq(head.astype(np.float64), reference.logits(ids).T, rcond=None)[0].T
        expected = rows.mean(axis=0)
        expected /= np.linalg.norm(expected)
        assert np.allclose(got.embedding, expected, atol=2e-4)
        assert np.allclose(got_float.embedding, got.embedding, atol=1e-6)
    deep = client.embeddings.create(model="tiny", input="Hello there", encoding_format="float",
                                    extra_body={"depth": 4, "normalize": False})
    raw = server.model.embed(server.model.tokenizer.encode("Hello there"), depth=4)
    assert np.allclose(deep.data[0].embedding, raw, atol=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="x", dimensions=7)


def test_errors_are_the_clients_exceptions(served):
    server, client, _ = served
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=9)
    assert caught.value.body["param"] == "temperature"
