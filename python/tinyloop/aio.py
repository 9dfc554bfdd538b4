"""asyncio over the blocking Model API: AsyncModel runs each generation in a thread of its
own (the library releases the GIL in C, so the event loop keeps running) and hands its
tokens or text to the loop as they come. Cancelling an awaiting call or an async stream,
or closing the stream, stops the generation at its next token.

    async with tinyloop.AsyncModel("model.tinyloop", threads=2) as model:
        result = await model.generate("Once upon a time", max_tokens=32)
        async for piece in model.stream_text("The capital of France is"):
            print(piece, end="")
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import replace
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

from .model import (GenerateResult, IntArray, Model, ModelInfo, StrategyStream, TokenStream, _drained,
                    _text_stream)
from .tokenizer import Tokenizer

T = TypeVar("T")

# what the worker thread puts on a stream's queue
_ITEM, _END, _ERROR = 0, 1, 2


class _Workers:
    """The worker threads of one AsyncModel, with the event each stops at."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, threading.Event] = {}

    def start(self, work: Callable[[], None], stop: threading.Event) -> None:
        def run() -> None:
            try:
                work()
            finally:
                with self._lock:
                    self._running.pop(thread, None)
        thread = threading.Thread(target=run, name="tinyloop-async", daemon=True)
        with self._lock:
            self._running[thread] = stop
        thread.start()

    def stop_all(self) -> list[threading.Thread]:
        """Ask every running generation to stop; the threads to wait for."""
        with self._lock:
            for stop in self._running.values():
                stop.set()
            return list(self._running)


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> bool:
    """Run callback(*args) on the loop's thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
        return True
    except RuntimeError:
        return False


class _StreamState:
    """What a stream's worker thread shares with it (not the AsyncStream itself, which may
    then be collected, and stop its generation, while the worker runs)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.done = threading.Event()
        self.source: TokenStream | StrategyStream | None = None
        self.result: GenerateResult | None = None


def _stream_work(state: _StreamState, open_stream: Callable[[], tuple[Iterator[Any], TokenStream | StrategyStream]],
                 loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Any]]) -> None:
    try:
        items, state.source = open_stream()
        try:
            for item in items:
                if state.stop.is_set() or not _deliver(loop, queue.put_nowait, (_ITEM, item)):
                    break
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()   # a text generator closes its token stream
            state.source.close()
        if not state.stop.is_set():
            state.result = state.source.result
        # also after a stop: a later __anext__ ends instead of waiting
        _deliver(loop, queue.put_nowait, (_END, None))
    except BaseException as e:   # handed to the awaiting task
        _deliver(loop, queue.put_nowait, (_ERROR, e))
    finally:
        state.done.set()


class AsyncStream(Generic[T]):
    """An async iterator over one generation's token ids or text pieces, generated in a
    worker thread that starts at the first `__anext__`. Cancelling the task awaiting it,
    `aclose()`, `async with` ending or the stream being collected stop the generation at
    its next token (aclose() also waits for the worker to end). `result` holds the
    GenerateResult once the iteration has ended (None after a stop, or for a mode's own
    loop), `tokens` the token ids generated so far."""

    def __init__(self, workers: _Workers,
                 open_stream: Callable[[], tuple[Iterator[T], TokenStream | StrategyStream]]):
        self._workers = workers
        self._open = open_stream
        self._state = _StreamState()
        self._queue: asyncio.Queue[tuple[int, Any]] | None = None
        self._ended = False   # the worker's last word (its end or error) was taken

    @property
    def result(self) -> GenerateResult | None:
        return self._state.result

    @property
    def tokens(self) -> list[int]:
        source = self._state.source
        return list(source.tokens) if source is not None else []

    def __aiter__(self) -> "AsyncStream[T]":
        return self

    async def __anext__(self) -> T:
        state = self._state
        if self._queue is None:
            if state.stop.is_set():
                raise StopAsyncIteration
            loop, queue, start = asyncio.get_running_loop(), asyncio.Queue[tuple[int, Any]](), self._open
            self._queue = queue
            self._workers.start(lambda: _stream_work(state, start, loop, queue), state.stop)
        if self._ended:
            raise StopAsyncIteration
        try:
            kind, value = await self._queue.get()
        except asyncio.CancelledError:
            state.stop.set()
            raise
        if kind != _ITEM:
            state.stop.set()
            self._ended = True
            if kind == _ERROR:
                raise value
            raise StopAsyncIteration
        item: T = value
        return item

    async def aclose(self) -> None:
        """Stop the generation (at its next token) and wait until its thread has ended."""
        self._state.stop.set()
        if self._queue is not None and not self._state.done.is_set():
            await asyncio.to_thread(self._state.done.wait)

    async def __aenter__(self) -> "AsyncStream[T]":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        state = getattr(self, "_state", None)
        if state is not None:
            state.stop.set()


