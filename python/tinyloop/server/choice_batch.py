"""The choices of one request (`n`, a list of prompts) generated together (docs/server.md,
"Choices and lists of prompts"): each choice has its own stream, context and options (its
seed), and the streams step together, so that each decode step of all the choices is one
forward pass (Model.next_batch, or a DecodeBatcher's, which adds other requests' streams).
A prompt is prefilled once, up to its last token, and the context is forked for each of
its choices; the last token then runs in each choice's own stream, since its logits start
that choice's generation. On the CPU the logits are the same bits as one generation after
another gives (a batched row, a forked sequence and a fresh prefill compute alike), so
every choice is the generation it would be alone. Under an exit rule (adaptive depth) each
choice's stream runs its whole prompt instead, since the rule applies to the prompt's
tokens too.

The caller reads the choices in order (run.chunks()); reading one steps every choice
still going and keeps the text of the others until they are read, so a client sees the
same events in the same order as when the choices ran one after another. At most
MAX_ROWS choices are under way at once; the next starts when one ends.
"""

from __future__ import annotations

from collections import deque

from ..errors import TinyLoopError
from ..text_generation import GenerationCancelled, TextGeneration, TextPipe

MAX_ROWS = 16   # choices stepped together at most (each holds a context)


def batchable(choices) -> bool:
    """Whether these choices gain from running together: several of them, each generating
    (max_tokens 0 only scores a prompt), and none drafting (a speculative round steps on
    its own, so drafting choices run one after another as before)."""
    return len(choices) > 1 and all(c.options["max_tokens"] > 0 and not c.options.get("draft_depth")
                                    for c in choices)


def _shares_prefill(choice) -> bool:
    """Whether the choice starts from its prompt's shared prefill: a prompt of more than
    one token, run at fixed depth. Under an exit rule the prompt's tokens exit too, which
    the prefill (Context.append) does not do: such a choice's stream runs its whole prompt."""
    rule = choice.options.get("exit")
    return len(choice.prompt_ids) > 1 and not (rule is not None and rule.active)


class BatchedChoice:
    """One choice of a ChoiceBatch: its record, logprob report and (piece, logprobs) chunks."""

    def __init__(self, batch, choice, record, report):
        self.choice, self.record, self.report = choice, record, report
        self.ok = False
        self._batch = batch
        self._pipe = TextPipe(batch.model.tokenizer, choice.stops, record, choice.prompt_ids)
        self._chunks = deque()   # (piece, logprobs) made and not read yet
        self.stream = self.context = None
        self.done = False
        self.error: BaseException | None = None

    def chunks(self):
        """The choice's text pieces, each with the log-probabilities of the tokens it brings
        (None when not asked), as generate_text and LogprobReport.take() give them; raises
        the choice's failure after its last piece."""
        while True:
            if self._chunks:
                yield self._chunks.popleft()
            elif self.done:
                if self.error is not None:
                    raise self.error
                return
            else:
                self._batch.step()

    def _emit(self, piece: str) -> None:
        if piece:
            self._chunks.append((piece, self.report.take()))

    def _took(self, value) -> None:
        """What a step gave the stream: a token, None at its end, or its failure."""
        if isinstance(value, BaseException):
            self._end(value)
        elif value is None:
            self._emit(self._pipe.end(self.stream.result))
            self._end()
        else:
            piece, stopped = self._pipe.push(value)
            self._emit(piece)
            if stopped:
                self._end()

    def _end(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error
        self._batch._release(self)


class ChoiceBatch:
    """Generate `choices` (GenerationRequest.choices(), in order) together. `report(choice,
    record)` makes each one's LogprobReport; `batcher` (a DecodeBatcher of the model) steps
    them with other generations; `cancelled()`, asked before every step, ends the batch
    with GenerationCancelled. close() (or the with-statement) frees what is left."""

    def __init__(self, model, choices, report, *, batcher=None, cancelled=None, max_rows: int = MAX_ROWS):
        self.model = model
        self._batcher = batcher
        self._step = batcher.next_batch if batcher is not None else model.next_batch
        self._cancelled = cancelled
        self._max_rows = max_rows
        self.runs = []
        for choice in choices:
            record = TextGeneration(prompt_tokens=len(choice.prompt_ids))
            self.runs.append(BatchedChoice(self, choice, record, report(choice, record)))
        self._pending = deque(self.runs)
        self._live: list[BatchedChoice] = []
        # per prompt: a context holding all its tokens but the last, and how many of its
        # choices have still to start from it
        self._prefixes: dict[int, list] = {}
        for choice in choices:
            if _shares_prefill(choice):
                self._prefixes.setdefault(choice.prompt_index, [None, 0])[1] += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self) -> None:
        """Start the choices there is room for, then one decode step of all that go on."""
        if self._cancelled is not None and self._cancelled():
            raise GenerationCancelled()
        while self._pending and len(self._live) < self._max_rows:
            self._start(self._pending.popleft())
        live = list(self._live)
        if not live:
            return
        values = self._step([run.stream for run in live])
        for run, value in zip(live, values):
            run._took(value)

    def _context(self, choice):
        """A context for the choice, holding its prompt but the last token when the prompt
        has more than one (a fork of the prompt's prefilled context), and the tokens the
        choice's stream has still to run."""
        ids = choice.prompt_ids
        # room for the prompt and max_tokens: the context's cache is no larger than needed
        size = min(self.model.info.max_seq_len, len(ids) + choice.options["max_tokens"])
        if not _shares_prefill(choice):
            return self.model.context(max_seq_len=size), ids
        entry = self._prefixes[choice.prompt_index]
        if entry[0] is None:
            base = self.model.context(max_seq_len=size)   # a request's choices share max_tokens
            try:
                base.append(ids[:-1], depth=choice.options.get("depth", 0))
            except BaseException:
                base.close()
                raise
            entry[0] = base
        entry[1] -= 1
        if entry[1] == 0:   # its last choice takes the prefilled context itself
            ctx, entry[0] = entry[0], None
            return ctx, ids[-1:]
        return entry[0].fork(), ids[-1:]

    def _start(self, run: BatchedChoice) -> None:
        try:
            run.context, rest = self._context(run.choice)
            run.stream = run.context.stream(rest, **run.choice.options)
        except TinyLoopError as e:
            run.done, run.error = True, e
            self._free(run)
            return
        run.record.logprobs, run.record.depths = run.stream.logprobs, run.stream.depths
        if self._batcher is not None:
            self._batcher.enter([run.stream])
        self._live.append(run)

    def _release(self, run: BatchedChoice) -> None:
        if run in self._live:
            self._live.remove(run)
        self._free(run)

    def _free(self, run: BatchedChoice) -> None:
        if run.stream is not None:
            if self._batcher is not None:
                self._batcher.leave(run.stream)
            run.stream.close()
        if run.context is not None:
            run.context.close()
        run.stream = run.context = None

    def close(self) -> None:
        for run in self.runs:
            self._free(run)
        self._live.clear()
        self._pending.clear()
        for entry in self._prefixes.values():
            if entry[0] is not None:
                entry[0].close()
                entry[0] = None
