"""Running the ASGI applications under uvicorn."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """Uvicorn re-raises SIGTERM and SIGINT once it has shut down gracefully, which ends the
    process before `finally` blocks and atexit handlers run, so the embedded PostgreSQL would
    never be stopped. A gateway that drained cleanly exits normally instead, with status 0."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {number: signal.signal(number, self.handle_exit) for number in _SIGNALS}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
