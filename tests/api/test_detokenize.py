"""Incremental detokenisation (tinyloop.tokenizer.IncrementalDecoder, and the text of
generations, streamed or whole): the text of tokens generated after a prompt is what
they add to the prompt's text, decode(prompt + continuation) after decode(prompt), as
Hugging Face's and vLLM's detokenisers give it. With SentencePiece-style tokenizers (a
Metaspace pre-tokenizer and decoder, either prepend_scheme, or Llama's Replace /
ByteFallback / Fuse / Strip decoder) a word-initial first token keeps its space, which
decoding the continuation alone drops; byte-level BPE, whose decoding is local, and
characters split over byte tokens stay right."""

import pytest

import textmodel
import tinyloop
from serving import Running
from tinyloop.tokenizer import Tokenizer

tokenizers = pytest.importorskip("tokenizers")
WORDS = ["Hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]


def sentencepiece_json(scheme: str) -> str:
    """A word-level SentencePiece-style vocabulary of textmodel.VOCAB tokens: '▁word'
    tokens, bare pieces that continue a word, byte-fallback tokens, <s> and </s>."""
    d, pre = tokenizers.decoders, tokenizers.pre_tokenizers
    vocab = {"<unk>": 0}
    for w in WORDS:
        vocab["\u2581" + w] = len(vocab)
        vocab[w.lower()] = len(vocab)
    vocab["\u2581"] = len(vocab)
    for b in range(0xE0, 0x100):   # byte fallback for a few lead and continuation bytes
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for b in range(0x80, 0xC0):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    while len(vocab) < textmodel.BOS:
        vocab[f"p{len(vocab)}"] = len(vocab)
    vocab["<s>"], vocab["</s>"] = textmodel.BOS, textmodel.EOS
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    if scheme == "llama":
        hf.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme="first")
        hf.decoder = d.Sequence([d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    else:
        hf.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        hf.decoder = d.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    hf.add_special_tokens(["<s>", "</s>"])
    return hf.to_str()


def reference(tokenizer, prompt, continuation) -> str:
    """What Hugging Face-style decoding gives for the continuation: the prompt's text
    taken off the text of the whole sequence."""
    whole, head = tokenizer.decode(prompt + continuation), tokenizer.decode(prompt)
    assert whole.startswith(head)
    return whole[len(head):]


def streamed(tokenizer, prompt, continuation) -> str:
    decoder = tokenizer.incremental_decoder(prompt)
    return "".join(decoder.push(t) for t in continuation) + decoder.flush()


@pytest.mark.parametrize("scheme", ["always", "first", "llama"])
def test_a_sentencepiece_continuation_keeps_its_first_space(scheme):
    tok = Tokenizer(sentencepiece_json(scheme), bos_id=textmodel.BOS, add_bos=True)
    v = tok._tok.token_to_id
    prompt = tok.encode("Hello world")
    assert [tok.token_to_str(t) for t in prompt] == ["<s>", "\u2581Hello", "\u2581world"]
    cases = [[v("\u2581the"), v("\u2581cat")],                   # word-initial first token
             [v("cat"), v("\u2581sat")],                          # a word continued
             [v("\u2581on"), v("<0xE2>"), v("<0x98>"), v("<0x83>"), v("\u2581a")],   # a split character
             [v("\u2581"), v("\u2581mat")]]
    for continuation in cases:
        expected = reference(tok, prompt, continuation)
        assert streamed(tok, prompt, continuation) == expected, continuation
        assert tok.decode_continuation(prompt, continuation) == expected
    assert reference(tok, prompt, cases[0]) == " the cat"
    # what decoding without the prompt gave: the first space lost
    decoder = tok.incremental_decoder()
    assert "".join(decoder.push(t) for t in cases[0]) == "the cat"
    # a prompt of BOS alone: the continuation starts the text, as HF's decode has it
    assert streamed(tok, [textmodel.BOS], cases[0]) == reference(tok, [textmodel.BOS], cases[0]) == "the cat"
    # a prompt ending inside a character: its bytes are not the continuation's text
    split = prompt + [v("<0xE2>")]
    assert streamed(tok, split, [v("\u2581dog")]) == " dog"


def test_byte_level_continuations_stay_right():
    tok = Tokenizer(textmodel.byte_level_tokenizer_json(), bos_id=textmodel.BOS, add_bos=True)
    prompt = tok.encode("Hello")
    for text in [" world", "world", " ☃ snow", "☃", "\n\tx"]:
        continuation = tok.encode(text, add_bos=False)
        assert streamed(tok, prompt, continuation) == reference(tok, prompt, continuation) == text
    # a character split between the prompt and the continuation (no text is the
    # continuation's then): its bytes decode as they did without the prompt
    snow = tok.encode("☃", add_bos=False)
    assert streamed(tok, prompt + snow[:1], snow[1:]) == tok.decode_continuation([], snow[1:]) == "\ufffd" * 2


@pytest.fixture(scope="module")
def metaspace_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("detok") / "metaspace.tinyloop"
    textmodel.make_text_model(path, tokenizer_json=sentencepiece_json("always"))
    return path


def test_generated_text_is_the_continuation_of_the_prompt(metaspace_model):
    """Model.generate / stream_text / generate_batch and the server, whole and streamed,
    give decode(prompt + tokens) after decode(prompt)."""
    running = Running(metaspace_model)
    try:
        model = running.model
        tok = model.tokenizer
        word_starts = 0
        for seed in range(6):
            prompt_text = "Hello world the"
            prompt = tok.encode(prompt_text)
            options = dict(max_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            result = model.generate(prompt_text, **options)
            expected = reference(tok, prompt, result.tokens)
            word_starts += expected.startswith(" ")
            assert result.text == expected
            assert "".join(model.stream_text(prompt_text, **options)) == expected
            assert model.generate_batch([prompt_text], **options)[0].text == expected
            body = {"prompt": prompt_text, "max_tokens": 8, "temperature": 1.0, "seed": seed}
            status, reply = running.post("/v1/completions", body)
            assert status == 200 and reply["choices"][0]["text"] == expected
            events = running.events("/v1/completions", dict(body, stream=True))
            assert "".join(c["text"] for e in events for c in e["choices"]) == expected
            echoed = running.post("/v1/completions", dict(body, echo=True))[1]["choices"][0]["text"]
            assert echoed == tok.decode(prompt + result.tokens)
        assert word_starts > 0   # some continuation began with a word-initial token
    finally:
        running.close()
