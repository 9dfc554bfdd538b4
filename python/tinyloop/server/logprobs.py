"""The log-probabilities one server response reports (docs/server.md, "Log-probabilities"):
with echo the prompt's first, scored in one pass, then the generated tokens' as their
text goes out, in the endpoint's format (api.completion_logprobs / chat_logprobs).
"""

from __future__ import annotations

from ..model import TokenLogprob
from . import api


class LogprobReport:
    def __init__(self, model, request, record, chat: bool):
        self._tokenizer = model.tokenizer
        self._format = api.chat_logprobs if chat else api.completion_logprobs
        self._chat = chat
        self._record = record
        self.wanted = request.top_logprobs is not None
        # generated text follows the echoed prompt in a completion's text offsets
        self._base = len(request.prompt_text) if request.echo else 0
        self._taken = 0

    def _formatted(self, entries, offsets):
        if self._chat:
            return self._format(self._tokenizer, entries)
        return self._format(self._tokenizer, entries, offsets)

    def prompt(self, model, request):
        """The echoed prompt's entries: the first token has no log-probability (nothing
        predicts it); the others are scored at the request's depth. None when not asked."""
        if not (self.wanted and request.echo):
            return None
        ids, top = request.prompt_ids, request.top_logprobs
        depth = request.options.get("depth", 0)
        entries = [TokenLogprob(ids[0], None, ())]
        if len(ids) > 1:
            if top:
                logprobs, top_ids, top_lps = model.score_top_logprobs(ids, top, depth=depth)
                tops = [tuple(zip(map(int, i), map(float, lp))) for i, lp in zip(top_ids, top_lps)]
            else:
                logprobs, tops = model.score(ids, depth=depth), [()] * (len(ids) - 1)
            entries += [TokenLogprob(t, float(lp), top_i)
                        for t, lp, top_i in zip(ids[1:], logprobs, tops)]
        decoder, text, offsets = self._tokenizer.incremental_decoder(), "", []
        for t in ids:
            offsets.append(len(text))
            text += decoder.push(t)
        return self._formatted(entries, offsets)

    def empty(self):
        """A logprobs object of no tokens, in the endpoint's format."""
        return self._formatted([], [])

    def take(self):
        """The generated tokens' entries whose text has gone out since the last call (None
        when none did, or when log-probabilities were not asked for)."""
        record = self._record
        if not self.wanted or record.logprobs is None or record.sent_tokens <= self._taken:
            return None
        start, self._taken = self._taken, record.sent_tokens
        offsets = [self._base + o for o in record.text_offsets[start:self._taken]]
        return self._formatted(record.logprobs[start:self._taken], offsets)


def joined(parts: list, chat: bool):
    """One logprobs object from several (the echoed prompt's and the completion's)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}