class AsyncModel:
    """A Model for asyncio code (servers, notebooks): the generation calls of Model as
    coroutines and async iterators, run in threads. `AsyncModel(path, **options)` loads
    the model (options of Model()); `AsyncModel(model)` wraps an open Model, which the
    caller keeps and closes. `model` is the Model underneath, for the other calls (or
    `await run(model.score, ids)`)."""

    def __init__(self, model: Model | str | os.PathLike[str], **options: Any):
        if isinstance(model, Model):
            if options:
                raise TypeError("options are for loading a model: not with an open Model")
            self.model, self._owned = model, False
        else:
            self.model, self._owned = Model(model, **options), True
        self._workers = _Workers()

    @classmethod
    async def load(cls, path: str | os.PathLike[str], **options: Any) -> "AsyncModel":
        """Load the model in a thread (a large file or verify_checksums takes a while)."""
        model = await asyncio.to_thread(Model, path, **options)
        wrapped = cls(model)
        wrapped._owned = True
        return wrapped

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    async def run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Any blocking call in a thread (not stopped by cancelling: it runs to its end)."""
        return await asyncio.to_thread(call, *args, **kwargs)

    async def generate(self, prompt: str | Sequence[int], **options: Any) -> GenerateResult:
        """Model.generate; cancelling stops the generation at its next token."""
        model = self.model

        def work(stop: threading.Event) -> GenerateResult | None:
            ids = model._prompt_ids(prompt)
            return self._drain(model.stream(ids, **options), prompt, ids, stop)
        return await self._finished(work)

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                   documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                   chat_template_kwargs: Mapping[str, Any] | None = None, **options: Any) -> GenerateResult:
        """Model.chat; cancelling stops the generation at its next token."""
        model = self.model

        def work(stop: threading.Event) -> GenerateResult | None:
            ids = model._chat_ids(messages, tools, documents, add_generation_prompt, chat_template_kwargs)
            result = self._drain(model.stream(ids, **options), ids, ids, stop)
            if result is None:
                return None
            return replace(result, text=model.tokenizer.decode_continuation(ids, result.tokens))
        return await self._finished(work)

    def stream(self, prompt: str | Sequence[int], **options: Any) -> AsyncStream[int]:
        """Model.stream as an async iterator of token ids."""
        def start() -> tuple[Iterator[int], TokenStream | StrategyStream]:
            stream = self.model.stream(prompt, **options)
            return stream, stream
        return AsyncStream(self._workers, start)

    def stream_text(self, prompt: str | Sequence[int], **options: Any) -> AsyncStream[str]:
        """Model.stream_text as an async iterator of text pieces."""
        return AsyncStream(self._workers, lambda: self._text(self.model._prompt_ids(prompt), options))

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                    documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncStream[str]:
        """Model.stream_chat as an async iterator of text pieces."""
        def start() -> tuple[Iterator[str], TokenStream | StrategyStream]:
            ids = self.model._chat_ids(messages, tools, documents, add_generation_prompt, chat_template_kwargs)
            return self._text(ids, options)
        return AsyncStream(self._workers, start)

    def _text(self, ids: Sequence[int] | IntArray, options: dict[str, Any]) -> tuple[Iterator[str], TokenStream | StrategyStream]:
        prompt = self.model._prompt_ids(ids)
        stream = self.model.stream(prompt, **options)
        return _text_stream(stream, self.model.tokenizer, prompt), stream

    def _drain(self, stream: TokenStream | StrategyStream, prompt: str | Sequence[int], ids: Any,
               stop: threading.Event) -> GenerateResult | None:
        """The stream run to its end as Model.generate's result; None once `stop` is set."""
        with stream:
            for _ in stream:
                if stop.is_set():
                    return None
        return _drained(stream, prompt, ids, self.model)

    async def _finished(self, work: Callable[[threading.Event], GenerateResult | None]) -> GenerateResult:
        """work(stop) in a worker thread, awaited; cancelling sets `stop`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult | None] = loop.create_future()
        stop = threading.Event()

        def settle(result: GenerateResult | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run() -> None:
            try:
                result = work(stop)
            except BaseException as e:
                _deliver(loop, settle, None, e)
            else:
                _deliver(loop, settle, result, None)
        self._workers.start(run, stop)
        try:
            result = await future
        except asyncio.CancelledError:
            stop.set()
            raise
        assert result is not None   # only a stop gives None, and only cancelling sets it
        return result

    async def aclose(self) -> None:
        """Stop the running generations, wait for their threads, then close the model
        when this AsyncModel loaded it."""
        for thread in self._workers.stop_all():
            await asyncio.to_thread(thread.join)
        if self._owned:
            self.model.close()

    async def __aenter__(self) -> "AsyncModel":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
