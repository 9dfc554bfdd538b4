"""The server's generations, run in worker threads (the library releases the GIL in C,
so `parallel` of them run at once): the model and what the requests share (prompt cache,
decode batcher, chat template, metrics), and a Job per generation request, which runs
its choices and gives its answer whole or as the events of a stream. Nothing here knows
HTTP: app.py hands a Job to a thread and carries what it gives to the client.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext

from ..chat_template import load_chat_template
from ..errors import ContextFullError, InvalidArgumentError, TinyLoopError, UnsupportedError
from ..prompt_cache import PromptCache
from ..text_generation import GenerationCancelled, TextGeneration, generate_text
from . import api, choice_batch, tools
from .api import RequestError
from .decode_batcher import DecodeBatcher
from .logprobs import LogprobReport, joined
from .metrics import ServerMetrics


class Engine:
    """One loaded model served to many requests."""

    def __init__(self, model, *, names, parallel: int = 1, prompt_cache: int | None = None,
                 batch_decode: bool | None = None, batch_choices: bool = True,
                 max_tokens_cap: int | None = None):
        # sequences kept between requests: by default one per slot; 0 = none
        kept = parallel if prompt_cache is None else prompt_cache
        if kept < 0:
            raise ValueError(f"prompt_cache is {kept}: the number of kept sequences, 0 = none")
        names = [names] if isinstance(names, str) else list(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError("the served model needs at least one non-empty name")
        try:   # every answer is text: a file without a tokenizer cannot be served
            model.tokenizer
        except TinyLoopError as e:
            raise ValueError(f"cannot serve {model.path}: {e}") from None
        self.model = model
        self.names = names
        self.parallel = parallel
        self.cache = PromptCache(model, kept) if kept > 0 else None
        # concurrent generations' decode steps in one forward pass; by default where that
        # pays: on the CPU with more than one slot (docs/server.md: on CUDA the shipped
        # model's 64 streams ran faster unbatched)
        if batch_decode is None:
            batch_decode = parallel > 1 and model.info.device_name.startswith("cpu")
        self.batcher = DecodeBatcher(model) if batch_decode else None
        # a request's choices generated together (choice_batch.py); False: one after another
        self.batch_choices = batch_choices
        self.max_tokens_cap = max_tokens_cap
        self.template = load_chat_template(model)
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        #: set by a hard stop: generations end at their next token, streams are cut
        self.stopping = threading.Event()
        #: set when a drain's time is over: generations end, streams get a last error event
        self.ending = threading.Event()
        self._busy = 0                     # jobs in worker threads
        self._idle = threading.Condition()

    @property
    def name(self) -> str:
        return self.names[0]

    def model_entry(self, name: str | None = None) -> dict:
        info = self.model.info
        return {"id": name or self.name, "object": "model", "created": self.created,
                "owned_by": "tinyloop", "max_model_len": info.max_seq_len,
                "default_depth": info.default_depth, "max_depth": info.max_depth}

    @contextmanager
    def busy(self):
        """A worker thread's use of the model (close() waits for every one to end)."""
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        """End the running generations at their next token and wait for them, then free
        the batcher and the kept sequences (the model may be closed afterwards)."""
        self.stopping.set()
        self.wait_idle()
        if self.batcher is not None:
            self.batcher.close()
        if self.cache is not None:
            self.cache.close()


class ClientGone(Exception):
    """The client went away: there is no one to answer."""


