"""The upstream HTTP client: one pooled client for all routes, timeouts, hop-by-hop filtering.

Failures come in two kinds, and the difference is the whole point of the gateway:
- `NotSent`: the request never left (connection refused, connect or pool timeout). Retrying it
  cannot cause a second side effect, so the key is released.
- `AnswerLost`: the request may have reached the upstream, but no complete answer came back
  (read timeout, reset, malformed answer). The side effect may have happened, so the key turns
  `unknown`.
Bodies travel as raw bytes in both directions: no decompression, so a stored
`Content-Encoding: gzip` answer is replayed byte for byte.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx

# RFC 9110 §7.6.1: connection-specific fields, never forwarded or stored. Keep-Alive and
# Proxy-Connection are the legacy ones it names; Content-Length is recomputed on each hop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "content-length",
    }
)
# Set by the client for the upstream's address, never copied from the incoming request.
_REQUEST_ONLY = frozenset({"host", "expect"})

# Connecting to an upstream on the same network takes milliseconds; waiting longer than this
# for a TCP handshake means it is down, and saying so quickly is kinder than the route timeout.
CONNECT_TIMEOUT = 5.0
MAX_CONNECTIONS = 512


class UpstreamError(Exception):
    pass


class NotSent(UpstreamError):
    """The request did not reach the upstream."""


class AnswerLost(UpstreamError):
    """The request may have reached the upstream; its answer did not come back."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[str, str]]  # end-to-end headers only
    body: bytes
    duration: float


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Headers named in `Connection: a, b` are hop-by-hop too."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    }


def end_to_end(
    headers: Sequence[tuple[str, str]], drop: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """`headers` without hop-by-hop fields and without the names in `drop` (lower case)."""
    excluded = HOP_BY_HOP | drop | _connection_tokens(headers)
    return [(name, value) for name, value in headers if name.lower() not in excluded]


class Upstream:
    """A pooled HTTP client. Owned by the application's lifespan; close it with `aclose`."""

    def __init__(self) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
            ),
            follow_redirects=False,
            trust_env=False,
        )
        # httpx adds Accept, Accept-Encoding, Connection and User-Agent to every request; a proxy
        # sends what its client sent, so drop them.
        for name in list(self._client.headers):
            del self._client.headers[name]

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        timeout: float,  # noqa: ASYNC109 - a per-route budget, applied below with asyncio.timeout
    ) -> UpstreamResponse:
        """Send one request and read its whole answer within `timeout` seconds."""
        request = self._client.build_request(
            method,
            url,
            headers=end_to_end(headers, drop=_REQUEST_ONLY),
            content=body,
            timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT)),
        )
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                response = await self._client.send(request, stream=True)
                try:
                    chunks = [chunk async for chunk in response.aiter_raw()]
                finally:
                    await response.aclose()
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotSent(f"{type(exc).__name__}: {exc}") from exc
        except httpx.UnsupportedProtocol as exc:
            raise NotSent(str(exc)) from exc
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise AnswerLost(f"no answer within {timeout:g}s", timed_out=True) from exc
        except httpx.TransportError as exc:
            raise AnswerLost(f"{type(exc).__name__}: {exc}", timed_out=False) from exc
        return UpstreamResponse(
            status=response.status_code,
            headers=end_to_end(
                [
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in response.headers.raw
                ]
            ),
            body=b"".join(chunks),
            duration=time.perf_counter() - started,
        )
