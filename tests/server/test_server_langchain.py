"""The server through LangChain's OpenAI integration (`langchain-openai`, in the test
extra and the `clients` extra): `ChatOpenAI` invoke, stream and `bind_tools` with a forced
call, and `OpenAIEmbeddings` on /v1/embeddings. Loopback only: a connection anywhere else
fails the test (tiktoken would fetch its BPE files on the first token count, so nothing
here counts tokens: `check_embedding_ctx_length=False` sends the texts as they are)."""

import json
import socket
import threading

import numpy as np
import pytest

import textmodel
import tinyloop
from tinyloop.server import ModelServer, ServerOptions

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed: the LangChain client path is NOT tested "
    "here (pip install -e '.[test]' or '.[clients]' to run it)")
from langchain_core.messages import AIMessageChunk  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

KEY = "sk-langchain"


class GetWeather(BaseModel):
    """The weather of a city for some days."""
    city: str = Field(json_schema_extra={"enum": ["Paris", "Rome"]})
    days: int = Field(ge=1, le=7)


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                             "parameters": {"type": "object", "properties": {
                                                 "zone": {"enum": ["UTC", "CET"]}},
                                                 "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Refuse every connection but one to the loopback (LangSmith, tiktoken's downloads)."""
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"a connection off the loopback: {address}")
        return connect(self, address)

    socket.socket.connect = guarded
    yield
    socket.socket.connect = connect


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("langchain") / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=textmodel.CHATML, max_seq_len=2048)
    model = tinyloop.Model(path, threads=1)
    server = ModelServer(("127.0.0.1", 0), model, name="tiny", parallel=2, options=ServerOptions(api_key=KEY))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    model.close()


def chat(server, **kwargs):
    # use_responses_api=False: the Chat Completions API, whatever the model name suggests
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="tiny",
                                       use_responses_api=False, max_retries=0, timeout=60, **kwargs)


def test_invoke_and_stream(served):
    llm = chat(served, temperature=0, max_tokens=6)
    answer = llm.invoke([("system", "Be brief."), ("human", "Hi")])
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.response_metadata["model_name"] == "tiny"
    assert answer.usage_metadata["output_tokens"] <= 6 and answer.usage_metadata["input_tokens"] > 0
    # stream_usage: ChatOpenAI asks for a stream's usage by default only from api.openai.com
    chunks = list(llm.stream([("system", "Be brief."), ("human", "Hi")], stream_usage=True))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == answer.content   # greedy: the same text
    whole = sum(chunks[1:], chunks[0])
    assert whole.usage_metadata["output_tokens"] == answer.usage_metadata["output_tokens"]


@pytest.mark.parametrize("choice", ["GetWeather", "any"])
def test_bind_tools_gives_a_valid_call(served, choice):
    # a named tool or "any" (OpenAI's "required"): the server's grammar makes the call valid
    llm = chat(served, temperature=1.0, max_tokens=300, seed=3).bind_tools(
        [GetWeather, GET_TIME], tool_choice=choice, parallel_tool_calls=False)
    answer = llm.invoke("The weather in Paris for three days?")
    assert answer.response_metadata["finish_reason"] == "tool_calls" and not answer.invalid_tool_calls
    assert len(answer.tool_calls) == 1
    call = answer.tool_calls[0]
    assert call["id"].startswith("call_") and call["type"] == "tool_call"
    if choice == "GetWeather" or call["name"] == "GetWeather":
        assert call["name"] == "GetWeather"
        GetWeather(**call["args"])   # the arguments validate against the schema
        assert call["args"]["city"] in ("Paris", "Rome") and 1 <= call["args"]["days"] <= 7
    else:
        assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")


def test_a_streamed_tool_call_and_the_tool_result(served):
    llm = chat(served, max_tokens=200, seed=1).bind_tools([GET_TIME], tool_choice="get_time")
    chunks = list(llm.stream("What time is it?"))
    whole = sum(chunks[1:], chunks[0])
    assert [c["name"] for c in whole.tool_calls] == ["get_time"]
    assert whole.tool_calls[0]["args"]["zone"] in ("UTC", "CET")
    # the call and its result sent back, as an agent loop does
    follow = chat(served, max_tokens=3).bind_tools([GET_TIME], tool_choice="none").invoke([
        ("human", "What time is it?"), whole,
        {"role": "tool", "tool_call_id": whole.tool_calls[0]["id"], "content": "12:00"}])
    assert follow.response_metadata["finish_reason"] in ("stop", "length") and not follow.tool_calls


def test_embeddings(served):
    embedder = langchain_openai.OpenAIEmbeddings(
        base_url=served.url + "/v1", api_key=KEY, model="tiny", check_embedding_ctx_length=False,
        max_retries=0, timeout=60)
    texts = ["Hello there", "a loop", "Hello there"]
    vectors = np.array(embedder.embed_documents(texts))
    assert vectors.shape == (3, served.model.info.d_model)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
    query = np.array(embedder.embed_query("Hello there"))
    expected = served.model.embed(served.model.tokenizer.encode("Hello there"))
    assert np.allclose(query, expected / np.linalg.norm(expected), atol=1e-5)
    assert json.dumps(embedder.embed_query("x"))   # plain floats
