"""A transport that records what a server protocol gives it, and the request the unit tests of
the proxy port's protocol (`oncegate.http.protocol`) feed it, in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

BODY = b'{"a":1}'
REQUEST = (
    b"POST /emails HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)


class Calls(asyncio.Transport):
    """A transport that keeps every call that sends bytes or ends the connection, one item per
    call; `until` waits for a condition on them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False
        self.changed = asyncio.Event()

    def _record(self, call: str, data: bytes) -> None:
        self.calls.append((call, data))
        self.changed.set()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "written after the connection closed"
        self._record("write", bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        assert not self.closing, "written after the connection closed"
        self._record("writelines", b"".join(bytes(data) for data in list_of_data))

    def close(self) -> None:
        self.closing = True
        self._record("close", b"")

    def abort(self) -> None:
        self.closing = True
        self._record("abort", b"")

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        pass

    def sent(self) -> bytes:
        """Every byte written, in order."""
        return b"".join(data for _, data in self.calls)

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not done():
                self.changed.clear()
                await self.changed.wait()
