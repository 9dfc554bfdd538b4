"""Sequences kept between requests, so that a request whose prompt starts like an earlier
one (a chat resent with one more turn, a fixed system prompt, a retry) continues that
sequence instead of prefilling from nothing: llama.cpp's `cache_prompt`, vLLM's prefix
caching, here on whole contexts (docs/server.md, "Prompt cache").

Exact by construction: a context truncated to the shared start and then extended gives
the logits of a fresh prefill of the whole prompt (the library's cached decode equals
full-sequence scoring), and a sequence kept at a shallower depth is first continued to
the request's depth with Context.deepen, which equals running it at that depth from the
start. So a cached request returns what an uncached one would, token for token, on the
CPU, whose logits are the same bits either way. On CUDA a kept sequence's answer tokens
were run one decode step at a time and an uncached request prefills them in chunks,
through other kernels: equal up to float rounding, so a near-tie may go the other way.
Not under an approximate KV policy (docs/model.md), whose results depend on where forward
calls split the sequence: its contexts keep no loop states and the reuse is approximate.

The cache keeps at most `capacity` contexts. A request takes the idle one sharing the
longest start with its prompt and gives it back when it ends, so no two requests ever
share a context. Below capacity, a request that would cut short or throw away the best
match's sequence gets a new context instead, leaving that sequence for a later turn of its
conversation; at capacity the best match is taken (the least recently used on a tie).
Contexts beyond capacity (made while every one was busy) are closed on return, the least
recently used first.

Under an exit rule (adaptive depth) that reads only the loop state (latent_delta, gate) each
token's depth depends on the tokens before it alone, so a sequence truncated and extended
under the same rule is the sequence a fresh run under it gives: a kept sequence serves
requests of its own exit rule and depth only (never deepened, and never one of another
rule). A rule that probes the next-token distribution (kl, entropy_delta, argmax_stable)
sees the probe K/V of the rows of its own forward call, so its depths depend on where the
calls split the sequence: its sequences are never reused (each request runs its whole
prompt). The library runs no exit rule on a context that keeps loop states (to deepen
them), so such requests get contexts that keep none.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import InvalidArgumentError, UnsupportedError
from .exit_rule import exit_rule


@dataclass
class CachedSequence:
    """A context and what it holds: its tokens and the loop depth they ran at."""

    context: object
    tokens: list = field(default_factory=list)
    depth: int = 0
    keeps_loop_states: bool = False
    #: the exit rule its tokens ran under (an active tinyloop.ExitRule), None: fixed depth
    exit: object = None


@dataclass
class Lease:
    """A context ready for one request: `rest` is the part of the prompt it still has to
    run (never empty: the last prompt token's logits start the generation), `cached` the
    number of prompt tokens it already holds."""

    sequence: CachedSequence
    rest: list
    cached: int

    @property
    def context(self):
        return self.sequence.context


def shared_start(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, model, capacity: int):
        if capacity < 1:
            raise ValueError(f"a prompt cache needs a capacity of at least 1, not {capacity}")
        self._model = model
        self._capacity = capacity
        self._idle: list[CachedSequence] = []   # least recently used first
        self._live = 0                          # contexts made and not closed
        self._lock = threading.Lock()

    def _reusable(self, seq: CachedSequence, prompt: list, depth: int, exit) -> int:
        """Prompt tokens `seq` can keep for a request at `depth` under the `exit` rule: its
        shared start with the prompt, less the prompt's last token; none when its depth is
        deeper (a loop state cannot be undone) or shallower without kept loop states, or
        when either runs an exit rule and the two differ in rule or depth, or the rule
        probes (module docstring)."""
        if not seq.tokens or seq.exit != exit or (exit is not None and exit.probes):
            return 0
        deepens = seq.keeps_loop_states and seq.depth < depth and exit is None
        if seq.depth != depth and not deepens:
            return 0
        return min(shared_start(seq.tokens, prompt), len(prompt) - 1)

    @staticmethod
    def _extends(seq: CachedSequence, prompt: list, keep: int) -> bool:
        """Whether a request may take `seq` while the cache has room for another context:
        when `seq` is empty, or the request reuses it and one of the two starts with the
        other (a longer prompt extends it; a prompt it already holds, a retry, cuts it
        back). Otherwise, when their tokens part somewhere or `seq` ran deeper, `seq`
        stays for a later turn of its conversation."""
        if not seq.tokens:
            return True
        return keep > 0 and shared_start(seq.tokens, prompt) == min(len(seq.tokens), len(prompt))

    def _new_sequence(self, exit) -> CachedSequence:
        if exit is not None:   # the library runs no exit rule on a context keeping loop states
            return CachedSequence(self._model.context())
        try:
            return CachedSequence(self._model.context(keep_loop_states=True), keeps_loop_states=True)
        except UnsupportedError:   # no loop, a warm state init or a shared KV: nothing to deepen
            return CachedSequence(self._model.context())

    def acquire(self, prompt, depth: int, exit=None) -> Lease:
        """A context for a request of `prompt` (token ids, at least one) at loop `depth`
        (resolved: not 0) under the `exit` rule (an ExitRule or its string or dict form;
        None or fixed: none), holding as much of the prompt as the cache has."""
        prompt = list(prompt)
        exit = exit_rule(exit)
        exit = exit if exit is not None and exit.active else None
        with self._lock:
            best, keep = None, 0
            for seq in self._idle:   # least recently used first: it wins a tie
                if exit is not None and seq.keeps_loop_states:
                    continue   # a context that keeps loop states cannot run the rule
                n = self._reusable(seq, prompt, depth, exit)
                if best is None or n > keep or (n == keep and seq.depth == depth != best.depth):
                    best, keep = seq, n
            if best is not None and (self._live >= self._capacity or self._extends(best, prompt, keep)):
                self._idle.remove(best)
            else:
                best, keep = None, 0
                self._live += 1
        if best is None:
            try:
                best = self._new_sequence(exit)
            except BaseException:
                with self._lock:
                    self._live -= 1
                raise
        try:
            if keep:
                try:
                    best.context.truncate(keep)
                except InvalidArgumentError:   # a cache window's ring no longer holds what the cut needs
                    keep = 0
            if keep == 0:
                best.context.reset()
                best.tokens = []
            else:
                best.tokens = best.tokens[:keep]
                if best.depth != depth:
                    best.context.deepen(depth)
            best.depth, best.exit = depth, exit
        except BaseException:
            self._discard(best)
            raise
        return Lease(best, prompt[keep:], keep)

    def _discard(self, seq: CachedSequence) -> None:
        seq.context.close()
        with self._lock:
            self._live -= 1

    def release(self, lease: Lease, tokens, ok: bool = True) -> None:
        """Give the context back. `tokens`: the prompt and every token generated after
        it; the context holds a prefix of them (a generation does not run its last token).
        After a failure (`ok` False) the context is emptied rather than trusted."""
        seq = lease.sequence
        try:
            if ok:
                tokens = list(tokens)
                held = len(seq.context)
                if held > len(tokens):   # ran a token the caller did not see: drop it
                    seq.context.truncate(len(tokens))
                    held = len(tokens)
                seq.tokens = tokens[:held]
            else:
                seq.context.reset()
                seq.tokens = []
        except BaseException:
            self._discard(seq)
            raise
        with self._lock:
            self._idle.append(seq)
            extra = []
            while self._live > self._capacity and self._idle:   # the least recently used go
                extra.append(self._idle.pop(0))
                self._live -= 1
        for old in extra:
            old.context.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for seq in idle:
            seq.context.close()
