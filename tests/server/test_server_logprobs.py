"""Log-probabilities in the server's answers (docs/server.md, "Log-probabilities"):
completions' `logprobs` and `echo` (what evaluation harnesses send to score a text),
chat's `logprobs` / `top_logprobs`, streamed or whole, against the Python API's
scoring of the same tokens."""

import numpy as np
import pytest


GREEDY = {"temperature": 0}


def _generated(server, prompt, n):
    result = server.model.generate(prompt, max_tokens=n, temperature=0, logprobs=True, top_logprobs=3)
    return result, server.model.tokenizer.encode(prompt)


def test_completion_logprobs_are_the_tokens_scores(server):
    result, prompt_ids = _generated(server, "Hello", 8)
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "logprobs": 3,
                                                   **GREEDY})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == result.text
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(result.tokens)
    assert "".join(lp["tokens"]) == result.text
    full = prompt_ids + result.tokens
    scored = server.model.score(full)[len(prompt_ids) - 1:]
    assert np.allclose(lp["token_logprobs"], scored, atol=2e-5)
    for i, top in enumerate(lp["top_logprobs"]):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # logprobs 0: each token's own, no alternatives
    body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "logprobs": 0, **GREEDY})[1]
    assert [t == {} for t in body["choices"][0]["logprobs"]["top_logprobs"]] == [True] * 8
    assert body["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    # off: null, as before
    assert server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})[1]["choices"][0][
        "logprobs"] is None


def test_echo_scores_the_prompt(server):
    """echo + logprobs + max_tokens 0: the prompt's own log-probabilities, what lm-eval's
    loglikelihood requests ask for; with max_tokens > 0 the completion follows."""
    text = "The quick brown fox jumps"
    ids = server.model.tokenizer.encode(text)
    status, body = server.post("/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True,
                                                   "logprobs": 1, **GREEDY})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert np.allclose(lp["token_logprobs"][1:], server.model.score(ids), atol=1e-6)
    assert body["usage"]["completion_tokens"] == 0
    body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 2,
                                           **GREEDY})[1]
    choice = body["choices"][0]
    expected = server.model.generate(ids, max_tokens=4, temperature=0)
    assert choice["text"] == server.model.tokenizer.decode(ids) + server.model.tokenizer.decode(expected.tokens)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 4
    assert choice["logprobs"]["text_offset"][len(ids)] == len(server.model.tokenizer.decode(ids))
    # echo without logprobs: the text only
    body = server.post("/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True})[1]
    assert body["choices"][0]["text"] == text and body["choices"][0]["logprobs"] is None


def test_streamed_logprobs_cover_the_streamed_tokens(server):
    request = {"prompt": "Once upon", "max_tokens": 12, "logprobs": 2, **GREEDY}
    whole = server.post("/v1/completions", request)[1]["choices"][0]
    events = server.events("/v1/completions", dict(request, stream=True))
    tokens, logprobs = [], []
    for e in events:
        lp = e["choices"][0]["logprobs"]
        if lp is not None:
            tokens += lp["tokens"]
            logprobs += lp["token_logprobs"]
    assert tokens == whole["logprobs"]["tokens"] and logprobs == whole["logprobs"]["token_logprobs"]


def test_streamed_echo_of_a_prompt_without_text_keeps_its_logprobs(server):
    """A prompt whose text is empty (one BOS token) still echoes its token's entry when
    streamed, as the whole answer does."""
    bos = server.model.tokenizer.encode("x")[0]
    assert server.model.tokenizer.decode([bos]) == ""
    request = {"prompt": [bos], "max_tokens": 2, "echo": True, "logprobs": 2, **GREEDY}
    whole = server.post("/v1/completions", request)[1]["choices"][0]["logprobs"]
    assert whole["token_logprobs"][0] is None and len(whole["tokens"]) == 3
    streamed = {key: [] for key in whole}
    for e in server.events("/v1/completions", dict(request, stream=True)):
        lp = e["choices"][0]["logprobs"]
        for key in streamed:
            streamed[key] += lp[key] if lp else []
    assert streamed == whole


def test_stop_string_drops_the_tokens_after_it(server):
    text = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 20, **GREEDY})[1]["choices"][0]["text"]
    stop = text[4:6]
    body = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 20, "stop": stop, "logprobs": 1,
                                           **GREEDY})[1]
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text[:text.find(stop)]
    # every reported token starts before the stop string, the last one may run into it
    assert all(o < len(choice["text"]) or o == 0 for o in lp["text_offset"])
    assert "".join(lp["tokens"]).startswith(choice["text"])


