"""The server's counters, gauges and latency histograms, and their Prometheus text
(`GET /metrics`, docs/server.md "Metrics"): what a deployment watches, as vLLM's and
llama.cpp's servers expose it. Thread-safe: every handler thread records into one
ServerMetrics.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

# seconds; a request's first text piece, and the whole request
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# loop iterations: the depth of the pass that chose a generated token (adaptive depth)
DEPTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# the memory report's byte counts exported as gauges (Model.memory_report keys)
MEMORY_GAUGES = ("weights_bytes", "kv_cache_bytes", "prefix_cache_bytes", "device_bytes", "total_bytes",
                 "kv_pages_in_use")


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def lines(self, name: str) -> list:
        out, total = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {total}"]


class ServerMetrics:
    """What the server records: responses by route and status, tokens, finish reasons,
    requests waiting for a slot and running, requests refused by a limit, time to the first text piece and whole
    request durations of the generation endpoints."""

    def __init__(self):
        self._lock = threading.Lock()
        self.responses: dict = {}          # (route, status) -> count
        self.finished: dict = {}           # finish_reason -> choices
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.waiting = self.running = 0
        self.rejections: dict = {}         # reason -> requests refused before any work
        self.ttft = Histogram(TTFT_BUCKETS)
        self.duration = Histogram(REQUEST_BUCKETS)
        self.depths = Histogram(DEPTH_BUCKETS)

    def response(self, route: str, status: int) -> None:
        with self._lock:
            key = (route, int(status))
            self.responses[key] = self.responses.get(key, 0) + 1

    def queue(self, waiting: int = 0, running: int = 0) -> None:
        """Move requests between waiting for a slot and running (deltas)."""
        with self._lock:
            self.waiting += waiting
            self.running += running

    def rejected(self, reason: str) -> None:
        """A request refused by a limit or a check (queue_full, timeout, draining, auth,
        host, origin)."""
        with self._lock:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def first_piece(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def generation(self, seconds: float, prompt_tokens: int, generated: int, cached: int,
                   finish_reasons, depths=()) -> None:
        """A generation request that was answered: its duration, tokens, its choices'
        finish reasons (None for a choice that did not finish) and the loop depth of each
        generated token."""
        counted = Counter(depths)
        with self._lock:
            for depth, times in counted.items():
                self.depths.observe(depth, times)
            self.duration.observe(seconds)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.cached_tokens += cached
            for reason in finish_reasons:
                if reason is not None:
                    self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, model=None) -> str:
        """Prometheus text exposition (format 0.0.4); with `model`, its memory report too."""
        memory = model.memory_report() if model is not None else {}
        with self._lock:
            lines = []

            def family(name, kind, help_text, samples):
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
                lines.extend(samples)

            family("tinyloop_http_responses_total", "counter", "HTTP responses by route and status code.",
                   [f'tinyloop_http_responses_total{{route="{route}",status="{status}"}} {count}'
                    for (route, status), count in sorted(self.responses.items())])
            family("tinyloop_prompt_tokens_total", "counter", "Prompt tokens of answered generation requests.",
                   [f"tinyloop_prompt_tokens_total {self.prompt_tokens}"])
            family("tinyloop_cached_prompt_tokens_total", "counter",
                   "Prompt tokens a kept sequence already held (not computed again).",
                   [f"tinyloop_cached_prompt_tokens_total {self.cached_tokens}"])
            family("tinyloop_generation_tokens_total", "counter", "Tokens generated for answered requests.",
                   [f"tinyloop_generation_tokens_total {self.generation_tokens}"])
            family("tinyloop_choices_finished_total", "counter", "Choices ended, by finish_reason.",
                   [f'tinyloop_choices_finished_total{{finish_reason="{reason}"}} {count}'
                    for reason, count in sorted(self.finished.items())])
            family("tinyloop_requests_waiting", "gauge", "Generation requests waiting for a slot.",
                   [f"tinyloop_requests_waiting {self.waiting}"])
            family("tinyloop_requests_running", "gauge", "Generation requests holding a slot.",
                   [f"tinyloop_requests_running {self.running}"])
            family("tinyloop_queue_length", "gauge",
                   "Generation requests waiting for a slot (the same as tinyloop_requests_waiting).",
                   [f"tinyloop_queue_length {self.waiting}"])
            family("tinyloop_requests_rejected_total", "counter",
                   "Requests refused by a limit or a check, by reason.",
                   [f'tinyloop_requests_rejected_total{{reason="{reason}"}} {count}'
                    for reason, count in sorted(self.rejections.items())])
            family("tinyloop_time_to_first_piece_seconds", "histogram",
                   "From a generation request's arrival to its first text piece.",
                   self.ttft.lines("tinyloop_time_to_first_piece_seconds"))
            family("tinyloop_request_duration_seconds", "histogram",
                   "From a generation request's arrival to its answer's end.",
                   self.duration.lines("tinyloop_request_duration_seconds"))
            family("tinyloop_generation_token_depth", "histogram",
                   "Loop depth of the pass that chose each generated token (adaptive depth: where the "
                   "exit rule stopped it).", self.depths.lines("tinyloop_generation_token_depth"))
        for key in MEMORY_GAUGES:
            if key in memory:
                name = f"tinyloop_memory_{key}"
                family(name, "gauge", f"The model's memory report: {key}.", [f"{name} {memory[key]}"])
        return "\n".join(lines) + "\n"