class Job:
    """One completions or chat request's generation. `gone` is set when the client
    leaves; `deadline` (time.monotonic()) ends it with a timeout error."""

    def __init__(self, engine: Engine, request, chat: bool, gone: threading.Event,
                 deadline: float | None = None):
        self.engine, self.request, self.chat = engine, request, chat
        self.gone, self.deadline = gone, deadline
        self.rid = api.new_id("chatcmpl" if chat else "cmpl")
        self.arrived = time.monotonic()
        self._first_seen = False
        self.records: list = []
        self._echoes: dict = {}   # the echoed prompts' logprobs, scored once per prompt
        name = request.model
        if chat:
            self.piece_chunk = lambda i, text, lp: api.chat_chunk(self.rid, name, {"content": text}, None, lp, i)
            self.last_chunk = lambda i, finish, lp=None, delta=None: api.chat_chunk(
                self.rid, name, delta or {}, finish, lp, i)
            self.first_chunk = lambda i: api.chat_chunk(self.rid, name, {"role": "assistant", "content": ""},
                                                        index=i)
        else:
            self.piece_chunk = lambda i, text, lp: api.completion_chunk(self.rid, name, text, None, lp, i)
            self.last_chunk = lambda i, finish, lp=None, delta=None: api.completion_chunk(
                self.rid, name, "", finish, lp, i)
            self.first_chunk = None

    # -- cancellation -----------------------------------------------------------------------
    def cancelled(self) -> bool:
        engine = self.engine
        return (self.gone.is_set() or engine.stopping.is_set() or engine.ending.is_set()
                or (self.deadline is not None and time.monotonic() > self.deadline))

    def _why(self) -> RequestError:
        """The error a cancelled generation answers with (ClientGone when no one listens)."""
        if self.gone.is_set():
            raise ClientGone()
        if self.deadline is not None and time.monotonic() > self.deadline:
            return RequestError(f"the request ran past its deadline of {self.deadline - self.arrived:.3g} s",
                                status=504, kind="server_error", code="timeout")
        return RequestError("the server is shutting down", status=503, kind="server_error",
                            code="server_shutdown")

    # -- usage and metrics ------------------------------------------------------------------
    def usage(self) -> dict:
        return api.usage(sum(len(ids) for ids, _ in self.request.prompts),
                         sum(r.completion_tokens for r in self.records),
                         sum(r.cached_tokens for r in self.records))

    def _answered(self) -> None:
        usage = self.usage()
        self.engine.metrics.generation(time.monotonic() - self.arrived, usage["prompt_tokens"],
                                       usage["completion_tokens"],
                                       usage["prompt_tokens_details"]["cached_tokens"],
                                       [r.finish_reason for r in self.records],
                                       [d for r in self.records for d in (r.depths or [])[:r.completion_tokens]])

    def _with_depths(self, choice: dict, record) -> dict:
        """The choice with its `tinyloop` depths, when the request has an exit rule."""
        if self.request.options.get("exit") is not None:
            report = api.depth_report(record)
            if report is not None:
                choice["tinyloop"] = report
        return choice

    def _pieces(self, run):
        """The run's (piece, logprobs) chunks, the request's first text piece timed."""
        for piece, logprobs in run.chunks():
            if piece and not self._first_seen:
                self._first_seen = True
                self.engine.metrics.first_piece(time.monotonic() - self.arrived)
            yield piece, logprobs

    def _echoed(self, run):
        p = run.choice.prompt_index
        if p not in self._echoes:
            self._echoes[p] = run.report.prompt(self.engine.model, run.choice)
        return (run.choice.prompt_text if run.choice.echo else ""), self._echoes[p]

    # -- the answer -------------------------------------------------------------------------
    def answer(self) -> dict:
        """The whole answer's body; RequestError for a refusal, a failure or a cancel."""
        engine, request = self.engine, self.request
        choices = request.choices()
        try:
            with engine.busy(), ExitStack() as stack:
                answers = []
                for start in self._runs(stack, choices):
                    with start() as run:
                        self.records.append(run.record)
                        echo_text, echo_logprobs = self._echoed(run)
                        parts = list(self._pieces(run))
                        text = echo_text + "".join(piece for piece, _ in parts)
                        logprobs = joined([echo_logprobs] + [lp for _, lp in parts] + [run.report.take()],
                                          self.chat)
                        if logprobs is None and run.report.wanted:
                            logprobs = run.report.empty()
                        answers.append((text, run.record.finish_reason, logprobs))
                        run.ok = True
        except TinyLoopError as e:
            raise library_error(e) from None
        except GenerationCancelled:
            raise self._why() from None
        if self.chat:
            answers = [tools.chat_message(request, text, finish, logprobs)
                       for text, finish, logprobs in answers]
            body = api.chat_body(self.rid, request.model, answers, self.usage())
        else:
            body = api.completion_body(self.rid, request.model, answers, self.usage())
        for choice, record in zip(body["choices"], self.records):
            self._with_depths(choice, record)
        self._answered()
        return body

    def events(self):
        """The stream's events (chunk objects, then "[DONE]"). A refusal before the first
        event raises RequestError (still a 4xx to the client); a library failure after it
        is the last event (no [DONE]); a drain's end or the deadline is an error event and
        [DONE]; a hard stop an error event alone."""
        engine, request = self.engine, self.request
        choices = request.choices()
        started = False
        try:
            with engine.busy(), ExitStack() as stack:
                for start in self._runs(stack, choices):
                    with start() as run:
                        self.records.append(run.record)
                        for event in self._stream(run, started):
                            started = True
                            yield event
                        if isinstance(event, dict) and "error" in event:
                            return
                        run.ok = True
        except TinyLoopError as e:
            if not started:
                raise library_error(e) from None
            yield {"error": library_error(e).body()["error"]}
            return
        except GenerationCancelled:
            error = self._why()
            if not started:
                raise error from None
            yield {"error": error.body()["error"]}
            if not engine.stopping.is_set():
                yield "[DONE]"
            return
        if request.include_usage:
            yield dict(self.last_chunk(0, None), choices=[], usage=self.usage())
        yield "[DONE]"
        self._answered()

    def _stream(self, run, started: bool):
        """One choice's events; a library failure after the stream started is its last.
        With tools the text is held and parsed once whole (tools.py)."""
        index, report = run.choice.index, run.report
        held = tools.held_text(self.request)
        text, sent = [], started
        try:
            # the first piece starts the library's stream: before the first event, its
            # refusals are still a 4xx
            echo_text, echo_logprobs = self._echoed(run)
            chunks = self._pieces(run)
            head = next(chunks, ("", None))
            sent = True
            if self.first_chunk:
                yield self.first_chunk(index)
            if echo_text or echo_logprobs:   # a prompt of no text still has its tokens
                yield self.piece_chunk(index, echo_text, echo_logprobs)
            for piece, logprobs in itertools.chain([head] if head[0] else [], chunks):
                if held:
                    text.append(piece)
                else:
                    yield self.piece_chunk(index, piece, logprobs)
        except TinyLoopError as e:
            if not sent:
                raise
            yield {"error": library_error(e).body()["error"]}
            return
        finish = run.record.finish_reason
        if held:
            message, finish, _ = tools.chat_message(self.request, "".join(text), finish, None, stream=True)
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            last = self.last_chunk(index, finish, report.take(), delta=delta)
        else:
            last = self.last_chunk(index, finish, report.take())
        self._with_depths(last["choices"][0], run.record)
        yield last

    # -- runs -------------------------------------------------------------------------------
    def _runs(self, stack, choices) -> list:
        """Per choice, in order, a callable giving the context manager of its run: the
        choices of a ChoiceBatch (freed when `stack` closes), or one generation after
        another (each started when its turn comes)."""
        engine, chat = self.engine, self.chat
        # the prompt cache serves single-choice requests; several choices start afresh
        use_cache = engine.cache is not None and len(choices) == 1
        if not (engine.batch_choices and choice_batch.batchable(choices)):
            return [lambda choice=choice: self._run(choice, use_cache) for choice in choices]
        batch = stack.enter_context(choice_batch.ChoiceBatch(
            engine.model, choices, lambda choice, record: LogprobReport(engine.model, choice, record, chat),
            batcher=engine.batcher, cancelled=self.cancelled))
        return [lambda run=run: nullcontext(run) for run in batch.runs]

    @contextmanager
    def _run(self, choice, use_cache):
        """One choice's generation (its pieces, record and logprob report), continuing a
        kept sequence when `use_cache`; the sequence is kept again afterwards, emptied
        unless the caller set `ok` (the generation went through)."""
        engine = self.engine
        record = TextGeneration(prompt_tokens=len(choice.prompt_ids))
        run = _ChoiceRun(choice, record, LogprobReport(engine.model, choice, record, self.chat))
        prompt, options, lease = choice.prompt_ids, choice.options, None
        if use_cache:
            # a kept sequence has one depth: name it, so that 0 cannot mean another
            options = dict(options, depth=options.get("depth") or engine.model.info.default_depth)
            try:
                lease = engine.cache.acquire(prompt, options["depth"], options.get("exit"))
            except TinyLoopError as e:
                raise library_error(e) from None
            prompt, record.cached_tokens = lease.rest, lease.cached
        if options["max_tokens"] > 0:
            run.pieces = generate_text(engine.model, prompt, choice.stops, options, record,
                                       cancelled=self.cancelled,
                                       context=lease.context if lease else None, batcher=engine.batcher)
        else:   # echo with max_tokens 0: the prompt alone
            run.pieces = _nothing_generated(record)
        try:
            yield run
        finally:
            run.pieces.close()
            if lease is not None:
                engine.cache.release(lease, choice.prompt_ids + record.token_ids, run.ok)


class _ChoiceRun:
    def __init__(self, choice, record, report):
        self.choice, self.record, self.report = choice, record, report
        self.pieces = None
        self.ok = False

    def chunks(self):
        """The text pieces, each with the log-probabilities of the tokens it brings."""
        for piece in self.pieces:
            yield piece, self.report.take()


def _nothing_generated(record):
    """The pieces of a request that generates nothing (max_tokens 0)."""
    record.finish_reason = "length"
    return
    yield


def library_error(error: TinyLoopError) -> RequestError:
    """A library refusal of the request (depth, drafts, context) as a 4xx; others 500."""
    if isinstance(error, (InvalidArgumentError, UnsupportedError)):
        return RequestError(str(error))
    if isinstance(error, ContextFullError):
        return RequestError(str(error), code="context_length_exceeded")
    return RequestError(str(error), status=500, kind="server_error")
