"""The upstream port (`oncegate.upstream.Upstream`) in one process: `FakeUpstream` answers from a
script, records every request that reached it, and keeps the port's promises (a `NotSent`
request never reached it; an `AnswerLost` one did). With the in-memory store it drives
`service.Gateway` through every outcome without a socket; what only sockets show (framing,
resets, timeouts of a real client) stays in tests/faults and tests/e2e."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from oncegate.upstream import AnswerLost, NotSent, UpstreamResponse


@dataclass(frozen=True, slots=True)
class Reached:
    """A request as the upstream received it."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def key(self) -> str | None:
        return next((value for name, value in self.headers if name == "idempotency-key"), None)


@dataclass(frozen=True, slots=True)
class Respond:
    status: int = 201
    headers: Sequence[tuple[str, str]] = (("content-type", "application/json"),)
    body: bytes = b'{"performed": true}'
    # Set as the request reaches the upstream; its answer then waits for `until`, when given.
    arrived: asyncio.Event | None = None
    until: asyncio.Event | None = None


# What the upstream does with one request: answer it, or fail the way the port says.
Behaviour = Respond | NotSent | AnswerLost


@dataclass
class FakeUpstream:
    default: Behaviour = field(default_factory=Respond)
    reached: list[Reached] = field(default_factory=list)
    _script: deque[Behaviour] = field(default_factory=deque)

    def will(self, *behaviours: Behaviour) -> None:
        """The next requests get these, in order; then `default` again."""
        self._script.extend(behaviours)

    def requests(self, key: str) -> list[Reached]:
        """The requests with this Idempotency-Key that reached the upstream."""
        return [request for request in self.reached if request.key == key]

    async def send(
        self,
        method: str,
        url: str,
        request_headers: Sequence[tuple[str, str]],
        body: bytes,
        timeout: float,  # noqa: ASYNC109 - the port's signature; the fake never waits that long
        key_header: str = "idempotency-key",
    ) -> UpstreamResponse:
        behaviour = self._script.popleft() if self._script else self.default
        if isinstance(behaviour, NotSent):
            raise behaviour  # it never got here: nothing is recorded
        self.reached.append(Reached(method, url, list(request_headers), body))
        if isinstance(behaviour, AnswerLost):
            raise behaviour
        if behaviour.arrived is not None:
            behaviour.arrived.set()
        if behaviour.until is not None:
            await behaviour.until.wait()
        return UpstreamResponse(behaviour.status, list(behaviour.headers), behaviour.body, 0.001)
