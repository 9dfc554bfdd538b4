"""The asyncio API (tinyloop.AsyncModel): the Model's generations as coroutines and async
streams, run in threads without blocking the event loop, and stopped by cancelling."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import textmodel
import tinyloop

GREEDY = dict(temperature=0, eos=False)


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


def _workers() -> list:
    """The worker threads still alive, given a moment to end after their last act."""
    deadline = time.monotonic() + 10
    while True:
        alive = [t for t in threading.enumerate() if t.name == "tinyloop-async"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def test_results_are_the_blocking_calls(shipped):
    async def main():
        model = tinyloop.AsyncModel(shipped)
        result = await model.generate("The capital of France is", max_tokens=8, **GREEDY)
        tokens = [t async for t in model.stream("The capital of France is", max_tokens=8, **GREEDY)]
        pieces = [p async for p in model.stream_text("The capital of France is", max_tokens=8, **GREEDY)]
        messages = [{"role": "user", "content": "Hi"}]
        reply = await model.chat(messages, max_tokens=6, temperature=0)
        chat_pieces = [p async for p in model.stream_chat(messages, max_tokens=6, temperature=0)]
        scored = await model.run(shipped.score, result.tokens)
        await model.aclose()
        return result, tokens, pieces, reply, chat_pieces, scored
    result, tokens, pieces, reply, chat_pieces, scored = _run(main())
    plain = shipped.generate("The capital of France is", max_tokens=8, **GREEDY)
    assert result.tokens == plain.tokens == tokens and result.text == plain.text == "".join(pieces)
    assert result.prompt_tokens == plain.prompt_tokens and result.depths == plain.depths
    blocking = shipped.chat([{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    assert reply.tokens == blocking.tokens and reply.text == blocking.text == "".join(chat_pieces)
    assert list(scored) == list(shipped.score(result.tokens))
    assert not shipped.closed   # a wrapped model stays the caller's


def test_the_loop_runs_while_generating(shipped):
    async def main():
        model = tinyloop.AsyncModel(shipped)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = time.monotonic()
        result = await model.generate("Once upon a time", max_tokens=48, **GREEDY)
        took = time.monotonic() - start
        task.cancel()
        return result, ticks, took
    result, ticks, took = _run(main())
    assert len(result.tokens) == 48
    # a blocked loop would have ticked at most once; on a loaded machine a tick may take
    # far longer than 2 ms, but several come within the generation's time
    assert ticks >= 5, (ticks, took)


def test_cancelling_a_stream_stops_its_generation(shipped):
    async def main():
        model = tinyloop.AsyncModel(shipped)
        stream = model.stream_text("Once upon a time", max_tokens=1500, **GREEDY)
        got = []

        async def consume():
            async for piece in stream:
                got.append(piece)
                if len(got) == 3:
                    await asyncio.sleep(3600)   # cancelled here
        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        await stream.aclose()   # waits for the worker, which stops at its next token
        waited = time.monotonic() - started
        rest = [p async for p in stream]   # what it had sent, then the end: no waiting
        assert len(rest) < 1500
        return stream, got, waited
    stream, got, waited = _run(main())
    assert len(got) == 3 and waited < 30
    assert 3 <= len(stream.tokens) < 1500 and stream.result is None
    assert not _workers()

    async def awaited_cancel():
        model = tinyloop.AsyncModel(shipped)
        task = asyncio.create_task(model.generate("Once upon a time", max_tokens=1500, **GREEDY))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        await model.aclose()   # joins the stopped worker
        return time.monotonic() - started
    assert _run(awaited_cancel()) < 30 and not _workers()


def test_breaking_out_and_closing(shipped):
    async def main():
        model = tinyloop.AsyncModel(shipped)
        async with model.stream("Once upon a time", max_tokens=1500, **GREEDY) as stream:
            async for _ in stream:
                break
        return len(stream.tokens)
    assert _run(main()) < 1500 and not _workers()


def test_errors_reach_the_awaiting_task(tmp_path):
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)

    async def main():
        async with await tinyloop.AsyncModel.load(path, threads=1) as model:
            assert model.info.vocab_size == textmodel.VOCAB
            with pytest.raises(ValueError, match="temperature"):
                await model.generate("x", temperature=-1)
            with pytest.raises(ValueError, match="temperature"):
                async for _ in model.stream_text("x", temperature=-1):
                    pass
            with pytest.raises(tinyloop.TinyLoopError, match="no chat template"):
                await model.chat([{"role": "user", "content": "Hi"}])
            # the context is full before max_tokens: the stream ends with its result
            async with model.stream("x" * 80, max_tokens=50, **GREEDY) as stream:
                tokens = [t async for t in stream]
            assert stream.result is not None and stream.result.stop_reason == "context_full"
            assert tokens == stream.tokens
            return model.model
    closed = _run(main())
    assert closed.closed   # the AsyncModel loaded it, so it closed it
    with pytest.raises(TypeError, match="open Model"):
        tinyloop.AsyncModel(closed, threads=2)
