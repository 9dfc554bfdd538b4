"""The library's log messages (tl_log_set) forwarded to the `logging` logger "tinyloop".

The C library never prints. The binding installs this forwarder when it opens the
library, so what the library reports (a TINYLOOP_CPU value it ignores, CUDA graphs
turned off and why) reaches users the Python way: warnings and errors show without any
configuration (logging's last-resort handler writes them to stderr), info and debug
once the application configures logging, e.g. logging.basicConfig(level=logging.INFO).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

LOGGER_NAME = "tinyloop"

#: tl_log_level (tinyloop.h) -> logging level
LEVELS = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG}

logger = logging.getLogger(LOGGER_NAME)


def install(ffi: Any, lib: Any) -> Any:
    """Route the library's messages to `logger`. Returns the cffi callback, which must
    stay referenced while the library may call it; None for a library older than
    tl_log_set (it wrote its few warnings to stderr itself)."""
    if not hasattr(lib, "tl_log_set"):
        return None

    @ffi.callback("void(tl_log_level, const char *, void *)")  # type: ignore[untyped-decorator]
    def forward(level: Any, message: Any, _user_data: Any) -> None:
        try:
            text = ffi.string(message).decode("utf-8", "replace")
            logger.log(LEVELS.get(int(level), logging.WARNING), "%s", text)
        except Exception:   # noqa: BLE001 - nothing may unwind into C
            pass

    lib.tl_log_set(forward, ffi.NULL)
    # no call into a finalizing interpreter: later messages wait in the library's backlog
    atexit.register(lib.tl_log_set, ffi.NULL, ffi.NULL)
    return forward