def test_chat_logprobs(chat_server):
    pytest.importorskip("jinja2", reason="chat templates need jinja2 (pip install jinja2)")
    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "logprobs": True,
               "top_logprobs": 2, **GREEDY}
    status, body = chat_server.post("/v1/chat/completions", request)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    for c in content:
        assert bytes(c["bytes"]).decode() == c["token"]
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
    events = chat_server.events("/v1/chat/completions", dict(request, stream=True))
    streamed = [c for e in events if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    status, body = chat_server.post("/v1/chat/completions", dict(request, logprobs=False))
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    request.pop("top_logprobs")
    body = chat_server.post("/v1/chat/completions", request)[1]
    assert all(c["top_logprobs"] == [] for c in body["choices"][0]["logprobs"]["content"])


def test_partial_character_tokens_are_named_by_their_bytes(server):
    from tinyloop.server import api as server_api
    tokenizer = server.model.tokenizer
    for token in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token)
        text, got = server_api.token_text(tokenizer, token)
        assert got == raw
        try:
            assert text == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@pytest.mark.parametrize("decoder", ["metaspace", "llama"])
def test_sentencepiece_tokens_keep_their_leading_space(decoder):
    """With a SentencePiece-style tokenizer (a Metaspace decoder, or Llama's Replace /
    ByteFallback / Fuse / Strip) a word-initial token stands for " world", as OpenAI
    names it and as the text it is part of shows, not for "world" (what decoding it alone
    gives, the start of a text losing its space)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tinyloop.server import api as server_api
    from tinyloop.tokenizer import Tokenizer
    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "ly": 3, "<0x41>": 4}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    d = tokenizers.decoders
    hf.decoder = d.Metaspace() if decoder == "metaspace" else d.Sequence(
        [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(hf.to_str())
    assert tokenizer.decode([1, 2, 3]) == "Hello worldly"
    assert [tokenizer.token_bytes(t) for t in (1, 2, 3, 4)] == [b" Hello", b" world", b"ly", b"A"]
    assert server_api.token_text(tokenizer, 2) == (" world", b" world")


def test_byte_level_pieces_of_a_character():
    """The default model's byte-level tokenizer splits '☃' (e2 98 83) into pieces that
    are no text alone: each is named by its bytes, and the bytes join to the character."""
    import tinyloop
    from tinyloop.server import api as server_api
    with tinyloop.Model.default(threads=1) as model:
        tokenizer = model.tokenizer
        ids = tokenizer.encode(" ☃")
        names = [server_api.token_text(tokenizer, t)[0] for t in ids]
        assert b"".join(tokenizer.token_bytes(t) for t in ids) == " ☃".encode()
        assert any(name.startswith("bytes:\\x") for name in names), names


def test_penalties_and_logit_bias_are_the_python_apis(server):
    """presence_penalty, frequency_penalty and logit_bias reach the library as the
    Python API's options do (their exact effect: tests/lib/test_sampling.py)."""
    ids = server.model.tokenizer.encode("Hello")
    plain = server.model.generate(ids, max_tokens=10, temperature=0).tokens
    banned = plain[0]
    for fields, options in (({"presence_penalty": 1.5, "frequency_penalty": 0.5},
                             dict(presence_penalty=1.5, frequency_penalty=0.5)),
                            ({"logit_bias": {str(banned): -100}}, dict(logit_bias={banned: -100.0}))):
        expected = server.model.generate(ids, max_tokens=10, temperature=0, **options)
        body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 10, **fields, **GREEDY})[1]
        assert body["choices"][0]["text"] == server.model.tokenizer.decode(expected.tokens)
    assert banned not in expected.tokens
