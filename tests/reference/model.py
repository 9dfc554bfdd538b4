"""The model family of docs/model.md as a plain float64 numpy program.

This is the oracle the backends are checked against: it reads a `.tinyloop` file with the
Python reader, dequantizes every weight to float64 and evaluates the forward pass formula
by formula. It never calls libtinyloop.
"""

import dataclasses

import numpy as np

from tinyloop.fileformat.tinyloop_file import read_file

from . import ops
from .config import ModelConfig
from .noise import seeded_normal, truncated_seeded_normal


class _KeyValueStore:
    """Keys (after RoPE) and values per cache slot, row p = position p.

    Exact caching gives every virtual layer its own slot. With `kv_ring` = N (docs/model.md,
    "Approximate KV policies"; N = 1 is share_last) loop iteration i of core block c uses
    slot (i - 1) mod N of that block, so a later iteration overwrites an earlier one's rows.
    A call writes its positions' rows of a slot, then attends to every row up to its last
    position: its own rows as just written, earlier positions' as last written."""

    def __init__(self, kv_ring=None):
        self._slots = {}
        self.kv_ring = kv_ring

    def positions(self, n_rows):
        """The position each of a slot's first n_rows rows holds (row p = position p)."""
        return np.arange(n_rows)

    def _slot(self, layer):
        if layer[0] == "core" and self.kv_ring is not None:
            _, iteration, block = layer
            return ("core", (iteration - 1) % self.kv_ring, block)
        return layer

    def read(self, layer, position):
        """The key and value rows of `position` in the layer's slot, as last written."""
        k, v = self._slots[self._slot(layer)]
        return k[position], v[position]

    def write(self, layer, positions, k, v):
        """Store rows `positions` of the layer's slot; return its rows 0..positions[-1]."""
        slot, rows = self._slot(layer), int(positions[-1]) + 1
        old_k, old_v = self._slots.get(slot, (k[:0], v[:0]))
        new_k = np.zeros((max(rows, len(old_k)),) + k.shape[1:])
        new_v = np.zeros((max(rows, len(old_v)),) + v.shape[1:])
        new_k[:len(old_k)], new_v[:len(old_v)] = old_k, old_v
        new_k[positions], new_v[positions] = k, v
        self._slots[slot] = (new_k, new_v)
        return new_k[:rows], new_v[:rows]


class _RingKeyValueStore(_KeyValueStore):
    """A cache window (docs/model.md, "Cache window"): each slot is a ring of `rows` rows,
    position p at row p mod rows, so a row is overwritten `rows` positions later. Every row
    remembers the position it holds; attention reads the whole ring and masks by those
    positions (never-written rows hold none and are never seen). A call must not overwrite
    a position that one of its rows still sees within `window`."""

    EMPTY = np.iinfo(np.int64).max   # a position after every query: masked as causal

    def __init__(self, rows, window, kv_ring=None):
        super().__init__(kv_ring)
        self.rows, self.window = int(rows), int(window)
        self._held = {}

    def read(self, layer, position):
        slot = self._slot(layer)
        assert self._held[slot][position % self.rows] == position, "position overwritten"
        k, v = self._slots[slot]
        return k[position % self.rows], v[position % self.rows]

    def write(self, layer, positions, k, v):
        slot = self._slot(layer)
        if slot not in self._slots:
            self._slots[slot] = (np.zeros((self.rows,) + k.shape[1:]), np.zeros((self.rows,) + v.shape[1:]))
            self._held[slot] = np.full(self.rows, self.EMPTY, dtype=np.int64)
        if int(positions[-1]) - int(positions[0]) + self.window > self.rows:
            raise ValueError(f"a call of {len(positions)} rows overwrites positions its rows see: the ring "
                             f"of {self.rows} rows holds a window of {self.window} and up to "
                             f"{self.rows - self.window + 1} new rows")
        new_k, new_v = self._slots[slot]
        rows = np.asarray(positions) % self.rows
        new_k[rows], new_v[rows] = k, v
        self._held[slot][rows] = positions
        self._last = slot
        return new_k, new_v

    def positions(self, n_rows):
        return self._held[self._last]


