"""Decode steps of concurrent generations taken together (continuous batching).

Each generation keeps its own thread and its own TokenStream; instead of stepping its
stream itself, a thread hands it to the batcher and waits. One worker thread takes every
stream waiting at that moment and steps them with one Model.next_batch call, whose plain
decode steps share one forward pass. A generation joins the batch at its next token and
leaves it when it ends, so requests that start and stop at different times still share
their steps.

So that the streams of a batch keep stepping together, the worker waits (at most
GATHER_S) for every active stream to be waiting before it steps: between two tokens a
thread decodes text and writes to its socket, and a worker that took only the first
thread back would step the streams in turn instead of together.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator

GATHER_S = 0.005   # longest wait for the other active streams before a step


class _Waiter:
    __slots__ = ("stream", "done", "value")

    def __init__(self, stream):
        self.stream = stream
        self.done = threading.Event()
        self.value = None


class DecodeBatcher:
    """Steps the streams of one model together; tokens(stream) is the stream's iterator."""

    def __init__(self, model, gather_s: float = GATHER_S):
        self._model = model
        self._gather_s = gather_s
        self._cond = threading.Condition()
        self._waiting: list[_Waiter] = []
        self._active: set[int] = set()   # ids of the streams between their first and last token
        self._closed = False
        self.steps = 0                   # next_batch calls, and the streams they stepped
        self.stepped = 0
        self._worker = threading.Thread(target=self._run, name="tinyloop-decode-batcher", daemon=True)
        self._worker.start()

    def tokens(self, stream) -> Iterator[int]:
        """The stream's tokens, each stepped in a batch; closing this generator (or the end
        of the stream) takes the stream out of the batch."""
        self.enter([stream])
        try:
            while True:
                token = self._next([stream])[0]
                if isinstance(token, BaseException):
                    raise token
                if token is None:
                    return
                yield token
        finally:
            self.leave(stream)

    def enter(self, streams) -> None:
        """These streams take part in the batches from now on: a step waits (at most
        GATHER_S) for them too."""
        with self._cond:
            self._active.update(id(stream) for stream in streams)

    def leave(self, stream) -> None:
        """The stream has ended (or is given up): steps no longer wait for it."""
        with self._cond:
            self._active.discard(id(stream))
            self._cond.notify_all()

    def next_batch(self, streams) -> list:
        """Model.next_batch of these streams (entered before) in one step of the worker,
        together with the other generations' streams waiting then: per stream its token,
        None at its end, or the exception it failed with."""
        return self._next(streams)

    def _next(self, streams) -> list:
        waiters = [_Waiter(stream) for stream in streams]
        with self._cond:
            if self._closed:
                raise RuntimeError("the decode batcher is closed")
            self._waiting.extend(waiters)
            self._cond.notify_all()
        for waiter in waiters:
            try:
                waiter.done.wait()
            finally:
                if not waiter.done.is_set():   # interrupted (KeyboardInterrupt, a signal handler)
                    for w in waiters:
                        self._withdraw(w)
        return [waiter.value for waiter in waiters]

    def _withdraw(self, waiter: _Waiter) -> None:
        """An interrupted wait: take the waiter back, or, when the worker is stepping its
        stream already, wait for that step to end, since the caller may free the stream
        next (the step's token is then dropped with it)."""
        with self._cond:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
                return
        while not waiter.done.is_set():
            try:
                waiter.done.wait()
            except BaseException:   # noqa: B036 - the stream must outlive the step; the first
                pass                # interruption propagates once it has ended

    def _take(self) -> list[_Waiter]:
        """The waiters of the next step, once every active stream waits or GATHER_S has
        passed since the first one; [] when closed with nothing waiting."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            deadline = time.monotonic() + self._gather_s
            while not self._closed and len(self._waiting) < len(self._active):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._waiting = self._waiting, []
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            try:
                results = self._model.next_batch([w.stream for w in batch])
            except BaseException as e:   # an argument error: every waiter gets it
                results = [e] * len(batch)
            self.steps += 1
            self.stepped += len(batch)
            for waiter, value in zip(batch, results):
                waiter.value = value
                waiter.done.set()

    def close(self) -> None:
        """Stop the worker once the streams waiting now are stepped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
