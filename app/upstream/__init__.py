"""The upstream port: what the gateway needs from whatever performs its requests.

`Upstream.send` sends one request and returns the whole answer, or fails in one of two ways, and
the difference is the whole point of the gateway:
- `NotSent`: the request never left. Retrying it cannot cause a second side effect, so the key
  is released.
- `AnswerLost`: the request may have reached the upstream, but no complete answer came back.
  The side effect may have happened, so the key turns `unknown`.
No other exception may leave `send`. `client.HttpUpstream` is the implementation that runs (on
aiohttp); tests drive the service in one process with a fake that keeps the same promises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..kernel import keys


class NotSent(Exception):
    """The request did not reach the upstream."""


class AnswerLost(Exception):
    """The request may have reached the upstream; its answer did not come back. What the
    gateway saw of it is kept with the key for the operator: whether it timed out, whether the
    answer's status line came back (`status`), and how many bytes of its body did."""

    def __init__(
        self, message: str, *, timed_out: bool, status: int | None = None, received: int = 0
    ) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.status = status
        self.received = received


class BodyStream(Protocol):
    """The rest of an answer's body, as the upstream sends it: chunks, in order, then the end.
    A break (a timeout between two chunks, a reset) raises `AnswerLost`, with what came."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    @property
    def received(self) -> int:
        """Bytes of the body received so far."""

    def close(self) -> None:
        """Stop reading now and give the connection up (not reused: its answer was not read
        whole). A read waiting for the upstream ends at once, with `AnswerLost`."""


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[str, str]]  # end-to-end headers only
    body: bytes  # the whole body, or b"" when `stream` brings it
    duration: float  # to the whole body, or to the head when streamed
    stream: BodyStream | None = None


class Upstream(Protocol):
    async def send(
        self,
        method: str,
        url: str,
        request_headers: Sequence[tuple[str, str]],
        body: bytes,
        timeout: float,  # noqa: ASYNC109 - a per-route budget, the implementation applies it
        key_header: str = keys.HEADER_NAME,
    ) -> UpstreamResponse:
        """Send one request and read its whole answer within `timeout` seconds. `key_header`
        (lower case) is sent even when the client names it in `Connection`: the key."""
        ...