def _call_spans(n, calls):
    """[start, stop) of each forward call over n positions; calls = their lengths."""
    if calls is None:
        return [(0, n)]
    calls = [int(c) for c in calls]
    if any(c < 1 for c in calls) or sum(calls) != n:
        raise ValueError(f"calls {calls} must be positive lengths summing to {n}")
    stops = np.cumsum(calls)
    return list(zip(stops - calls, stops))


class ReferenceModel:
    """`int16_activations=True` also models the one approximation docs/model.md allows the
    CPU backend: activations multiplied by a quantized matrix are first rounded to int16
    per block of 32. Off (the default), the forward pass is exact."""

    def __init__(self, config: ModelConfig, weights: dict, quantized=frozenset(),
                 int16_activations: bool = False):
        self.config = config
        self.weights = weights
        self.quantized = frozenset(quantized)     # names of q8/q4/q2 tensors
        self.int16_activations = int16_activations

    @classmethod
    def from_file(cls, path, int16_activations: bool = False) -> "ReferenceModel":
        with read_file(path) as f:
            config = ModelConfig.from_header(f.dims, f.metadata)
            weights = {name: np.array(f.tensor(name), dtype=np.float64) for name in f.tensors}
            quantized = {name for name, entry in f.tensors.items() if entry.dtype in ("q8", "q4", "q2")}
        return cls(config, weights, quantized, int16_activations)

    def with_warm_start(self) -> "ReferenceModel":
        """This model with warm start chosen at run time (the state_init option): every
        position after the first starts its loop from the previous one's final state, the
        first as the file's init says."""
        cfg = self.config
        first = cfg.warm_first if cfg.state_init == "warm" else cfg.state_init
        return ReferenceModel(dataclasses.replace(cfg, state_init="warm", warm_first=first), self.weights,
                              self.quantized, self.int16_activations)

    # ------------------------------------------------------------------ public API

    def logits(self, tokens, depth: int = 0, kv_ring: int | None = None, calls=None,
               depths=None, cache_window: int | None = None, ring_rows: int | None = None) -> np.ndarray:
        """Logits [n, V] of every position of `tokens` at loop depth `depth` (0 = default).

        kv_ring = N: the approximate KV policy with N loop slots per core block (1 =
        share_last; None = exact); calls: the lengths of the forward calls the sequence
        went through (None = one call), on which such a policy's result depends.
        depths: each position's own depth, 1..depth (adaptive depth, docs/model.md
        "Adaptive depth"): position p leaves the loop after iteration depths[p], and its
        K/V of that iteration serves the iterations it skipped.
        cache_window = W: the K/V of the last positions kept in a ring of ring_rows rows
        per slot (default W + the longest call - 1), attention seeing the last W positions
        (the model's sliding window when narrower): exact for a model whose sliding
        window is at most W, the approximate window otherwise; the sequence may then be
        longer than max_seq_len."""
        return self._forward(tokens, depth, kv_ring, calls, depths=depths, cache_window=cache_window,
                             ring_rows=ring_rows)[0]

    def iteration_states(self, tokens, depth: int = 0, depths=None) -> np.ndarray:
        """Loop states [depth + 1, n, d]: the initial state, then s after each iteration
        (a position past its own depth keeps its last state)."""
        trace = []
        self._forward(tokens, depth, depths=depths, trace=trace)
        return np.concatenate(trace, axis=1)

    def final_states(self, tokens, depth: int = 0) -> np.ndarray:
        """Loop states s [n, d] after the last iteration (before the coda)."""
        return self._forward(tokens, depth)[1]

    def logprobs(self, tokens, depth: int = 0) -> np.ndarray:
        """log p(tokens[i+1] | tokens[:i+1]) for i = 0..n-2, as the C `tl_score` defines it."""
        return ops.next_token_logprobs(self.logits(tokens, depth), tokens)

    def exit_gate(self, tokens, depth: int = 0) -> np.ndarray:
        """lambda [n, depth]: sigmoid of the exit gate on the state after each iteration
        (docs/model.md, "Exit gate")."""
        if not self.config.exit_gate:
            raise ValueError("the model has no exit gate (loop.exit_gate)")
        gates = []
        self._forward(tokens, depth, gates=gates)
        return 1.0 / (1.0 + np.exp(-np.concatenate(gates, axis=0)))

    # ------------------------------------------------------------------ forward pass

    def _forward(self, tokens, depth, kv_ring=None, calls=None, gates=None, depths=None, trace=None,
                 cache_window=None, ring_rows=None):
        cfg = self.config
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0 or (tokens.size > cfg.max_seq_len and not cache_window):
            raise ValueError(f"need 1..{cfg.max_seq_len} tokens, got {tokens.size}")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in 0..{cfg.vocab_size - 1}")
        depth = cfg.resolve_depth(depth)
        if kv_ring is not None and (isinstance(kv_ring, bool) or int(kv_ring) < 1):
            raise ValueError(f"kv_ring must be >= 1 (or None: exact), got {kv_ring!r}")
        positions = np.arange(tokens.size)
        spans = _call_spans(tokens.size, calls)
        self._window = cfg.sliding_window
        if cache_window:
            self._window = min(cfg.sliding_window, cache_window) if cfg.sliding_window else cache_window
            longest = 1 if cfg.state_init == "warm" else max(stop - start for start, stop in spans)
            kv = _RingKeyValueStore(ring_rows or cache_window + longest - 1, self._window, kv_ring)
        else:
            kv = _KeyValueStore(kv_ring)
        if depths is None:
            depths = np.full(tokens.size, depth, dtype=np.int64)
        depths = np.asarray(depths, dtype=np.int64).reshape(-1)
        if cfg.n_core and (depths.size != tokens.size or depths.min() < 1 or depths.max() > depth):
            raise ValueError(f"depths must give each of {tokens.size} positions a depth in 1..{depth}")
        if cfg.state_init == "warm":
            # position p starts its loop from position p-1's final state: one at a time,
            # so under any KV policy each position is a call of its own
            spans = [(p, p + 1) for p in positions]
        logits, states, previous = [], [], None
        for start, stop in spans:
            span_gates = [] if gates is not None else None
            span_trace = [] if trace is not None else None
            lg, s = self._forward_span(tokens[start:stop], positions[start:stop], depth, kv, previous,
                                       span_gates, depths[start:stop], span_trace)
            if trace is not None:
                trace.append(np.stack(span_trace))
            if gates is not None:
                gates.append(np.stack(span_gates, axis=1) if span_gates else np.zeros((stop - start, 0)))
            logits.append(lg)
            states.append(s)
            previous = s[-1]
        return np.concatenate(logits), np.concatenate(states)

    def _forward_span(self, tokens, positions, depth, kv, previous_state, gates=None, depths=None,
                      trace=None):
        """Positions `positions` (one call: contiguous, after those already in `kv`) through
        the model."""
        cfg, w = self.config, self.weights
        h = w["embed.weight"][tokens] * cfg.embed_scale
        for b in range(cfg.n_pre):
            h = self._block(f"pre.{b}.", h, positions, kv, layer=("pre", b))
        e = h
        s = self._initial_state(e, positions, previous_state)
        if trace is not None:
            trace.append(s)
        if cfg.n_core:
            for i in range(1, depth + 1):
                # positions whose depth is reached keep their state, and their last
                # iteration's K/V stands in for this one's (docs/model.md, "Adaptive depth")
                done = depths < i
                fill = {r: ("core", int(depths[r])) for r in np.flatnonzero(done)}
                u = self._inject(s, e)
                for c in range(cfg.n_core):
                    u = self._block(f"core.{c}.", u, positions, kv, layer=("core", i, c), fill=fill)
                u = self._norm("loop_norm", u) if cfg.loop_norm else u
                s = np.where(done[:, None], s, u)
                if trace is not None:
                    trace.append(s)
                if gates is not None:
                    gates.append(self._linear("exit_gate.weight", s)[:, 0] + w["exit_gate.bias"][0])
        final_state = s
        if cfg.post_norm:
            s = self._norm("post_loop_norm", s)
        for b in range(cfg.n_post):
            s = self._block(f"post.{b}.", s, positions, kv, layer=("post", b))
        head = "embed.weight" if cfg.tied_embeddings else "output.weight"
        return self._linear(head, self._norm("final_norm", s) if cfg.final_norm else s), final_state

    # ------------------------------------------------------------------ loop pieces

    def _initial_state(self, e, positions, previous_state, kind=None):
        cfg = self.config
        kind = kind or cfg.state_init
        if kind == "prelude":
            return e
        if kind == "zeros":
            return np.zeros_like(e)
        if kind == "noise" and cfg.noise_truncation > 0:
            return cfg.noise_sigma * np.stack(
                [truncated_seeded_normal(cfg.noise_seed, int(p), cfg.d_model, cfg.noise_truncation)
                 for p in positions])
        if kind == "noise":
            return cfg.noise_sigma * np.stack(
                [seeded_normal(cfg.noise_seed, int(p), cfg.d_model) for p in positions])
        if kind == "warm":
            # position 0 has no previous state and starts like `warm_first`
            if previous_state is None:
                return self._initial_state(e, positions, None, cfg.warm_first)
            return previous_state[None, :].copy()
        raise ValueError(f"unknown state init {kind!r}")

    def _inject(self, s, e):
        cfg, w = self.config, self.weights
        if cfg.injection == "none":
            return s
        if cfg.injection == "add":
            return s + e
        if cfg.injection == "concat":
            u = self._linear("inject.weight", np.concatenate([s, e], axis=-1))
            return u + w["inject.bias"] if cfg.injection_bias else u
        raise ValueError(f"unknown injection {cfg.injection!r}")

    # ------------------------------------------------------------------ block pieces

    def _norm(self, name, x):
        cfg, w = self.config, self.weights
        if cfg.norm_type == "rmsnorm":
            return ops.rmsnorm(x, w[f"{name}.weight"], cfg.norm_eps, bool(cfg.norm_unit_offset))
        if cfg.norm_type == "layernorm":
            return ops.layernorm(x, w[f"{name}.weight"], w[f"{name}.bias"], cfg.norm_eps)
        raise ValueError(f"unknown norm type {cfg.norm_type!r}")

    def _block(self, prefix, x, positions, kv, layer, fill=None):
        placement = self.config.norm_placement

        def attn(n):
            return self._attention(prefix, n, positions, kv, layer, fill)

        def norm(name, v):
            return self._norm(prefix + name, v)

        if placement == "pre":
            x = x + attn(norm("attn_norm", x))
            return x + self._mlp(prefix, norm("mlp_norm", x))
        if placement == "sandwich_outer":
            x = norm("attn_post_norm", x + attn(norm("attn_norm", x)))
            return norm("mlp_post_norm", x + self._mlp(prefix, norm("mlp_norm", x)))
        if placement == "sandwich_branch":
            x = x + norm("attn_post_norm", attn(norm("attn_norm", x)))
            return x + norm("mlp_post_norm", self._mlp(prefix, norm("mlp_norm", x)))
        raise ValueError(f"unknown norm placement {placement!r}")

    def _linear(self, weight_name, x):
        """y = W x for each row of x."""
        if self.int16_activations and weight_name in self.quantized:
            x = ops.int16_blocks(x)
        return x @ self.weights[weight_name].T

    def _projection(self, name, n):
        y = self._linear(f"{name}.weight", n)
        bias = self.weights.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _attention(self, prefix, n, positions, kv, layer, fill=None):
        cfg = self.config
        rows = n.shape[0]
        q = self._projection(prefix + "attn.q", n).reshape(rows, cfg.n_head, cfg.head_dim)
        k = self._projection(prefix + "attn.k", n).reshape(rows, cfg.n_kv_head, cfg.head_dim)
        v = self._projection(prefix + "attn.v", n).reshape(rows, cfg.n_kv_head, cfg.head_dim)
        factors = self.weights.get("rope.freq_factors")
        q = ops.rope(q, positions, cfg.rope_dims, cfg.rope_theta, cfg.rope_style, factors)
        k = ops.rope(k, positions, cfg.rope_dims, cfg.rope_theta, cfg.rope_style, factors)
        for r, (kind, iteration) in (fill or {}).items():
            # a position past its depth: its K/V of its last iteration, same block
            k[r], v[r] = kv.read((kind, iteration, layer[2]), int(positions[r]))
        k_all, v_all = kv.write(layer, positions, k, v)
        o = ops.attention(q, k_all, v_all, positions, kv.positions(k_all.shape[0]),
                          cfg.attn_scale, self._window)
        return self._linear(prefix + "attn.o.weight", o)

    def _mlp(self, prefix, n):
        act = ops.ACTIVATIONS[self.config.activation]
        gate = self._linear(prefix + "mlp.gate.weight", n)
        up = self._linear(prefix + "mlp.up.weight", n)
        return self._linear(prefix + "mlp.down.weight", act(gate) * up)
