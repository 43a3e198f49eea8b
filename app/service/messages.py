"""What the edge hands the gateway (`ProxyRequest`) and what it gets back (`Answer`): the one
answer type from the service to the edge, which relays it as it is (or renders the
`errors.GatewayError` the gateway raised instead)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ..model.outcomes import BlockReason, Outcome
from .streaming import Relay

# Resolves when the client has hung up (the proxy port watches its connection).
ClientGoneProbe = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    method: str
    path: str  # normalized (paths.normalize), still percent-encoded
    query: str
    headers: Sequence[tuple[str, str]]  # names in lower case, values as received
    body: bytes
    client_gone: ClientGoneProbe | None = None

    def header_values(self, name: str) -> list[str]:
        return [value for header, value in self.headers if header == name]


@dataclass(slots=True)
class Answer:
    """The upstream's answer, just received or stored, and how the request is counted."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    outcome: Outcome
    # Set when the answer came from the store: the reason counted as a blocked duplicate.
    blocked: BlockReason | None = None
    upstream_seconds: float | None = None  # the upstream call's time, when one was made
    # Set when the body is relayed as the upstream sends it (`streaming.Relay`); `body` is b"".
    stream: Relay | None = None
