"""Stop strings matched on text (tinyloop.text_generation), with tokens of several
characters so that a stop string can start inside one token and end in another, and
streamed pieces must hold back what might become a stop string."""

from types import SimpleNamespace

import pytest

from tinyloop.text_generation import GenerationCancelled, TextGeneration, generate_text

PIECES = {0: "Hel", 1: "lo W", 2: "orld", 3: "!!", 4: " ok"}


class FakeStream:
    def __init__(self, tokens, reason):
        self._tokens, self.result, self._reason, self.closed = iter(tokens), None, reason, False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._tokens)
        except StopIteration:
            self.result = SimpleNamespace(stop_reason=self._reason)
            raise

    def close(self):
        self.closed = True


class FakeModel:
    """Just what generate_text uses: tokenizer.incremental_decoder() and stream()."""

    def __init__(self, tokens, reason="max_tokens"):
        self.tokens, self.reason, self.streams = tokens, reason, []
        decoder = SimpleNamespace(push=lambda t: PIECES[t], flush=lambda: "")
        self.tokenizer = SimpleNamespace(incremental_decoder=lambda context=(): decoder)

    def stream(self, prompt_ids, **options):
        self.streams.append(FakeStream(self.tokens, self.reason))
        return self.streams[-1]


def run(tokens, stops, reason="max_tokens"):
    model = FakeModel(tokens, reason)
    record = TextGeneration(prompt_tokens=3)
    pieces = list(generate_text(model, [1, 2, 3], stops, {}, record))
    assert model.streams[-1].closed
    return pieces, record


@pytest.mark.parametrize("stops,text,finish,used", [
    ([], "Hello World!! ok", "length", 5),
    (["o Wo"], "Hell", "stop", 3),           # starts in token 1, ends in token 2
    (["!"], "Hello World", "stop", 4),
    (["Hel"], "", "stop", 1),                # at the very start
    (["World", "lo"], "Hel", "stop", 2),     # the earliest of several
    ([" ok"], "Hello World!!", "stop", 5),   # in the last token
    (["xyz"], "Hello World!! ok", "length", 5),
])
def test_stop_strings(stops, text, finish, used):
    pieces, record = run([0, 1, 2, 3, 4], stops)
    assert "".join(pieces) == text
    assert record.finish_reason == finish and record.completion_tokens == used
    # nothing is sent that a later token could turn into a stop string
    sent = ""
    for piece in pieces:
        sent += piece
        assert not any(stop in sent for stop in stops)


def test_library_stop_reasons_map_to_finish_reasons():
    assert run([0, 1], [], reason="eos")[1].finish_reason == "stop"
    assert run([0, 1], [], reason="context_full")[1].finish_reason == "length"


def test_cancel_between_tokens_closes_the_stream():
    model = FakeModel([0, 1, 2, 3, 4])
    record = TextGeneration(prompt_tokens=3)
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(GenerationCancelled):
        list(generate_text(model, [1], [], {}, record, cancelled=cancelled))
    assert model.streams[-1].closed and record.completion_tokens == 2
