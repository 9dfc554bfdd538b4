"""Progress lines on stderr for long conversion steps."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints `label: 42% (12.3/29.0 MB) name` on one stderr line, at most every 0.2 s.

    Use as the `progress(done, total, what)` callback of the writer and the downloaders;
    call `.finish()` to end the line."""

    def __init__(self, label: str, enabled: bool = True, stream=None):
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.2:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        line = f"\r{self.label}: {pct:5.1f}% ({done / 1e6:.1f}/{total / 1e6:.1f} MB) {what[:40]:<40}"
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def note(message: str) -> None:
    """A one-line status or warning message on stderr."""
    print(message, file=sys.stderr, flush=True)
