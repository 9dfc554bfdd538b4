"""Generation as text pieces with stop strings matched on the text, as OpenAI-style APIs
define them: the output ends before the first stop string and never contains it, however
the tokenizer happens to split it. While streaming, text that could still be the start of
a stop string is held back until the next token decides.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterator, Sequence

# library stop reasons -> OpenAI finish reasons
FINISH_REASONS = {"eos": "stop", "stop_sequence": "stop", "grammar": "stop", "max_tokens": "length",
                  "context_full": "length"}


@dataclass
class TextGeneration:
    """What a finished generation produced (set once iteration has ended)."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    #: prompt tokens a cached sequence already held (not run again)
    cached_tokens: int = 0
    #: the generated token ids, as far as the generation got
    token_ids: list = field(default_factory=list)
    #: where each generated token's text starts in the generated text (a token that ends
    #: inside a character starts where the token completing it does)
    text_offsets: list = field(default_factory=list)
    #: with the logprobs option: each generated token's TokenLogprob (model.py)
    logprobs: list | None = None
    #: the loop depth of the pass that chose each generated token (the stream's, as far as
    #: it got; it may run past completion_tokens); None when the stream reports none
    depths: list | None = field(default_factory=list)
    #: tokens whose text the pieces yielded so far cover: those before the first stop
    #: string, and while streaming those whose text has been sent whole
    sent_tokens: int = 0


class GenerationCancelled(Exception):
    """`cancelled()` said to stop between two tokens."""


class TextPipe:
    """One generation's tokens turned into text pieces, a token at a time: push() each
    token as it comes, end() once the stream has ended. Fills `record` as it goes. Used by
    generate_text and by callers that step several streams together (choice_batch.py).
    `context`: the tokens the generation follows (its prompt), whose end the text's
    decoding reads (Tokenizer.incremental_decoder)."""

    def __init__(self, tokenizer, stops: Sequence[str], record: TextGeneration, context: Sequence[int] = ()):
        self._decoder = tokenizer.incremental_decoder(context)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._record = record
        self._text, self._sent = "", 0
        self._ends = []   # the text's length after each token

    def push(self, token: int) -> tuple:
        """(the text piece this token lets out, or "", whether a stop string ended the
        text: the generation is then over and record.finish_reason is set)."""
        record, stops, longest = self._record, self._stops, self._longest
        record.completion_tokens += 1
        record.token_ids.append(token)
        record.text_offsets.append(len(self._text))
        self._text += self._decoder.push(token)
        text, sent = self._text, self._sent
        self._ends.append(len(text))
        # a stop string can only end in what this token added (plus its overlap)
        found = _first_stop(text, stops, max(0, sent - longest))
        if found is not None:
            record.finish_reason = "stop"
            record.sent_tokens = bisect_left(record.text_offsets, found)
            return (text[sent:found] if found > sent else ""), True
        safe = len(text) - (longest - 1 if longest else 0)
        if safe > sent:
            record.sent_tokens = bisect_left(self._ends, safe + 1)
            self._sent = safe
            return text[sent:safe], False
        return "", False

    def end(self, result) -> str:
        """The rest of the text once the stream has ended (`result`: its GenerateResult,
        None when it did not say); sets record.finish_reason."""
        record = self._record
        self._text += self._decoder.flush()
        text, sent = self._text, self._sent
        found = _first_stop(text, self._stops, max(0, sent - self._longest))
        end = len(text) if found is None else found
        record.sent_tokens = (len(record.token_ids) if found is None
                              else bisect_left(record.text_offsets, found))
        reason = result.stop_reason if result else "max_tokens"
        record.finish_reason = "stop" if found is not None else FINISH_REASONS.get(reason, "stop")
        return text[sent:end] if end > sent else ""


def generate_text(model, prompt_ids: Sequence[int], stops: Sequence[str], options: dict,
                  record: TextGeneration, cancelled=None, context=None, batcher=None) -> Iterator[str]:
    """Yield the new text in pieces; `record` is filled in when the generator ends (also
    when the consumer closes it early: the library stream is closed then). `cancelled`,
    when given, is asked after every token; True ends the generation with
    GenerationCancelled. With `context` the generation continues that context's sequence
    (`prompt_ids` are then the tokens after it). With `batcher` (a DecodeBatcher of the
    model) its decode steps are taken together with other generations'."""
    pipe = TextPipe(model.tokenizer, stops, record, prompt_ids)
    stream = (model if context is None else context).stream(prompt_ids, **options)
    record.logprobs = getattr(stream, "logprobs", None)
    record.depths = getattr(stream, "depths", None)
    tokens = batcher.tokens(stream) if batcher is not None else stream
    try:
        for token in tokens:
            if cancelled is not None and cancelled():
                raise GenerationCancelled()
            piece, stopped = pipe.push(token)
            if piece:
                yield piece
            if stopped:
                return
        piece = pipe.end(stream.result)
        if piece:
            yield piece
    finally:
        if tokens is not stream:
            tokens.close()   # out of the batch before the stream goes
        stream.close()


def _first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
